"""`layernorm_mlp`: TE's LayerNormMLP as a function of tensors and one op-local workspace."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.activations import activation_reference, check_activation, is_gated
from ..ops.gemm_layer import GemmConfig
from ..ops.layernorm_mlp import layernorm_mlp_fp8
from ..ops.normalization import norm_reference
from ._common import (cast_weight, check_input, gemm_recipe, grad_sink, needs_weight_grad, schemes,
                      state_entries, state_names, step_states)
from ._fused import check_norm_params, norm_config

__all__ = ["layernorm_mlp"]

# Each GEMM's states: fc1_input (the normalized output), fc1_weight, fc1_grad;
# fc2_input (the activation output), fc2_weight, fc2_grad.
_FC1, _FC2 = state_names("fc1_", "fc1_weight"), state_names("fc2_", "fc2_weight")


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
                  activation: str = "gelu", zero_centered_gamma: bool = False,
                  return_layernorm_output: bool = False, recipe=None, workspace: dict | None = None,
                  is_first_microbatch: bool | None = None):
    """y = fc2(act(fc1(norm(inp)))), the GEMMs in FP8 per `recipe` (None: plain torch ops).

    inp: (..., hidden); ln_weight, ln_bias: (hidden,) (ln_bias None for RMSNorm);
    fc1_weight: (ffn, hidden), or (2 * ffn, hidden) for a gated activation; fc1_bias: (fc1 width,);
    fc2_weight: (hidden, ffn); fc2_bias: (hidden,).
    workspace: this op's entries (`fc1_weight_cast.*`, `fc2_weight_cast.*`; under DelayedScaling
    also `{fc1,fc2}_{input,weight,grad}_amax_history` and `_scale`), or None to cache nothing.
    Returns `(out, new_workspace)`, out (..., hidden) in inp's dtype, or
    `((out, ln_out), new_workspace)` with return_layernorm_output.
    """
    layer = "LayerNormMLP"
    check_activation(activation, layer)
    hidden = fc1_weight.shape[1]
    check_input(layer, inp, hidden, {"layer_norm_weight": ln_weight, "layer_norm_bias": ln_bias,
                                     "fc1_weight": fc1_weight, "fc1_bias": fc1_bias,
                                     "fc2_weight": fc2_weight, "fc2_bias": fc2_bias}, recipe)
    check_norm_params(layer, hidden, ln_weight, ln_bias, normalization)
    _check_shapes(layer, hidden, fc1_weight, fc2_weight, activation)
    norm_cfg = norm_config(layer, normalization, eps, zero_centered_gamma)
    # One decision for both GEMMs, by fc2's (tokens, ffn, hidden); fc1's is the same
    # permuted, or twice as wide for a gated activation, so at least as large.
    recipe = gemm_recipe(recipe, inp.device, inp.numel() // hidden, hidden, fc2_weight.shape[1])
    workspace = {} if workspace is None else workspace
    if recipe is None:
        ln_out = norm_reference(inp, ln_weight, ln_bias, norm_cfg)
        cast = lambda t: None if t is None else t.to(inp.dtype)  # noqa: E731
        fc1_out = F.linear(ln_out, cast(fc1_weight), cast(fc1_bias))
        out = F.linear(activation_reference(activation, fc1_out), cast(fc2_weight), cast(fc2_bias))
        entries = {}
    else:
        states = step_states(recipe, workspace, {**_FC1, **_FC2}, is_first_microbatch)  # None unless delayed
        state = (lambda name: None) if states is None else states.get
        cast1, entries1 = cast_weight("fc1_weight", fc1_weight, recipe, workspace, is_first_microbatch,
                                      state=state("fc1_weight"))
        cast2, entries2 = cast_weight("fc2_weight", fc2_weight, recipe, workspace, is_first_microbatch,
                                      state=state("fc2_weight"))
        s_in, s_w, s_g = schemes(recipe)
        cfg1 = GemmConfig(s_in, s_w, s_g, save_input=needs_weight_grad(fc1_weight))
        cfg2 = GemmConfig(s_in, s_w, s_g, save_input=needs_weight_grad(fc2_weight))
        x = inp.reshape(-1, hidden)                                                 # (tokens, hidden)
        fc1_states = (state("fc1_input"), state("fc1_grad"), grad_sink(workspace, states, _FC1))
        fc2_states = (state("fc2_input"), state("fc2_grad"), grad_sink(workspace, states, _FC2))
        out, ln_out, new_fc1_input, new_fc2_input = layernorm_mlp_fp8(
            x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, cast1, cast2, cfg1, cfg2,
            norm_cfg, activation, fc1_states=fc1_states, fc2_states=fc2_states)
        out, ln_out = out.reshape(inp.shape), ln_out.reshape(inp.shape)
        entries = {**entries1, **entries2}
        if states is not None:
            entries.update(state_entries({"fc1_input": new_fc1_input, "fc1_grad": states["fc1_grad"],
                                          "fc2_input": new_fc2_input, "fc2_grad": states["fc2_grad"]}))
    new_workspace = {**workspace, **entries}
    return ((out, ln_out) if return_layernorm_output else out), new_workspace
