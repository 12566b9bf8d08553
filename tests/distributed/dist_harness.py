"""What the distributed tests share: starting ranks, the model, the data, the single-process reference.

`run_ranks(fn, world, *args)` runs `fn(rank, world, *args)` in `world` fresh processes
that form a process group (gloo on CPU, NCCL with `backend="nccl"`), and returns what
each rank's `fn` returned. The processes fork from a server that has imported torch
and te_func once per test process, so a start costs little.

The reference: data parallelism over N ranks computes what one process computes with
the N ranks' batches as N microbatches of a step (te_func.distributed), so every
distributed run here is compared with such a single-process run, bit for bit where
the same operations run in the same order.
"""
from __future__ import annotations

import copy
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import te_func as tef

# Every process started here, and every torchrun child: NVLink SHARP and multicast off.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
IN, HIDDEN, OUT = 32, 64, 32
TOKENS = 8          # per rank and microbatch


def _entry(rank, world, backend, store, results, fn, args, port):
    os.environ.update(NCCL_ENV)
    torch.set_num_threads(1)       # two cores, several ranks
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if port is None:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    else:   # what torchrun sets: the script makes its own process group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    try:
        out = fn(rank, world, *args)
        torch.save(out, os.path.join(results, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(results, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_context = None


def _mp_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "te_func", "dist_harness", "torch.distributed.fsdp",
                                         "torch.distributed.tensor.parallel", "torch.distributed.checkpoint"])
    return _context


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world: int, *args, backend: str = "gloo", timeout: float = 120.0, torchrun_env: bool = False) -> list:
    """[fn(rank, world, *args) for each rank], each in its own process of one process group;
    with torchrun_env, no group: the environment torchrun gives its children instead."""
    os.environ.update(NCCL_ENV)
    port = _free_port() if torchrun_env else None
    with tempfile.TemporaryDirectory() as tmp:
        ctx = _mp_context()
        procs = [ctx.Process(target=_entry, args=(r, world, backend, os.path.join(tmp, "store"), tmp, fn, args, port))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        errors = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                errors.append(f"rank {r} did not finish within {timeout} s")
            err = os.path.join(tmp, f"rank{r}.err")
            if os.path.exists(err):
                errors.append(f"rank {r}:\n" + open(err).read())
            elif p.exitcode != 0 and not p.is_alive():
                errors.append(f"rank {r} exited with {p.exitcode}")
        if errors:
            raise AssertionError("\n".join(errors))
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


# --- the model and the data -----------------------------------------------------------------

def make_model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    """A small te_func MLP: LayerNormLinear -> GELU -> Linear -> LayerNormMLP, the same on every rank."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(tef.nn.LayerNormLinear(IN, HIDDEN, params_dtype=dtype), torch.nn.GELU(),
                               tef.nn.Linear(HIDDEN, IN, params_dtype=dtype),
                               tef.nn.LayerNormMLP(IN, HIDDEN, params_dtype=dtype))


def batch(step: int, rank: int, micro: int = 0, dtype=torch.float32):
    """(x, y) of rank `rank`'s microbatch `micro` at `step`: (TOKENS, IN) each, different on every rank."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(TOKENS, IN, generator=g)
    y = torch.randn(TOKENS, OUT, generator=g)
    return x.to(dtype), y.to(dtype)


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out.float(), y.float())


def mlp_loss(shell, step: int, rank: int, micro: int, first: bool, device="cpu"):
    """The loss of rank `rank`'s microbatch `micro` at `step` through `shell` (make_model's model)."""
    x, y = (t.to(device) for t in batch(step, rank, micro))
    return loss_fn(shell(x, is_first_microbatch=first), y)


def shard(model: torch.nn.Module, **kwargs):
    """fully_shard each te_func layer, then the root."""
    from torch.distributed.fsdp import fully_shard
    for m in model:
        if isinstance(m, tef.nn.TEModule):
            fully_shard(m, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of a (DTensor's global) value: also the high-precision tensor an FP8
    all-gather weight wraps."""
    t = t.detach()
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return getattr(t, "_tensor", t).clone()


def bits(t: torch.Tensor) -> torch.Tensor:
    # torch.equal has no CPU kernel for the float8 dtypes: compare their bytes.
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def same(a: dict, b: dict) -> list[str]:
    """The keys whose tensors differ (bit for bit) between a and b."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [k for k in a if not torch.equal(bits(a[k].detach().cpu()), bits(b[k].detach().cpu()))]


class Reference:
    """The single-process run a data-parallel run over `world` ranks equals: each step, the
    ranks' microbatches as microbatches of one step (microbatch m of every rank, rank by
    rank, then m + 1), the gradient of each microbatch index averaged over the ranks as
    FSDP's reduce-scatter averages it, then one AdamW step.

    The same model (a copy), recipe and optimizer as the distributed run."""

    def __init__(self, model, recipe, world: int, micro: int = 1, lr: float = 1e-2, device="cpu", loss_of=mlp_loss):
        self.shell = tef.Stateful(copy.deepcopy(model).to(device), recipe)
        self.opt = torch.optim.AdamW(self.shell.parameters(), lr=lr)
        self.world, self.micro, self.device, self.loss_of = world, micro, device, loss_of

    def step(self, step: int) -> list[list[torch.Tensor]]:
        """Run one step; returns its losses [rank][microbatch]."""
        named = dict(self.shell.model.named_parameters())
        total = {k: torch.zeros_like(p) for k, p in named.items()}
        losses = [[None] * self.micro for _ in range(self.world)]
        for m in range(self.micro):
            grads = []
            for r in range(self.world):
                loss = self.loss_of(self.shell, step, r, m, m == 0 and r == 0, self.device)
                loss.backward()
                losses[r][m] = loss.detach().cpu()
                grads.append({k: p.grad for k, p in named.items()})
                self.shell.model.zero_grad(set_to_none=True)
            for k in total:      # this microbatch's reduce-scatter: the sum over ranks / world
                g = grads[0][k]
                for other in grads[1:]:
                    g = g + other[k]
                total[k] = total[k] + g / self.world
        for k, p in named.items():
            p.grad = total[k]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return losses

    def params(self) -> dict:
        return {k: p.detach().cpu().clone() for k, p in self.shell.model.named_parameters()}

    def workspaces(self) -> dict:
        return {k: v.cpu().clone() for k, v in self.shell.workspaces.items()}


def reference_run(model, recipe, world: int, steps: int, micro: int = 1, device="cpu", loss_of=mlp_loss):
    """(losses[step][rank][micro], final parameters, final workspaces) of `Reference` over `steps`.
    Run it outside the ranks' process group: there DelayedScaling would all-reduce its amaxes."""
    ref = Reference(model, recipe, world, micro, device=device, loss_of=loss_of)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # as every rank runs: CPU kernels may split their sums by thread
    try:
        losses = [ref.step(s) for s in range(steps)]
    finally:
        torch.set_num_threads(threads)
    return losses, ref.params(), ref.workspaces()
