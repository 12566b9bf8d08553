"""FSDP2 (`fully_shard`): which weight a te_func layer casts. It casts the whole weight, as one
process would, once per step (1-D meshes, Shard(0) only):

- Module path (`Stateful`, or `functional_call` given the model's own parameters): FSDP's hooks
  gather each unit before its forward; te_func casts the unsharded tensors and FSDP
  reduce-scatters the weight gradient.
- Functional path (`functional_call` given other tensors for the sharded parameters): FSDP's
  hooks would ignore them, and torch.func cannot run through them, so te_func suspends them and
  gathers each given shard with an all-gather whose backward reduce-scatters (averaged, as FSDP
  does). `tef.grad` gathers before differentiating and reduce-scatters after, so the gradients
  come back as DTensor shards laid out like the parameters.
- `init_workspaces`: the casts are made from the gathered weights, one weight at a time."""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..ops import call

if TYPE_CHECKING:       # imported only when used: torch.distributed.tensor is slow to import
    from torch.distributed.tensor import DTensor

__all__ = ["fsdp_units", "is_fsdp_managed", "cast_sources", "gathered_params", "gathered_for_grad", "scattered_grads"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def fsdp_units(model: nn.Module) -> dict:
    """Path -> module of every `fully_shard` unit in `model` (empty without torch.distributed)."""
    if not _initialized():
        return {}
    from torch.distributed.fsdp import FSDPModule
    return {path: m for path, m in model.named_modules() if isinstance(m, FSDPModule)}


def is_fsdp_managed(module_path: str, units: dict) -> bool:
    """Whether the parameters of the module at `module_path` belong to an FSDP unit (it or an ancestor)."""
    return any(p == "" or module_path == p or module_path.startswith(p + ".") for p in units)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _check_spec(name: str, spec):
    from torch.distributed.tensor import Shard
    if spec.mesh.ndim != 1 or tuple(spec.placements) != (Shard(0),):
        raise NotImplementedError(
            f"te_func gathers FSDP-sharded parameters laid out as Shard(0) on a 1-D mesh; {name} is "
            f"{tuple(spec.placements)} on a {spec.mesh.ndim}-D mesh (FSDP over tensor parallelism, HSDP or a "
            f"shard_placement_fn). Train such a model through tef.Stateful, where FSDP gathers it")


def _full(weight: DTensor) -> torch.Tensor:
    """The whole value of an FSDP-sharded DTensor, as a plain tensor."""
    spec = weight._spec
    local = weight.to_local()
    local = getattr(local, "_tensor", local)          # an FP8 all-gather weight's high-precision values
    return _all_gather_rows(local.detach(), spec.shape[0], spec.mesh.get_group())


def cast_sources(module_path: str, module, units: dict) -> dict | None:
    """GEMM weight parameter name (`gemm_param`) -> the gathered parameter to cast, for those FSDP
    keeps sharded (or None). A parameter several GEMMs read (experts') is gathered once."""
    if not units or not is_fsdp_managed(module_path, units):
        return None
    weights = {}
    for name in dict.fromkeys(module.gemm_param(g.weight) for g in module.gemms()):
        w = getattr(module, name)
        if _is_dtensor(w):
            _check_spec(f"{module_path}.{name}" if module_path else name, w._spec)
            with torch.no_grad():
                weights[name] = _full(w)
    return weights or None


# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _chunk(rows: int, world: int) -> int:
    # Shard(0): torch.chunk's ceil(rows / world) rows a rank, the last ones shorter or empty.
    return -(-rows // world)


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _all_gather_rows(local: torch.Tensor, rows: int, group) -> torch.Tensor:
    """The whole (rows, ...) tensor from every rank's Shard(0) shard `local`."""
    chunk = _chunk(rows, dist.get_world_size(group))
    local = _padded(local, chunk).contiguous()
    full = local.new_empty(dist.get_world_size(group) * chunk, *local.shape[1:])
    # c10d's collectives: the functional ones carry autograd Functions torch.func refuses.
    with torch.no_grad():
        _ALL_GATHER(full, local, group=group)
    return full[:rows]


def _reduce_scatter_rows(full: torch.Tensor, group) -> torch.Tensor:
    """This rank's Shard(0) shard of `full` (rows, ...) averaged over the ranks (FSDP's gradient reduction)."""
    world, rank, rows = dist.get_world_size(group), dist.get_rank(group), full.shape[0]
    chunk = _chunk(rows, world)
    full = _padded(full, world * chunk).contiguous()
    local = full.new_empty(chunk, *full.shape[1:])
    with torch.no_grad():
        _REDUCE_SCATTER(local, full, op=dist.ReduceOp.AVG, group=group)
    return local[:max(0, min(chunk, rows - rank * chunk))]


@dataclass(frozen=True)
class _GatherShards:
    """The whole parameter from this rank's Shard(0) shard; backward reduce-scatters (averaged)."""
    group: object
    rows: int                    # the parameter's rows (dim 0)
    outputs = ("full",)
    differentiable = ("full",)
    saved = ()

    @property
    def carried(self):
        return {}

    def forward(self, t):
        return {"full": _all_gather_rows(t["local"], self.rows, self.group)}

    def backward(self, saved, grads, ctx):
        return {"local": _reduce_scatter_rows(grads["full"], self.group)}


def _gather(name: str, t: DTensor) -> torch.Tensor:
    spec = t._spec
    _check_spec(name, spec)
    local = t.to_local()      # differentiable: the shard's gradient comes back a DTensor
    return call(_GatherShards(spec.mesh.get_group(), spec.shape[0]), local=local)["full"]


@contextlib.contextmanager
def _fsdp_forward_hooks_suspended(units):
    from torch.distributed.fsdp import fully_shard
    saved = []
    try:
        for m in units:
            state = fully_shard.state(m)

            def kept(hooks, state=state):
                return OrderedDict((k, h) for k, h in hooks.items() if getattr(h, "__self__", None) is not state)

            pre, post = kept(m._forward_pre_hooks), kept(m._forward_hooks)
            if len(pre) == len(m._forward_pre_hooks) or len(post) == len(m._forward_hooks):
                raise RuntimeError(f"te_func could not find FSDP's forward hooks on {type(m).__name__} (this torch "
                                   f"version registers them differently); train the model through tef.Stateful")
            saved.append((m, m._forward_pre_hooks, m._forward_hooks))
            m._forward_pre_hooks, m._forward_hooks = pre, post
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post


@contextlib.contextmanager
def gathered_params(model: nn.Module, params: dict):
    """The `params` an FSDP model's functional call runs with: as given where FSDP's hooks gather,
    else with every sharded entry gathered, FSDP's forward hooks suspended."""
    if not _initialized():
        yield params
        return
    units = fsdp_units(model)
    own = dict(model.named_parameters())
    managed = [k for k in own if k in params and is_fsdp_managed(k.rpartition(".")[0], units)]
    for k in own.keys() - set(managed):
        if k in params and _is_dtensor(own[k]) and not _is_dtensor(params[k]):
            raise NotImplementedError(
                f"{k} is a tensor-parallel (DTensor) parameter but was given as a plain tensor: tef.grad / "
                f"tef.value_and_grad cannot differentiate DTensor layouts (torch.func does not trace them). "
                f"Use tef.functional_call with loss.backward(), or tef.Stateful")
    if all(params[k] is own[k] for k in managed):
        yield params
        return
    gathered = dict(params)
    for k in managed:
        t = params[k]
        if _is_dtensor(t):
            gathered[k] = _gather(k, t)
        elif tuple(t.shape) != tuple(own[k].shape):
            raise ValueError(f"parameter {k} of shape {tuple(t.shape)} was given for an FSDP-sharded parameter of "
                             f"shape {tuple(own[k].shape)}: pass the DTensor shard (model.named_parameters()) "
                             f"or the whole tensor")
    with _fsdp_forward_hooks_suspended(units.values()):
        yield gathered


def gathered_for_grad(args: tuple, argnums: tuple) -> tuple[tuple, dict]:
    """`args` with the DTensor entries at `argnums` gathered into whole plain tensors, and name ->
    DTensorSpec of those: torch.func cannot trace DTensors, so gather and reduce-scatter
    (`scattered_grads`) run outside the transform."""
    if not _initialized():
        return args, {}
    gathered, specs = list(args), {}
    for n in argnums:
        a = gathered[n]
        if isinstance(a, dict) and any(_is_dtensor(v) for v in a.values()):
            for k, v in a.items():
                if _is_dtensor(v):
                    _check_spec(k, v._spec)
                    specs[k] = v._spec
            with torch.no_grad():
                gathered[n] = {k: _full(v) if k in specs else v for k, v in a.items()}
        elif not isinstance(a, dict) and any(_is_dtensor(v) for v in torch.utils._pytree.tree_leaves(a)):
            raise TypeError("tef.grad: pass DTensor (FSDP-sharded) parameters as one dict, name -> tensor")
    return tuple(gathered), specs


def _scatter(g: torch.Tensor, spec) -> torch.Tensor:
    """A whole gradient reduce-scattered to `spec`'s Shard(0) layout, averaged over the ranks."""
    from torch.distributed.tensor import DTensor
    local = _reduce_scatter_rows(g, spec.mesh.get_group())
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                              stride=spec.stride)


def scattered_grads(grads, argnums, specs: dict):
    """The gathered parameters' gradients as DTensor shards like the parameters (averaged)."""
    if not specs:
        return grads

    def scatter(g: dict):
        return {k: _scatter(v, specs[k]) if k in specs else v for k, v in g.items()}

    if isinstance(argnums, int):
        return scatter(grads) if isinstance(grads, dict) else grads
    return tuple(scatter(g) if isinstance(g, dict) else g for g in grads)
