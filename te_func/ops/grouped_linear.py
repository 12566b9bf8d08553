"""GroupedLinear's autograd boundary: one FP8 GEMM per group of tokens, in one Function.

Group i (rows m_splits[:i].sum() onward, m_splits[i] of them) uses weight i.
Each group's input is quantized on its own, as TE does (one quantizer per
GEMM), so the result equals a loop of Linear layers bit for bit; each is
saved for backward only as its FP8 cast along tokens. Under DelayedScaling
each GEMM likewise has its own input and grad states, as TE keeps one FP8
meta slot per GEMM and role; an empty group records an amax of 0.
"""
from __future__ import annotations

import torch

from ..quant import DelayedState, Quantized
from .gemm_layer import GemmConfig, backward_gemm, delayed_state, forward_gemm, grad_history_gradient

__all__ = ["grouped_linear_fp8"]

# forward's variadic tensors, num_gemms of each, in this order
_CASTS = ("weights", "biases", "w_data", "w_scale_inv", "w_data_t", "w_scale_inv_t")
_STATES = ("x_history", "x_scale", "g_sink", "g_history", "g_scale")


def _groups(t: torch.Tensor, m_splits):
    return torch.split(t, list(m_splits), dim=0)


def _unpack(tensors, n):
    """The variadic tensors as {name: tuple of n}."""
    return {name: tuple(tensors[i * n:(i + 1) * n]) for i, name in enumerate(_CASTS + _STATES)}


class _GroupedLinearFP8(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, m_splits, cfg, *tensors):
        # tensors: see _CASTS and _STATES; the states are None without DelayedScaling
        n = len(m_splits)
        t = _unpack(tensors, n)
        outs, xt_data, xt_scale_inv, x_histories = [], [], [], []
        for i, xi in enumerate(_groups(x, m_splits)):                 # xi: (m_splits[i], in)
            out, xq_t, new_x = forward_gemm(xi, Quantized(t["w_data"][i], t["w_scale_inv"][i], cfg.weight.block),
                                            t["biases"][i], cfg, delayed_state(t["x_history"][i], t["x_scale"][i]))
            outs.append(out)
            xt_data.append(None if xq_t is None else xq_t.data)
            xt_scale_inv.append(None if xq_t is None else xq_t.scale_inv)
            x_histories.append(None if new_x is None else new_x.amax_history)
        return (torch.cat(outs), *xt_data, *xt_scale_inv, *x_histories)   # out: (tokens, out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, m_splits, cfg, *tensors = inputs
        n = len(m_splits)
        t = _unpack(tensors, n)
        ctx.mark_non_differentiable(*(o for o in output[1:] if o is not None))
        # casts of weight_i.T (dgrad), the inputs' casts along tokens (wgrad), the grad states
        ctx.save_for_backward(*t["w_data_t"], *t["w_scale_inv_t"], *output[1:2 * n + 1],
                              *t["g_history"], *t["g_scale"])
        ctx.m_splits, ctx.cfg = m_splits, cfg
        ctx.dtypes = (x.dtype, [w.dtype for w in t["weights"]],
                      [None if b is None else b.dtype for b in t["biases"]])

    @staticmethod
    def backward(ctx, grad_out, *_):
        m_splits, cfg, n = ctx.m_splits, ctx.cfg, len(ctx.m_splits)
        saved = ctx.saved_tensors
        w_data_t, w_scale_inv_t, xt_data, xt_scale_inv, g_history, g_scale = (
            saved[i * n:(i + 1) * n] for i in range(6))
        x_dtype, w_dtypes, b_dtypes = ctx.dtypes
        need_dx = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[3:3 + n]
        need_db = ctx.needs_input_grad[3 + n:3 + 2 * n]
        sink = 3 + (len(_CASTS) + _STATES.index("g_sink")) * n
        need_sink = ctx.needs_input_grad[sink:sink + n]
        dxs, dws, dbs, sink_grads = [], [], [], []
        for i, gi in enumerate(_groups(grad_out, m_splits)):          # gi: (m_splits[i], out)
            if need_dw[i] and xt_data[i] is None:
                raise RuntimeError("te_func GroupedLinear: a weight gradient was requested but the forward "
                                   "ran without saving the input (the weights' requires_grad was False)")
            w_t = Quantized(w_data_t[i], w_scale_inv_t[i], cfg.weight.block) if need_dx else None
            xq_t = Quantized(xt_data[i], xt_scale_inv[i], cfg.input.block) if need_dw[i] else None
            dx, dw, new_g = backward_gemm(gi, w_t, xq_t, cfg, x_dtype, w_dtypes[i],
                                          delayed_state(g_history[i], g_scale[i]))
            dxs.append(dx)
            dws.append(dw)
            dbs.append(gi.sum(0).to(b_dtypes[i]) if need_db[i] else None)
            sink_grads.append(grad_history_gradient(new_g, need_sink[i]))
        dx = torch.cat(dxs) if need_dx else None
        return ((dx, None, None, *dws, *dbs) + (None,) * (4 * n) + (None,) * (2 * n)
                + tuple(sink_grads) + (None,) * (2 * n))


@torch._dynamo.allow_in_graph
def _apply(x, m_splits, cfg, *tensors):
    # Opaque to dynamo, so torch.compile(torch.func.grad(...)) keeps the custom backward.
    return _GroupedLinearFP8.apply(x, m_splits, cfg, *tensors)


def grouped_linear_fp8(x: torch.Tensor, m_splits: tuple[int, ...], weights, biases, weight_casts,
                       cfg: GemmConfig, *, x_states=None, g_states=None, g_sinks=None):
    """Row group i of x times weights[i].T plus biases[i], every GEMM in FP8.

    x: (tokens, in_features) with tokens == sum(m_splits); weights[i]: (out, in);
    biases: a list of (out,) or of None; weight_casts[i]: a `te_func.quant.WeightCast`
    of weights[i]. Under DelayedScaling, x_states[i] / g_states[i] are GEMM i's input and
    grad states for this step and g_sinks[i] its grad history's workspace entry (see
    te_func.ops.gemm_layer); None for the other recipes.
    Returns (out (tokens, out_features), the new x_states as a list, or None).
    """
    n = len(weights)
    casts = [*(c.rowwise.data for c in weight_casts), *(c.rowwise.scale_inv for c in weight_casts),
             *(c.columnwise.data for c in weight_casts), *(c.columnwise.scale_inv for c in weight_casts)]
    if x_states is None:
        states = [None] * (len(_STATES) * n)
    else:
        states = [*(s.amax_history for s in x_states), *(s.scale for s in x_states), *g_sinks,
                  *(s.amax_history for s in g_states), *(s.scale for s in g_states)]
    out, *rest = _apply(x, tuple(m_splits), cfg, *weights, *biases, *casts, *states)
    if x_states is None:
        return out, None
    return out, [DelayedState(h, s.scale) for h, s in zip(rest[2 * n:], x_states)]
