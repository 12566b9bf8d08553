"""Data-parallel FP8 training of a te_func model with FSDP2, and a resume from a distributed checkpoint.

    torchrun --standalone --nproc_per_node 2 examples/fsdp_train.py --steps 10

CPU ranks talk over gloo, GPU ranks (one GPU each) over NCCL. Every rank trains on
its own batches; DelayedScaling's amaxes are all-reduced, so the ranks keep
identical histories. Halfway, the run saves a checkpoint; a fresh model loads it
and repeats the second half, which must come out bit-identical.
"""
import argparse
import os
import shutil
import tempfile

# NVLink SHARP and multicast stay off (the machines these examples run on ask for it).
for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(var, value)

import torch                                          # noqa: E402
import torch.distributed as dist                      # noqa: E402
import torch.distributed.checkpoint as dcp            # noqa: E402
from torch.distributed.fsdp import fully_shard        # noqa: E402

import te_func as tef                                 # noqa: E402
from te_func.recipe import DelayedScaling             # noqa: E402


def build(recipe, device, fp8_all_gather: bool):
    """A te_func model sharded by FSDP2, in a Stateful shell, and its optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(tef.nn.LayerNormMLP(64, 256), tef.nn.LayerNormLinear(64, 64)).to(device)
    if fp8_all_gather:        # before fully_shard: the weights then travel in FP8
        tef.distributed.enable_fsdp_float8_all_gather(model, recipe)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    shell = tef.Stateful(model, recipe)
    return shell, torch.optim.AdamW(shell.parameters(), lr=1e-3)


def train(shell, opt, steps: range, device, log: bool):
    rank = dist.get_rank()
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)         # each rank its own batch
        x = torch.randn(4, 16, 64, generator=g).to(device)           # (batch, tokens, hidden)
        loss = shell(x, is_first_microbatch=True).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if log:
            total = loss.detach().clone()
            dist.all_reduce(total)
            if rank == 0:
                print(f"step {step} loss {total.item() / dist.get_world_size():.6f}")


def gathered(tensors: dict) -> list[dict]:
    """Every rank's copy of `tensors`, on CPU, FP8 ones as their bytes (pickle takes no float8)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, {k: (v.view(torch.uint8) if v.element_size() == 1 else v).detach().cpu()
                                 for k, v in tensors.items()})
    return out


def state(shell) -> dict:
    params = {k: p.full_tensor() for k, p in shell.model.named_parameters()}
    return {**params, **shell.workspaces}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fp8-all-gather", action="store_true")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    recipe = DelayedScaling(amax_history_len=16)          # reduce_amax=True: TE's default
    half = args.steps // 2

    shell, opt = build(recipe, device, args.fp8_all_gather)
    train(shell, opt, range(half), device, log=True)
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save(tef.distributed.state_dict(shell, opt), checkpoint_id=path[0])
    train(shell, opt, range(half, args.steps), device, log=True)

    ranks = gathered(shell.workspaces)
    identical = all(torch.equal(r[k], ranks[0][k]) for r in ranks for k in ranks[0])

    resumed, resumed_opt = build(recipe, device, args.fp8_all_gather)
    sd = tef.distributed.state_dict(resumed, resumed_opt)
    dcp.load(sd, checkpoint_id=path[0])
    tef.distributed.load_state_dict(resumed, resumed_opt, sd)
    train(resumed, resumed_opt, range(half, args.steps), device, log=False)
    a, b = state(shell), state(resumed)
    same = torch.tensor(float(all(torch.equal(a[k], b[k]) for k in a)), device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        print(f"histories identical on all ranks: {identical}")
        print(f"resumed run bit-identical: {bool(same.item())}")
        shutil.rmtree(path[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
