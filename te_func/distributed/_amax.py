"""DelayedScaling's amax reduction across ranks (TE's `reduce_amax`).

Every rank records the amaxes of its own data; the current slot of every history is all-reduced
by max over the amax group, as one batched all-reduce, where TE does it: after a forward (input
and weight roles) and after a backward (the gradient role). So every rank holds the same
workspaces, and one rank's checkpoint is valid for all."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..quant import lower

__all__ = ["amax_reduction_group", "reduce_amax_slots"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def amax_reduction_group(recipe, amax_group=None):
    """The group DelayedScaling(reduce_amax=True) all-reduces amaxes over, or None. amax_group: None
    for the default group of more than one rank (TE's `fp8_group=None`), a ProcessGroup or a 1-D mesh."""
    if amax_group is not None and not _initialized():
        raise RuntimeError(f"amax_group={amax_group!r} was given but torch.distributed is not initialized: call "
                           f"torch.distributed.init_process_group(...) first, or pass amax_group=None in a "
                           f"single process")
    if not lower(recipe).keeps_history or not recipe.reduce_amax:
        return None
    if amax_group is None:
        return dist.group.WORLD if _initialized() and dist.get_world_size() > 1 else None
    if hasattr(amax_group, "get_group"):                       # a DeviceMesh
        if amax_group.ndim != 1:
            raise ValueError(f"amax_group: a DeviceMesh must be 1-D (pick the dimension: mesh['dp']), got "
                             f"{amax_group.ndim} dimensions")
        amax_group = amax_group.get_group()
    if not isinstance(amax_group, dist.ProcessGroup):
        raise TypeError(f"amax_group must be None, a torch.distributed ProcessGroup or a 1-D DeviceMesh, got "
                        f"{type(amax_group).__name__}")
    return amax_group if dist.get_world_size(amax_group) > 1 else None


def _all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    # A functional collective: a new tensor, nothing mutated, traceable by torch.compile.
    from torch.distributed import _functional_collectives as funcol
    return funcol.wait_tensor(funcol.all_reduce(t, "max", group))


def reduce_amax_slots(histories: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """`histories` with slot 0 of each all-reduced by max over `group`, in one all-reduce (collective)."""
    if group is None or not histories:
        return histories
    names = sorted(histories)
    # Detached: new values of state, which no gradient flows through.
    slots = _all_reduce_max(torch.stack([histories[k].detach()[0] for k in names]), group)    # (n,)
    return {k: torch.cat([slots[i:i + 1], histories[k][1:]]) for i, k in enumerate(names)}
