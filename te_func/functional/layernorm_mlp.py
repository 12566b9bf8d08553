"""`layernorm_mlp`: TE's LayerNormMLP as a function of tensors and one op-local workspace."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import LayerNormMLPFP8, call
from ..ops.activations import activation_reference, activation_spec, is_gated
from ..ops.normalization import norm_reference
from ..quant import Gemm
from ._common import autocast_input, check_input, first_microbatch
from ._fused import check_norm_params, norm_config
from ._gemm import GemmStep

__all__ = ["layernorm_mlp", "LAYERNORM_MLP_GEMMS"]

# fc1's input state is the normalized output's, fc2's the activation output's.
LAYERNORM_MLP_GEMMS = (Gemm("fc1_weight"), Gemm("fc2_weight"))


def _check_shapes(layer, hidden, fc1_weight, fc2_weight, activation):
    ffn = fc2_weight.shape[1]
    width = 2 * ffn if is_gated(activation) else ffn
    if tuple(fc1_weight.shape) != (width, hidden) or tuple(fc2_weight.shape) != (hidden, ffn):
        raise ValueError(f"{layer}: with activation={activation!r}, fc1_weight must be ({width}, {hidden}) "
                         f"and fc2_weight ({hidden}, {ffn}), got {tuple(fc1_weight.shape)} and "
                         f"{tuple(fc2_weight.shape)}" + ("; gated activations double fc1's output width"
                                                         if is_gated(activation) else ""))


def layernorm_mlp(inp: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                  fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None, fc2_weight: torch.Tensor,
                  fc2_bias: torch.Tensor | None = None, *, eps: float = 1e-5, normalization: str = "LayerNorm",
                  activation: str = "gelu", activation_params: dict | None = None, zero_centered_gamma: bool = False,
                  return_layernorm_output: bool = False, recipe=None, workspace: dict | None = None,
                  is_first_microbatch: bool | None = None, update_state: bool | None = None,
                  batch_scales: bool = False):
    """y = fc2(act(fc1(norm(inp)))), the GEMMs in FP8 per `recipe` (None: plain torch ops).

    inp: (..., hidden); ln_weight, ln_bias: (hidden,) (ln_bias None for RMSNorm); fc1_weight:
    (ffn, hidden), (2 * ffn, hidden) for a gated activation; fc2_weight: (hidden, ffn).
    activation_params: TE's, for clamped_swiglu only (`limit`, `alpha`, `glu_linear_offset`).
    workspace, update_state, batch_scales: as `te_func.functional.linear`'s. Returns
    `(out, new_workspace)`, or `((out, ln_out), new_workspace)` with return_layernorm_output."""
    layer = "LayerNormMLP"
    act = activation_spec(activation, activation_params, layer)
    hidden = fc1_weight.shape[1]
    check_input(layer, inp, hidden, {"layer_norm_weight": ln_weight, "layer_norm_bias": ln_bias,
                                     "fc1_weight": fc1_weight, "fc1_bias": fc1_bias,
                                     "fc2_weight": fc2_weight, "fc2_bias": fc2_bias}, recipe)
    check_norm_params(layer, hidden, ln_weight, ln_bias, normalization)
    _check_shapes(layer, hidden, fc1_weight, fc2_weight, activation)
    norm_cfg = norm_config(layer, normalization, eps, zero_centered_gamma)
    workspace = {} if workspace is None else workspace
    if recipe is None:
        ln_out = norm_reference(inp, ln_weight, ln_bias, norm_cfg)
        cast = lambda t: None if t is None else t.to(inp.dtype)  # noqa: E731
        fc1_out = F.linear(ln_out, fc1_weight.to(inp.dtype), cast(fc1_bias))
        out = F.linear(activation_reference(act, fc1_out), fc2_weight.to(inp.dtype), cast(fc2_bias))
        entries = {}
    else:
        ifm = first_microbatch(is_first_microbatch, layer)
        fc1, fc2 = (GemmStep.begin(g, w, recipe, workspace, ifm, update_state, batch_scales)
                    for g, w in zip(LAYERNORM_MLP_GEMMS, (fc1_weight, fc2_weight)))
        inp = autocast_input(inp)
        x = inp.reshape(-1, hidden)                                                 # (tokens, hidden)
        res = call(LayerNormMLPFP8(fc1.slot, fc2.slot, norm_cfg, act), x=x, ln_weight=ln_weight,
                   ln_bias=ln_bias, fc1_weight=fc1_weight, fc1_bias=fc1_bias, fc2_weight=fc2_weight,
                   fc2_bias=fc2_bias, **fc1.tensors(), **fc2.tensors())
        out, ln_out = res["out"].reshape(inp.shape), res["ln_out"].reshape(inp.shape)
        entries = {**fc1.entries(res), **fc2.entries(res)}
    new_workspace = {**workspace, **entries}
    return ((out, ln_out) if return_layernorm_output else out), new_workspace
