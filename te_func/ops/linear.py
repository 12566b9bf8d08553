"""Linear's autograd boundary: tensors in, tensors out.

Forward, input gradient and weight gradient all run in FP8. The input is
saved for backward as its FP8 cast (blocks along the token dim, as the
weight-gradient GEMM reads it), never in high precision.
"""
from __future__ import annotations

import torch

from ..quant import Quantized
from .gemm_layer import GemmConfig, backward_gemm, forward_gemm

__all__ = ["linear_fp8"]


class _LinearFP8(torch.autograd.Function):
    # Written with setup_context (not forward(ctx, ...)) so that torch.func.grad
    # and vmap accept it; every op inside has a batching rule.
    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, w_data, w_scale_inv, w_data_t, w_scale_inv_t, cfg):
        # x: (tokens, in); w_data: (out, in); w_data_t: (in, out)
        out, xq_t, _ = forward_gemm(x, Quantized(w_data, w_scale_inv, cfg.weight.block), bias, cfg)
        if xq_t is None:
            return out, None, None
        return out, xq_t.data, xq_t.scale_inv          # the input's cast along tokens, for wgrad

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, w_data, w_scale_inv, w_data_t, w_scale_inv_t, cfg = inputs
        _, xt_data, xt_scale_inv = output
        if xt_data is not None:
            ctx.mark_non_differentiable(xt_data, xt_scale_inv)
        ctx.save_for_backward(w_data_t, w_scale_inv_t, xt_data, xt_scale_inv)
        ctx.cfg = cfg
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    def backward(ctx, grad_out, _g_xt_data=None, _g_xt_scale_inv=None):
        w_data_t, w_scale_inv_t, xt_data, xt_scale_inv = ctx.saved_tensors
        cfg, (x_dtype, w_dtype, b_dtype) = ctx.cfg, ctx.dtypes
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        if need_dw and xt_data is None:
            raise RuntimeError("te_func Linear: the weight gradient was requested but the forward ran "
                               "without saving the input (weight.requires_grad was False)")
        w_t = Quantized(w_data_t, w_scale_inv_t, cfg.weight.block) if need_dx else None
        xq_t = Quantized(xt_data, xt_scale_inv, cfg.input.block) if need_dw else None
        dx, dw, _ = backward_gemm(grad_out, w_t, xq_t, cfg, x_dtype, w_dtype)
        db = grad_out.sum(0).to(b_dtype) if need_db else None
        return dx, dw, db, None, None, None, None, None


@torch._dynamo.allow_in_graph
def _apply(x, weight, bias, w_data, w_scale_inv, w_data_t, w_scale_inv_t, cfg):
    # allow_in_graph keeps the Function opaque to dynamo: inlined, its custom
    # backward would be silently replaced by autograd of its forward under
    # torch.compile(torch.func.grad(...)).
    return _LinearFP8.apply(x, weight, bias, w_data, w_scale_inv, w_data_t, w_scale_inv_t, cfg)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               weight_cast, cfg: GemmConfig) -> torch.Tensor:
    """y = x @ weight.T + bias with every GEMM in FP8.

    x: (tokens, in_features); weight: (out, in); weight_cast: a
    `te_func.quant.WeightCast` of `weight`. Returns (tokens, out_features).
    """
    rw, cw = weight_cast
    out, _, _ = _apply(x, weight, bias, rw.data, rw.scale_inv, cw.data, cw.scale_inv, cfg)
    return out
