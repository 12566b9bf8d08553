"""Distributed checkpoints (torch.distributed.checkpoint) of a `Stateful` and its optimizer.

Parameters and optimizer state come from torch's `get_state_dict` (DTensor shards under FSDP,
resharded on load); the workspace entries, the same on every rank, are saved once. DelayedScaling
without amax reduction is the exception: each rank's histories are its own, saved per rank (one
row per rank) and loaded only on as many ranks. docs/distributed.md shows the calls."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..nn import TEModule
from ..quant import lower
from ._amax import amax_reduction_group

__all__ = ["state_dict", "load_state_dict"]

_WS = "workspaces."


def _per_rank_keys(shell) -> list[str]:
    """The workspace entries that differ between ranks: DelayedScaling state without reduction."""
    if not lower(shell.recipe).keeps_history or not (dist.is_available() and dist.is_initialized()):
        return []
    if dist.get_world_size() == 1 or amax_reduction_group(shell.recipe, shell.amax_group) is not None:
        return []
    # By the entries' declared kinds (te_func.quant.workspace.Entry), not by their names.
    return [f"{path}.{k}" if path else k for path, m in shell.model.named_modules() if isinstance(m, TEModule)
            for k, e in m.workspace_spec(shell.recipe).items() if e.kind in ("amax_history", "scale")]


def _world_mesh(device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device.type, (dist.get_world_size(),))


def state_dict(shell, optimizer=None) -> dict:
    """{"model", "optim", "workspaces"} of `shell` for torch.distributed.checkpoint (collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    sd: dict
    if optimizer is None:
        sd = {"model": get_model_state_dict(shell.model)}
    else:
        model_sd, optim_sd = get_state_dict(shell.model, optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
    # Backward amaxes a compiled call left waiting join the histories here, all-reduced.
    shell._merge_pending()
    ws = dict(shell.workspaces)
    per_rank = _per_rank_keys(shell)
    if per_rank:
        from torch.distributed.tensor import DTensor, Shard
        mesh = _world_mesh(next(iter(ws.values())).device)
        for k in per_rank:
            ws[k] = DTensor.from_local(ws[k].unsqueeze(0), mesh, [Shard(0)], run_check=False)   # (ranks, ...)
    sd["workspaces"] = ws
    return sd


def load_state_dict(shell, optimizer, state_dict: dict) -> None:
    """Restore what `state_dict` holds (loaded by torch.distributed.checkpoint) into `shell` and `optimizer`."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    if optimizer is None:
        set_model_state_dict(shell.model, state_dict["model"])
    else:
        set_state_dict(shell.model, optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
    ws = {}
    for k, v in state_dict["workspaces"].items():
        if hasattr(v, "to_local"):                        # a per-rank entry: this rank's row
            v = v.to_local()[0]
        ws[_WS + k] = v
    # Workspaces only: Stateful checks them against the model and recipe.
    shell.load_state_dict(ws, strict=False)
