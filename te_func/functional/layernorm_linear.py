"""`layernorm_linear`: TE's LayerNormLinear as a function of tensors and one op-local workspace."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import LayerNormLinearFP8, call
from ..ops.normalization import norm_reference
from ..quant import Gemm
from ._common import autocast_input, check_input, first_microbatch
from ._fused import check_norm_params, norm_config
from ._gemm import GemmStep

__all__ = ["layernorm_linear", "LAYERNORM_LINEAR_GEMMS"]

LAYERNORM_LINEAR_GEMMS = (Gemm("weight"),)   # its input state is the normalized output's


def layernorm_linear(inp: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                     weight: torch.Tensor, bias: torch.Tensor | None = None, *, eps: float = 1e-5,
                     normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                     return_layernorm_output: bool = False, recipe=None, workspace: dict | None = None,
                     is_first_microbatch: bool | None = None, update_state: bool | None = None,
                     batch_scales: bool = False):
    """y = norm(inp) @ weight.T + bias, the GEMMs in FP8 per `recipe` (None: plain torch ops).

    inp: (..., in_features); ln_weight, ln_bias: (in_features,) (ln_bias None for RMSNorm);
    weight: (out_features, in_features); bias: (out_features,). workspace, update_state,
    batch_scales: as `te_func.functional.linear`'s. Returns `(out, new_workspace)`, or
    `((out, ln_out), new_workspace)` with return_layernorm_output."""
    layer = "LayerNormLinear"
    out_features, in_features = weight.shape
    check_input(layer, inp, in_features, {"layer_norm_weight": ln_weight, "layer_norm_bias": ln_bias,
                                          "weight": weight, "bias": bias}, recipe)
    check_norm_params(layer, in_features, ln_weight, ln_bias, normalization)
    norm_cfg = norm_config(layer, normalization, eps, zero_centered_gamma)
    workspace = {} if workspace is None else workspace
    if recipe is None:
        ln_out = norm_reference(inp, ln_weight, ln_bias, norm_cfg)
        out = F.linear(ln_out, weight.to(inp.dtype), None if bias is None else bias.to(inp.dtype))
        entries = {}
    else:
        step = GemmStep.begin(LAYERNORM_LINEAR_GEMMS[0], weight, recipe, workspace,
                              first_microbatch(is_first_microbatch, layer), update_state, batch_scales)
        inp = autocast_input(inp)
        x = inp.reshape(-1, in_features)                                            # (tokens, in)
        res = call(LayerNormLinearFP8(step.slot, norm_cfg), x=x, ln_weight=ln_weight, ln_bias=ln_bias,
                   weight=weight, bias=bias, **step.tensors())
        out, ln_out = res["out"].reshape(*inp.shape[:-1], out_features), res["ln_out"].reshape(inp.shape)
        entries = step.entries(res)
    new_workspace = {**workspace, **entries}
    return ((out, ln_out) if return_layernorm_output else out), new_workspace
