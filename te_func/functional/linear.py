"""`linear`: TE's Linear as a function of tensors and one op-local workspace."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import LinearFP8, call
from ..quant import Gemm
from ._common import autocast_input, check_input, first_microbatch
from ._gemm import GemmStep

__all__ = ["linear", "LINEAR_GEMMS"]

LINEAR_GEMMS = (Gemm("weight"),)


def linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, recipe=None,
           workspace: dict | None = None, is_first_microbatch: bool | None = None,
           update_state: bool | None = None, batch_scales: bool = False):
    """y = inp @ weight.T + bias, in FP8 per `recipe` (None: exactly `F.linear`).

    inp: (..., in_features); weight: (out_features, in_features); bias: (out_features,).
    workspace: this op's entries (docs/workspaces.md), or None to start empty.
    update_state: whether a call that starts a step updates DelayedScaling's state (None: when grad
    is enabled, as in TE). batch_scales: a per-sample call in batch scope, quantized with the
    workspace's batch amaxes. Returns `(out, new_workspace)`, out (..., out_features) in inp's dtype."""
    out_features, in_features = weight.shape
    check_input("Linear", inp, in_features, {"weight": weight, "bias": bias}, recipe)
    workspace = {} if workspace is None else workspace
    if recipe is None:
        return F.linear(inp, weight.to(inp.dtype), None if bias is None else bias.to(inp.dtype)), workspace
    ifm = first_microbatch(is_first_microbatch, "Linear")
    step = GemmStep.begin(LINEAR_GEMMS[0], weight, recipe, workspace, ifm, update_state, batch_scales)
    inp = autocast_input(inp)
    x = inp.reshape(-1, in_features)                                                # (tokens, in)
    out = call(LinearFP8(step.slot), x=x, weight=weight, bias=bias, **step.tensors())
    return out["out"].reshape(*inp.shape[:-1], out_features), {**workspace, **step.entries(out)}
