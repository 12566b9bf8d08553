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
             p+g_sink                    the tensor whose "gradient" carries the backward amax
                                         (see `backward_amax`): the grad history's workspace entry
    outputs  p+new_x_history             the input history with this call's amax recorded
             p+new_g_history             the grad history as this call leaves it: carried state,
                                         whose backward-time value is g_sink's gradient
             p+x_saved, p+x_saved_scale_inv   what the weight-gradient GEMM reads of the input:
                                         the cast of x.T (blocks along tokens); with the recipe's
                                         backward_override, the cast of x ("dequantized") or x
                                         itself ("high_precision", no scale)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gemm import gemm, weight_only_gemm
from ..quant import DelayedState, Quantized, Scheme, WeightCast, dequantize, quantize_scheme, quantize_with_transpose
from ..quant import scheme_for

__all__ = ["GemmConfig", "GemmSlot", "forward_gemm", "backward_gemm", "backward_amax"]

# TE's accumulation where a recipe has no MMParams: fast for the forward GEMM, split
# (more precise) for the two backward GEMMs.
_DEFAULT_FAST_ACCUM = (True, False, False)


@dataclass(frozen=True)
class GemmConfig:
    """Static (hashable) description of one FP8 GEMM: how each role is scaled, how each
    of its three GEMMs accumulates, and what backward reads."""
    input: Scheme
    weight: Scheme
    grad: Scheme
    # Whether backward will need the weight gradient, so forward keeps what the
    # weight-gradient GEMM reads of the input; decided by the caller, who can see requires_grad.
    save_input: bool = True
    fast_accum: tuple[bool, bool, bool] = _DEFAULT_FAST_ACCUM     # fprop, dgrad, wgrad
    backward_override: str | None = None
    # Inference only (te_func.freeze, few tokens): the forward GEMM reads the FP8 weight
    # dequantized and the input as it is (te_func.gemm.weight_only_gemm). Not a TE mode.
    weight_only: bool = False

    def __post_init__(self):
        if self.weight_only and self.save_input:
            raise ValueError("GemmConfig: weight_only is a forward-only (inference) GEMM; it saves nothing "
                             "for backward (save_input=False)")

    @classmethod
    def of(cls, recipe, save_input: bool, weight_only: bool = False) -> "GemmConfig":
        """The config `recipe` gives one GEMM (MMParams.use_split_accumulator -> fast_accum)."""
        mm = [getattr(recipe, f"fp8_gemm_{g}", None) for g in ("fprop", "dgrad", "wgrad")]
        fast = tuple(d if p is None else not p.use_split_accumulator for p, d in zip(mm, _DEFAULT_FAST_ACCUM))
        return cls(*(scheme_for(recipe, role) for role in ("input", "weight", "grad")), save_input=save_input,
                   fast_accum=fast, backward_override=recipe.backward_override, weight_only=weight_only)


def forward_gemm(x: torch.Tensor, w: Quantized, bias: torch.Tensor | None, cfg: GemmConfig,
                 x_state: DelayedState | None = None):
    """x (tokens, in) @ w (out, in).T + bias -> (out (tokens, out), x's cast, x.T's cast or None, new x state).

    The cast of x.T (blocks along tokens, what the weight-gradient GEMM reads) is made
    when backward needs it, in the same pass as x's where the scheme allows. With
    cfg.weight_only x is not quantized (both casts None, the state as it was).
    """
    if cfg.weight_only:
        out = weight_only_gemm(x, w)
        return (out if bias is None else out + bias.to(out.dtype)), None, None, x_state
    if cfg.save_input and cfg.backward_override is None:
        xq, xq_t, new_state = quantize_with_transpose(x, cfg.input, x_state)
    else:
        (xq, new_state), xq_t = quantize_scheme(x, cfg.input, x_state), None
    out = gemm(xq, w, x.dtype, fast_accum=cfg.fast_accum[0])
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out, xq, xq_t, new_state


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
    dx = None if w_t is None else gemm(gq, w_t, x_dtype, fast_accum=cfg.fast_accum[1])
    dw = None if xq_t is None else gemm(gq_t, xq_t, w_dtype, fast_accum=cfg.fast_accum[2])
    return dx, dw, new_state


def _state(history, scale) -> DelayedState | None:
    # A scale without a history: a forward-only call (te_func.freeze), which records nothing.
    return None if scale is None else DelayedState(history, scale)


def backward_amax(new_g: DelayedState | None) -> torch.Tensor | None:
    """The grad history's "gradient": zeros but for slot 0, the amax of this backward's output
    gradient (`backward_gemm` records it into a zero history). Merged by max into whatever the
    history is when backward runs, it lands in the current step's slot, as in TE, also when
    another step's forward ran in between or this backward is a checkpoint's recompute."""
    return None if new_g is None else new_g.amax_history


