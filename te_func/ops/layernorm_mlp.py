"""LayerNormMLP's autograd boundary: norm -> fc1 -> activation -> fc2, in one Function.

What backward keeps, as TE: the input, mean and rsigma (norm backward), the
normalized output's FP8 cast along tokens (fc1 weight gradient), fc1's
output in high precision (activation backward) and the activation output's
FP8 cast along tokens (fc2 weight gradient). Each GEMM input is quantized
once, by `forward_gemm`; all four backward GEMMs run in FP8.

Under DelayedScaling each GEMM has its own input and grad states: fc1's input
is the normalized output and its grad the gradient of fc1's output (after
the activation backward); fc2's input is the activation output and its grad
the gradient of the layer's output.
"""
from __future__ import annotations

import torch

from ..quant import DelayedState, Quantized
from .activations import activation_backward, activation_forward
from .gemm_layer import GemmConfig, backward_gemm, delayed_state, forward_gemm, grad_history_gradient
from .normalization import NormConfig, norm_backward, norm_forward

__all__ = ["layernorm_mlp_fp8"]

_N_ARGS = 19            # forward's inputs before the delayed-scaling states
_G1_SINK, _G2_SINK = _N_ARGS + 2, _N_ARGS + 7   # positions of fc1's and fc2's g_sink


def _cast_t(q):
    return (None, None) if q is None else (q.data, q.scale_inv)


def _history(state):
    return None if state is None else state.amax_history


class _LayerNormMLPFP8(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                w1_data, w1_scale_inv, w1_data_t, w1_scale_inv_t,
                w2_data, w2_scale_inv, w2_data_t, w2_scale_inv_t, cfg1, cfg2, norm_cfg, activation,
                x1_history, x1_scale, g1_sink, g1_history, g1_scale,
                x2_history, x2_scale, g2_sink, g2_history, g2_scale):
        # x: (tokens, hidden); fc1_weight: (ffn or 2 * ffn, hidden); fc2_weight: (hidden, ffn)
        y, mean, rsigma = norm_forward(x, ln_weight, ln_bias, norm_cfg)
        ln_out = y.to(x.dtype)                                                   # (tokens, hidden)
        fc1_out, lnq_t, new_x1 = forward_gemm(ln_out, Quantized(w1_data, w1_scale_inv, cfg1.weight.block),
                                              fc1_bias, cfg1, delayed_state(x1_history, x1_scale))
        act_out = activation_forward(activation, fc1_out)                        # (tokens, ffn)
        out, actq_t, new_x2 = forward_gemm(act_out, Quantized(w2_data, w2_scale_inv, cfg2.weight.block),
                                           fc2_bias, cfg2, delayed_state(x2_history, x2_scale))  # (tokens, hidden)
        return (out, ln_out, mean, rsigma, fc1_out, *_cast_t(lnq_t), *_cast_t(actq_t),
                _history(new_x1), _history(new_x2))

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
         w1_data, w1_scale_inv, w1_data_t, w1_scale_inv_t,
         w2_data, w2_scale_inv, w2_data_t, w2_scale_inv_t, cfg1, cfg2, norm_cfg, activation) = inputs[:_N_ARGS]
        _, _, g1_history, g1_scale, _, _, _, g2_history, g2_scale = inputs[_N_ARGS + 1:]
        _, _, mean, rsigma, fc1_out, lnt_data, lnt_scale_inv, actt_data, actt_scale_inv, _, _ = output
        ctx.mark_non_differentiable(*(t for t in output[2:] if t is not None))
        ctx.save_for_backward(x, ln_weight, mean, rsigma, fc1_out, w1_data_t, w1_scale_inv_t,
                              w2_data_t, w2_scale_inv_t, lnt_data, lnt_scale_inv, actt_data, actt_scale_inv,
                              g1_history, g1_scale, g2_history, g2_scale)
        ctx.cfgs = (cfg1, cfg2, norm_cfg, activation)
        ctx.dtypes = tuple(None if t is None else t.dtype
                           for t in (x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias))

    @staticmethod
    def backward(ctx, grad_out, grad_ln_out, *_):
        (x, ln_weight, mean, rsigma, fc1_out, w1_data_t, w1_scale_inv_t, w2_data_t, w2_scale_inv_t,
         lnt_data, lnt_scale_inv, actt_data, actt_scale_inv,
         g1_history, g1_scale, g2_history, g2_scale) = ctx.saved_tensors
        cfg1, cfg2, norm_cfg, activation = ctx.cfgs
        x_dtype, lnw_dtype, lnb_dtype, w1_dtype, b1_dtype, w2_dtype, b2_dtype = ctx.dtypes
        need = ctx.needs_input_grad[:7]
        need_dln = any(need[:3])                  # x, layer_norm_weight, layer_norm_bias
        need_dfc1 = need_dln or need[3] or need[4]
        if (need[3] and lnt_data is None) or (need[5] and actt_data is None):
            raise RuntimeError("te_func LayerNormMLP: a weight gradient was requested but the forward ran "
                               "without saving that GEMM's input (the weight's requires_grad was False)")

        # fc2: input gradient (the activation's) and weight gradient.
        w2_t = Quantized(w2_data_t, w2_scale_inv_t, cfg2.weight.block) if need_dfc1 else None
        actq_t = Quantized(actt_data, actt_scale_inv, cfg2.input.block) if need[5] else None
        dact, dw2, new_g2 = backward_gemm(grad_out, w2_t, actq_t, cfg2, x_dtype, w2_dtype,
                                          delayed_state(g2_history, g2_scale))
        db2 = grad_out.sum(0).to(b2_dtype) if need[6] else None

        dx = dlnw = dlnb = dw1 = db1 = None
        new_g1 = delayed_state(g1_history, g1_scale)     # unchanged when fc1 has nothing to differentiate
        if need_dfc1:
            dfc1 = activation_backward(activation, dact, fc1_out)              # (tokens, fc1 width)
            w1_t = Quantized(w1_data_t, w1_scale_inv_t, cfg1.weight.block) if need_dln else None
            lnq_t = Quantized(lnt_data, lnt_scale_inv, cfg1.input.block) if need[3] else None
            dln, dw1, new_g1 = backward_gemm(dfc1, w1_t, lnq_t, cfg1, x_dtype, w1_dtype, new_g1)
            db1 = dfc1.sum(0).to(b1_dtype) if need[4] else None
            if need_dln:
                if grad_ln_out is not None:     # return_layernorm_output: TE adds its gradient
                    dln = dln + grad_ln_out
                dx, dlnw, dlnb = norm_backward(dln, x, mean, rsigma, ln_weight, norm_cfg)
                dlnw = dlnw.to(lnw_dtype)
                dlnb = dlnb.to(lnb_dtype) if need[2] else None
        g1_sink_grad = grad_history_gradient(new_g1, ctx.needs_input_grad[_G1_SINK])
        g2_sink_grad = grad_history_gradient(new_g2, ctx.needs_input_grad[_G2_SINK])
        return ((dx, dlnw, dlnb, dw1, db1, dw2, db2) + (None,) * 12
                + (None, None, g1_sink_grad, None, None) + (None, None, g2_sink_grad, None, None))


