"""Linear's autograd boundary: tensors in, tensors out.

Forward, input gradient and weight gradient all run in FP8. The input is
saved for backward as its FP8 cast (blocks along the token dim, as the
weight-gradient GEMM reads it), never in high precision.
"""
from __future__ import annotations

import torch

from ..quant import DelayedState, Quantized
from .gemm_layer import GemmConfig, backward_gemm, delayed_state, forward_gemm, grad_history_gradient

__all__ = ["linear_fp8"]

_G_SINK = 10   # position of g_sink among forward's inputs


class _LinearFP8(torch.autograd.Function):
    # Written with setup_context (not forward(ctx, ...)) so that torch.func.grad
    # and vmap accept it; every op inside has a batching rule.
    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, w_data, w_scale_inv, w_data_t, w_scale_inv_t, cfg,
                x_history, x_scale, g_sink, g_history, g_scale):
        # x: (tokens, in); w_data: (out, in); w_data_t: (in, out); *_history: (L,); *_scale: ()
        out, xq_t, new_x = forward_gemm(x, Quantized(w_data, w_scale_inv, cfg.weight.block), bias, cfg,
                                        delayed_state(x_history, x_scale))
        new_x_history = None if new_x is None else new_x.amax_history
        if xq_t is None:
            return out, None, None, new_x_history
        return out, xq_t.data, xq_t.scale_inv, new_x_history   # the input's cast along tokens, for wgrad

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, w_data, w_scale_inv, w_data_t, w_scale_inv_t, cfg, _, _, _, g_history, g_scale = inputs
        _, xt_data, xt_scale_inv, new_x_history = output
        ctx.mark_non_differentiable(*(t for t in (xt_data, xt_scale_inv, new_x_history) if t is not None))
        ctx.save_for_backward(w_data_t, w_scale_inv_t, xt_data, xt_scale_inv, g_history, g_scale)
        ctx.cfg = cfg
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    def backward(ctx, grad_out, _g_xt_data=None, _g_xt_scale_inv=None, _g_x_history=None):
        w_data_t, w_scale_inv_t, xt_data, xt_scale_inv, g_history, g_scale = ctx.saved_tensors
        cfg, (x_dtype, w_dtype, b_dtype) = ctx.cfg, ctx.dtypes
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        if need_dw and xt_data is None:
            raise RuntimeError("te_func Linear: the weight gradient was requested but the forward ran "
                               "without saving the input (weight.requires_grad was False)")
        w_t = Quantized(w_data_t, w_scale_inv_t, cfg.weight.block) if need_dx else None
        xq_t = Quantized(xt_data, xt_scale_inv, cfg.input.block) if need_dw else None
        dx, dw, new_g = backward_gemm(grad_out, w_t, xq_t, cfg, x_dtype, w_dtype, delayed_state(g_history, g_scale))
        db = grad_out.sum(0).to(b_dtype) if need_db else None
        g_sink_grad = grad_history_gradient(new_g, ctx.needs_input_grad[_G_SINK])
        return dx, dw, db, None, None, None, None, None, None, None, g_sink_grad, None, None


@torch._dynamo.allow_in_graph
def _apply(x, weight, bias, w_data, w_scale_inv, w_data_t, w_scale_inv_t, cfg,
           x_history, x_scale, g_sink, g_history, g_scale):
    # allow_in_graph keeps the Function opaque to dynamo: inlined, its custom
    # backward would be silently replaced by autograd of its forward under
    # torch.compile(torch.func.grad(...)).
    return _LinearFP8.apply(x, weight, bias, w_data, w_scale_inv, w_data_t, w_scale_inv_t, cfg,
                            x_history, x_scale, g_sink, g_history, g_scale)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               weight_cast, cfg: GemmConfig, *, x_state: DelayedState | None = None,
               g_state: DelayedState | None = None, g_sink: torch.Tensor | None = None):
    """y = x @ weight.T + bias with every GEMM in FP8.

    x: (tokens, in_features); weight: (out, in); weight_cast: a
    `te_func.quant.WeightCast` of `weight`. Under DelayedScaling, `x_state`
    and `g_state` are the input and grad roles' states for this step and
    `g_sink` the grad history's workspace entry, whose gradient becomes the
    grad history with the grad-output amax recorded.
    Returns (out (tokens, out_features), new x_state or None).
    """
    rw, cw = weight_cast
    xh, xs = (None, None) if x_state is None else x_state
    gh, gs = (None, None) if g_state is None else g_state
    out, _, _, new_x_history = _apply(x, weight, bias, rw.data, rw.scale_inv, cw.data, cw.scale_inv, cfg,
                                      xh, xs, g_sink, gh, gs)
    return out, None if x_state is None else DelayedState(new_x_history, xs)
