"""`layernorm_linear`: TE's LayerNormLinear as a function of tensors and one op-local workspace."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.gemm_layer import GemmConfig
from ..ops.layernorm_linear import layernorm_linear_fp8
from ..ops.normalization import norm_reference
from ._common import (cast_weight, check_input, gemm_recipe, grad_sink, needs_weight_grad, schemes,
                      state_entries, state_names, step_states)
from ._fused import check_norm_params, norm_config

__all__ = ["layernorm_linear"]

_STATES = state_names()   # input (the normalized output), weight, grad: as Linear's


def layernorm_linear(inp: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                     weight: torch.Tensor, bias: torch.Tensor | None = None, *, eps: float = 1e-5,
                     normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                     return_layernorm_output: bool = False, recipe=None, workspace: dict | None = None,
                     is_first_microbatch: bool | None = None):
    """y = norm(inp) @ weight.T + bias, the GEMMs in FP8 per `recipe` (None: plain torch ops).

    inp: (..., in_features); ln_weight, ln_bias: (in_features,) (ln_bias None for RMSNorm);
    weight: (out_features, in_features); bias: (out_features,).
    workspace: this op's entries (`weight_cast.*`; under DelayedScaling also
    `{input,weight,grad}_amax_history` and `_scale`), or None to cache nothing.
    Returns `(out, new_workspace)`, out (..., out_features) in inp's dtype, or
    `((out, ln_out), new_workspace)` with return_layernorm_output, ln_out (..., in_features).
    """
    layer = "LayerNormLinear"
    out_features, in_features = weight.shape
    check_input(layer, inp, in_features, {"layer_norm_weight": ln_weight, "layer_norm_bias": ln_bias,
                                          "weight": weight, "bias": bias}, recipe)
    check_norm_params(layer, in_features, ln_weight, ln_bias, normalization)
    norm_cfg = norm_config(layer, normalization, eps, zero_centered_gamma)
    recipe = gemm_recipe(recipe, inp.device, inp.numel() // in_features, in_features, out_features)
    workspace = {} if workspace is None else workspace
    if recipe is None:
        ln_out = norm_reference(inp, ln_weight, ln_bias, norm_cfg)
        out = F.linear(ln_out, weight.to(inp.dtype), None if bias is None else bias.to(inp.dtype))
        entries = {}
    else:
        states = step_states(recipe, workspace, _STATES, is_first_microbatch)     # None unless DelayedScaling
        cast, entries = cast_weight("weight", weight, recipe, workspace, is_first_microbatch,
                                    state=None if states is None else states["weight"])
        cfg = GemmConfig(*schemes(recipe), save_input=needs_weight_grad(weight))
        x = inp.reshape(-1, in_features)                                            # (tokens, in)
        out, ln_out, new_input = layernorm_linear_fp8(
            x, ln_weight, ln_bias, weight, bias, cast, cfg, norm_cfg,
            x_state=None if states is None else states["input"],
            g_state=None if states is None else states["grad"], g_sink=grad_sink(workspace, states, _STATES))
        if states is not None:
            entries.update(state_entries({"input": new_input, "grad": states["grad"]}))
        out, ln_out = out.reshape(*inp.shape[:-1], out_features), ln_out.reshape(inp.shape)
    new_workspace = {**workspace, **entries}
    return ((out, ln_out) if return_layernorm_output else out), new_workspace
