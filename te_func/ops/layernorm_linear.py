"""LayerNormLinear's autograd boundary: norm, then an FP8 GEMM, in one Function.

The normalized output is quantized once (by `forward_gemm`, into both
copies) and kept for backward only as its FP8 cast along tokens, which the
weight-gradient GEMM reads. The norm backward reads the input, mean and
rsigma, as in TE. Under DelayedScaling the GEMM's input is the normalized
output, so the input role's amax is that of ln_out.
"""
from __future__ import annotations

import torch

from ..quant import DelayedState, Quantized
from .gemm_layer import GemmConfig, backward_gemm, delayed_state, forward_gemm, grad_history_gradient
from .normalization import NormConfig, norm_backward, norm_forward

__all__ = ["layernorm_linear_fp8"]

_G_SINK = 13   # position of g_sink among forward's inputs


class _LayerNormLinearFP8(torch.autograd.Function):
    # forward + setup_context so that torch.func.grad and vmap accept it.
    generate_vmap_rule = True

    @staticmethod
    def forward(x, ln_weight, ln_bias, weight, bias, w_data, w_scale_inv, w_data_t, w_scale_inv_t,
                cfg, norm_cfg, x_history, x_scale, g_sink, g_history, g_scale):
        # x: (tokens, in); w_data: (out, in); w_data_t: (in, out); *_history: (L,); *_scale: ()
        y, mean, rsigma = norm_forward(x, ln_weight, ln_bias, norm_cfg)
        ln_out = y.to(x.dtype)                                                  # (tokens, in)
        out, lnq_t, new_x = forward_gemm(ln_out, Quantized(w_data, w_scale_inv, cfg.weight.block), bias, cfg,
                                         delayed_state(x_history, x_scale))
        lnt_data, lnt_scale_inv = (None, None) if lnq_t is None else (lnq_t.data, lnq_t.scale_inv)
        new_x_history = None if new_x is None else new_x.amax_history
        return out, ln_out, mean, rsigma, lnt_data, lnt_scale_inv, new_x_history

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x, ln_weight, ln_bias, weight, bias, w_data, w_scale_inv, w_data_t, w_scale_inv_t, cfg, norm_cfg,
         _, _, _, g_history, g_scale) = inputs
        _, _, mean, rsigma, lnt_data, lnt_scale_inv, _ = output
        ctx.mark_non_differentiable(*(t for t in output[2:] if t is not None))
        ctx.save_for_backward(x, ln_weight, mean, rsigma, w_data_t, w_scale_inv_t, lnt_data, lnt_scale_inv,
                              g_history, g_scale)
        ctx.cfg, ctx.norm_cfg = cfg, norm_cfg
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (x, ln_weight, ln_bias, weight, bias))

    @staticmethod
    def backward(ctx, grad_out, grad_ln_out, *_):
        (x, ln_weight, mean, rsigma, w_data_t, w_scale_inv_t, lnt_data, lnt_scale_inv,
         g_history, g_scale) = ctx.saved_tensors
        cfg = ctx.cfg
        x_dtype, lnw_dtype, lnb_dtype, w_dtype, b_dtype = ctx.dtypes
        need_dx, need_dlnw, need_dlnb, need_dw, need_db = ctx.needs_input_grad[:5]
        need_dln = need_dx or need_dlnw or need_dlnb
        if need_dw and lnt_data is None:
            raise RuntimeError("te_func LayerNormLinear: the weight gradient was requested but the forward "
                               "ran without saving the normalized input (weight.requires_grad was False)")
        w_t = Quantized(w_data_t, w_scale_inv_t, cfg.weight.block) if need_dln else None
        lnq_t = Quantized(lnt_data, lnt_scale_inv, cfg.input.block) if need_dw else None
        dln, dw, new_g = backward_gemm(grad_out, w_t, lnq_t, cfg, x_dtype, w_dtype,
                                       delayed_state(g_history, g_scale))
        dx = dlnw = dlnb = None
        if need_dln:
            # With return_layernorm_output the caller may use ln_out too (TE adds its gradient).
            if grad_ln_out is not None:
                dln = dln + grad_ln_out
            dx, dlnw, dlnb = norm_backward(dln, x, mean, rsigma, ln_weight, ctx.norm_cfg)
            dlnw = dlnw.to(lnw_dtype)
            dlnb = dlnb.to(lnb_dtype) if need_dlnb else None
        db = grad_out.sum(0).to(b_dtype) if need_db else None
        g_sink_grad = grad_history_gradient(new_g, ctx.needs_input_grad[_G_SINK])
        return (dx, dlnw, dlnb, dw, db) + (None,) * 8 + (g_sink_grad, None, None)


@torch._dynamo.allow_in_graph
def _apply(x, ln_weight, ln_bias, weight, bias, w_data, w_scale_inv, w_data_t, w_scale_inv_t, cfg, norm_cfg,
           x_history, x_scale, g_sink, g_history, g_scale):
    # Opaque to dynamo, so torch.compile(torch.func.grad(...)) keeps the custom backward.
    return _LayerNormLinearFP8.apply(x, ln_weight, ln_bias, weight, bias, w_data, w_scale_inv, w_data_t,
                                     w_scale_inv_t, cfg, norm_cfg, x_history, x_scale, g_sink, g_history,
                                     g_scale)


def layernorm_linear_fp8(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                         weight: torch.Tensor, bias: torch.Tensor | None, weight_cast, cfg: GemmConfig,
                         norm_cfg: NormConfig, *, x_state: DelayedState | None = None,
                         g_state: DelayedState | None = None, g_sink: torch.Tensor | None = None):
    """(norm(x) @ weight.T + bias, norm(x)) with the GEMMs in FP8.

    x: (tokens, in_features); weight: (out, in); weight_cast: a `te_func.quant.WeightCast`
    of `weight`. Under DelayedScaling, `x_state` / `g_state` are the GEMM input's (the
    normalized output's) and the grad role's states for this step and `g_sink` the grad
    history's workspace entry (see te_func.ops.gemm_layer).
    Returns (out (tokens, out_features), ln_out (tokens, in_features), new x_state or None),
    out and ln_out in x's dtype.
    """
    rw, cw = weight_cast
    xh, xs = (None, None) if x_state is None else x_state
    gh, gs = (None, None) if g_state is None else g_state
    out, ln_out, *_, new_x_history = _apply(x, ln_weight, ln_bias, weight, bias, rw.data, rw.scale_inv,
                                            cw.data, cw.scale_inv, cfg, norm_cfg, xh, xs, g_sink, gh, gs)
    return out, ln_out, None if x_state is None else DelayedState(new_x_history, xs)
