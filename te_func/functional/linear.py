"""`linear`: TE's Linear as a function of tensors and one op-local workspace."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import GemmConfig, linear_fp8
from ._common import (cast_weight, check_input, gemm_recipe, grad_sink, needs_weight_grad, schemes,
                      state_entries, state_names, step_states)

__all__ = ["linear"]

_STATES = state_names()   # input, weight, grad


def linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, recipe=None,
           workspace: dict | None = None, is_first_microbatch: bool | None = None):
    """y = inp @ weight.T + bias, in FP8 per `recipe` (None: exactly `F.linear`).

    inp: (..., in_features); weight: (out_features, in_features); bias: (out_features,).
    workspace: this op's entries (`weight_cast.*`; under DelayedScaling also
    `{input,weight,grad}_amax_history` and `_scale`), or None to cache nothing.
    Returns `(out, new_workspace)`, out of shape (..., out_features) in inp's dtype.
    """
    out_features, in_features = weight.shape
    check_input("Linear", inp, in_features, {"weight": weight, "bias": bias}, recipe)
    workspace = {} if workspace is None else workspace
    recipe = gemm_recipe(recipe, inp.device, inp.numel() // in_features, in_features, out_features)
    if recipe is None:
        return F.linear(inp, weight.to(inp.dtype), None if bias is None else bias.to(inp.dtype)), workspace
    states = step_states(recipe, workspace, _STATES, is_first_microbatch)     # None unless DelayedScaling
    cast, entries = cast_weight("weight", weight, recipe, workspace, is_first_microbatch,
                                state=None if states is None else states["weight"])
    s_in, s_w, s_g = schemes(recipe)
    cfg = GemmConfig(s_in, s_w, s_g, save_input=needs_weight_grad(weight))
    x = inp.reshape(-1, in_features)                                   # (tokens, in)
    out, new_input = linear_fp8(x, weight, bias, cast, cfg,            # (tokens, out)
                                x_state=None if states is None else states["input"],
                                g_state=None if states is None else states["grad"],
                                g_sink=grad_sink(workspace, states, _STATES))
    if states is not None:
        entries.update(state_entries({"input": new_input, "grad": states["grad"]}))
    return out.reshape(*inp.shape[:-1], out_features), {**workspace, **entries}