@dataclass(frozen=True)
class GemmSlot:
    """One FP8 GEMM inside an op: its config, the op input that is its weight, and the
    prefix of its tensors' names."""
    cfg: GemmConfig
    weight: str = "weight"
    prefix: str = ""

    def _n(self, name: str) -> str:
        return self.prefix + name

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(map(self._n, ("new_x_history", "new_g_history", "x_saved", "x_saved_scale_inv")))

    @property
    def carried(self) -> dict[str, str]:
        return {self._n("new_g_history"): self._n("g_sink")}

    @property
    def saved(self) -> tuple[str, ...]:
        # What the input-gradient GEMM reads of the weight: its transposed cast, or with
        # backward_override the forward's cast ("dequantized") or the weight itself.
        w = {None: ("w_t", "w_t_scale_inv"), "dequantized": ("w", "w_scale_inv"),
             "high_precision": ()}[self.cfg.backward_override]
        own = tuple(map(self._n, (*w, "x_saved", "x_saved_scale_inv", "g_history", "g_scale")))
        return own + ((self.weight,) if self.cfg.backward_override == "high_precision" else ())

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

    def forward_inputs(self, w: Quantized, x_scale: torch.Tensor | None) -> dict:
        """This slot's input tensors for a forward-only call (inference, te_func.freeze): the
        forward GEMM's weight cast and, under DelayedScaling, the input's scale alone."""
        return {self._n(k): v for k, v in (
            ("w", w.data), ("w_scale_inv", w.scale_inv), ("x_history", None), ("x_scale", x_scale),
            ("g_history", None))}

    def new_states(self, outputs: dict, x_state: DelayedState | None, g_state: DelayedState | None):
        """The input and grad roles' states after the call: `x_state` with this call's amax
        recorded, `g_state` as the op returned it (carried state, see above)."""
        if x_state is None:
            return None, g_state
        return (DelayedState(outputs[self._n("new_x_history")], x_state.scale),
                DelayedState(outputs[self._n("new_g_history")], g_state.scale))

    def forward(self, t: dict, x: torch.Tensor, bias: torch.Tensor | None):
        """x (tokens, in) -> (out (tokens, out) in x's dtype, this slot's outputs by name)."""
        n, cfg = self._n, self.cfg
        w = Quantized(t[n("w")], t[n("w_scale_inv")], cfg.weight.block)
        out, xq, xq_t, new_x = forward_gemm(x, w, bias, cfg, _state(t[n("x_history")], t[n("x_scale")]))
        saved, saved_scale_inv = None, None
        if cfg.save_input:
            saved, saved_scale_inv = {None: (None if xq_t is None else xq_t.data, None if xq_t is None else xq_t.scale_inv),
                                      "dequantized": (xq.data, xq.scale_inv),
                                      # a view: a Function may not save an input it returns as is
                                      "high_precision": (x.view_as(x), None)}[cfg.backward_override]
        g_history = t[n("g_history")]
        return out, {n("new_x_history"): None if new_x is None else new_x.amax_history,
                     # a copy: a Function may not return an input as it is
                     n("new_g_history"): None if g_history is None else g_history.clone(),
                     n("x_saved"): saved, n("x_saved_scale_inv"): saved_scale_inv}

    def backward(self, s: dict, grad_out: torch.Tensor, need_dx: bool, dx_dtype: torch.dtype | None, ctx):
        """grad_out (tokens, out) -> (dx (tokens, in) or None, dw or None, {g_sink's name: its gradient})."""
        n, cfg, weight = self._n, self.cfg, self.weight
        need_dw = ctx.need[weight]
        if need_dw and s[n("x_saved")] is None:
            raise RuntimeError(f"te_func: the gradient of {weight} was requested but the forward ran without "
                               f"saving that GEMM's input ({weight}.requires_grad was False then)")
        if cfg.backward_override is not None:
            dx, dw = self._backward_unquantized(s, grad_out, need_dx, need_dw, dx_dtype, ctx.dtype.get(weight))
            return dx, dw, {}
        w_t = Quantized(s[n("w_t")], s[n("w_t_scale_inv")], cfg.weight.block) if need_dx else None
        xq_t = Quantized(s[n("x_saved")], s[n("x_saved_scale_inv")], cfg.input.block) if need_dw else None
        # The amax goes into a zero history: only this backward's amax comes back (see backward_amax).
        g_history = s[n("g_history")]
        g_state = None if g_history is None else DelayedState(torch.zeros_like(g_history), s[n("g_scale")])
        dx, dw, new_g = backward_gemm(grad_out, w_t, xq_t, cfg, dx_dtype, ctx.dtype.get(weight), g_state)
        sink = n("g_sink")
        return dx, dw, {sink: backward_amax(new_g) if ctx.need.get(sink) else None}

    def _backward_unquantized(self, s, grad_out, need_dx, need_dw, dx_dtype, w_dtype):
        # TE's backward_override: the output gradient stays in high precision and the two
        # backward GEMMs read the saved operands in it: the forward's FP8 casts dequantized
        # to the gradient's dtype ("dequantized"), or the original tensors ("high_precision").
        n, cfg, dtype = self._n, self.cfg, grad_out.dtype
        if cfg.backward_override == "dequantized":
            w = dequantize(Quantized(s[n("w")], s[n("w_scale_inv")], cfg.weight.block), dtype) if need_dx else None
            x = dequantize(Quantized(s[n("x_saved")], s[n("x_saved_scale_inv")], cfg.input.block), dtype) \
                if need_dw else None
        else:
            w, x = s[self.weight].to(dtype), s[n("x_saved")]
        dx = (grad_out @ w).to(dx_dtype) if need_dx else None                   # (tokens, in)
        dw = (grad_out.t() @ x.to(dtype)).to(w_dtype) if need_dw else None     # (out, in)
        return dx, dw