@torch._dynamo.allow_in_graph
def _apply(*args):
    # Opaque to dynamo, so torch.compile(torch.func.grad(...)) keeps the custom backward.
    return _LayerNormMLPFP8.apply(*args)


def _state_args(x_state, g_state, g_sink):
    xh, xs = (None, None) if x_state is None else x_state
    gh, gs = (None, None) if g_state is None else g_state
    return xh, xs, g_sink, gh, gs


def layernorm_mlp_fp8(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                      fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None, fc2_weight: torch.Tensor,
                      fc2_bias: torch.Tensor | None, fc1_cast, fc2_cast, cfg1: GemmConfig, cfg2: GemmConfig,
                      norm_cfg: NormConfig, activation: str, *, fc1_states=None, fc2_states=None):
    """fc2(act(fc1(norm(x)))) with every GEMM in FP8.

    x: (tokens, hidden); fc1_cast / fc2_cast: `te_func.quant.WeightCast`s of fc1_weight / fc2_weight.
    Under DelayedScaling, fc1_states / fc2_states are each GEMM's `(x_state, g_state, g_sink)`:
    its input and grad roles' states for this step and the grad history's workspace entry
    (see te_func.ops.gemm_layer); None for the other recipes.
    Returns (out (tokens, hidden), ln_out (tokens, hidden), new fc1 x_state, new fc2 x_state),
    out and ln_out in x's dtype, the states None without DelayedScaling.
    """
    (r1, c1), (r2, c2) = fc1_cast, fc2_cast
    s1, s2 = fc1_states or (None, None, None), fc2_states or (None, None, None)
    out, ln_out, *_, x1_history, x2_history = _apply(
        x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
        r1.data, r1.scale_inv, c1.data, c1.scale_inv, r2.data, r2.scale_inv, c2.data, c2.scale_inv,
        cfg1, cfg2, norm_cfg, activation, *_state_args(*s1), *_state_args(*s2))
    new_x1 = None if s1[0] is None else DelayedState(x1_history, s1[0].scale)
    new_x2 = None if s2[0] is None else DelayedState(x2_history, s2[0].scale)
    return out, ln_out, new_x1, new_x2
