"""The FP8 GEMM every GEMM layer's op is built from: `GemmSlot`.

A slot is one GEMM's part of an op (te_func.ops.boundary): the tensors it
reads and returns, by name under its prefix, and its two halves. Forward
quantizes the GEMM input once (both copies when backward needs the weight
gradient) and runs the forward GEMM; backward quantizes the output gradient
once and runs the input- and weight-gradient GEMMs. Linear, LayerNormLinear,
LayerNormMLP and GroupedLinear differ only in what they do around their slots.

Tensors of a slot with prefix p (None where the recipe keeps no such state):
    inputs   p+w, p+w_scale_inv          the weight's cast (out, in)
             p+w_t, p+w_t_scale_inv      the cast of weight.T (in, out), for the input gradient
             p+x_history, p+x_scale      DelayedScaling: the GEMM input's state for this step
             p+g_history, p+g_scale      ... and the output gradient's
             p+g_sink                    the grad history's workspace entry: its "gradient" carries
                                         the backward amax (see `backward_amax`)
    outputs  p+new_x_history             the input history with this call's amax recorded
             p+xt, p+xt_scale_inv        the input's cast along tokens, for the weight gradient
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gemm import gemm
from ..quant import DelayedState, Quantized, Scheme, WeightCast, quantize_scheme, quantize_with_transpose

__all__ = ["GemmConfig", "GemmSlot", "forward_gemm", "backward_gemm"]


@dataclass(frozen=True)
class GemmConfig:
    """Static (hashable) description of one FP8 GEMM: how each role is scaled."""
    input: Scheme
    weight: Scheme
    grad: Scheme
    # Whether backward will need the weight gradient, so forward keeps the
    # input's transposed cast; decided by the caller, who can see requires_grad.
    save_input: bool = True


def forward_gemm(x: torch.Tensor, w: Quantized, bias: torch.Tensor | None, cfg: GemmConfig,
                 x_state: DelayedState | None = None):
    """x (tokens, in) @ w (out, in).T + bias -> (out (tokens, out), x cast for wgrad or None, new x state)."""
    if cfg.save_input:
        xq, xq_t, new_state = quantize_with_transpose(x, cfg.input, x_state)
    else:
        (xq, new_state), xq_t = quantize_scheme(x, cfg.input, x_state), None
    out = gemm(xq, w, x.dtype, fast_accum=True)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out, xq_t, new_state


def backward_gemm(grad_out: torch.Tensor, w_t: Quantized | None, xq_t: Quantized | None, cfg: GemmConfig,
                  x_dtype: torch.dtype, w_dtype: torch.dtype, g_state: DelayedState | None = None):
    """grad_out (tokens, out) -> (dx (tokens, in) or None, dw (out, in) or None, new grad state).

    dx is computed when `w_t` (the cast of weight.T) is given, dw when `xq_t` is.
    """
    if w_t is None and xq_t is None:
        return None, None, g_state
    if xq_t is None:          # input gradient only: one cast, along out_features
        gq, new_state = quantize_scheme(grad_out, cfg.grad, g_state)
        gq_t = None
    else:
        gq, gq_t, new_state = quantize_with_transpose(grad_out, cfg.grad, g_state)
    dx = None if w_t is None else gemm(gq, w_t, x_dtype, fast_accum=False)
    dw = None if xq_t is None else gemm(gq_t, xq_t, w_dtype, fast_accum=False)
    return dx, dw, new_state


def _state(history, scale) -> DelayedState | None:
    return None if history is None else DelayedState(history, scale)


@dataclass(frozen=True)
class GemmSlot:
    """One FP8 GEMM inside an op: its config and the prefix of its tensors' names."""
    cfg: GemmConfig
    prefix: str = ""

    def _n(self, name: str) -> str:
        return self.prefix + name

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(map(self._n, ("new_x_history", "xt", "xt_scale_inv")))

    @property
    def saved(self) -> tuple[str, ...]:
        return tuple(map(self._n, ("w_t", "w_t_scale_inv", "xt", "xt_scale_inv", "g_history", "g_scale")))

    def inputs(self, cast: WeightCast, x_state: DelayedState | None, g_state: DelayedState | None,
               g_sink: torch.Tensor | None) -> dict:
        """This slot's input tensors by name, from the GEMM's weight cast and states for this call."""
        x_history, x_scale = (None, None) if x_state is None else x_state
        g_history, g_scale = (None, None) if g_state is None else g_state
        return {self._n(k): v for k, v in (
            ("w", cast.rowwise.data), ("w_scale_inv", cast.rowwise.scale_inv),
            ("w_t", cast.columnwise.data), ("w_t_scale_inv", cast.columnwise.scale_inv),
            ("x_history", x_history), ("x_scale", x_scale),
            ("g_sink", g_sink), ("g_history", g_history), ("g_scale", g_scale))}

    def new_input_state(self, outputs: dict, x_state: DelayedState | None) -> DelayedState | None:
        """The input role's state after the call: `x_state` with this call's amax recorded."""
        return None if x_state is None else DelayedState(outputs[self._n("new_x_history")], x_state.scale)

    def forward(self, t: dict, x: torch.Tensor, bias: torch.Tensor | None):
        """x (tokens, in) -> (out (tokens, out) in x's dtype, this slot's outputs by name)."""
        n, cfg = self._n, self.cfg
        w = Quantized(t[n("w")], t[n("w_scale_inv")], cfg.weight.block)
        out, xq_t, new_x = forward_gemm(x, w, bias, cfg, _state(t[n("x_history")], t[n("x_scale")]))
        return out, {n("new_x_history"): None if new_x is None else new_x.amax_history,
                     n("xt"): None if xq_t is None else xq_t.data,
                     n("xt_scale_inv"): None if xq_t is None else xq_t.scale_inv}

    def backward(self, s: dict, grad_out: torch.Tensor, need_dx: bool, dx_dtype: torch.dtype | None,
                 weight: str, ctx):
        """grad_out (tokens, out) -> (dx (tokens, in) or None, dw or None, {g_sink's name: its gradient}).

        `weight` names the op input whose gradient dw is (computed when ctx.need says so).
        """
        n, cfg = self._n, self.cfg
        need_dw = ctx.need[weight]
        if need_dw and s[n("xt")] is None:
            raise RuntimeError(f"te_func: the gradient of {weight} was requested but the forward ran without "
                               f"saving that GEMM's input ({weight}.requires_grad was False then)")
        w_t = Quantized(s[n("w_t")], s[n("w_t_scale_inv")], cfg.weight.block) if need_dx else None
        xq_t = Quantized(s[n("xt")], s[n("xt_scale_inv")], cfg.input.block) if need_dw else None
        dx, dw, new_g = backward_gemm(grad_out, w_t, xq_t, cfg, dx_dtype, ctx.dtype.get(weight),
                                      _state(s[n("g_history")], s[n("g_scale")]))
        sink = n("g_sink")
        return dx, dw, {sink: backward_amax(new_g) if ctx.need.get(sink) else None}


def backward_amax(new_g: DelayedState | None) -> torch.Tensor | None:
    """The grad history's "gradient": zeros, but for slot 0, which holds the amax this backward
    recorded. Merged by max into whatever the history is when backward runs, it lands in the
    current step's slot, as in TE, also when another step's forward ran in between."""
    if new_g is None:
        return None
    history = new_g.amax_history
    return torch.cat([history[:1], torch.zeros_like(history[1:])])
