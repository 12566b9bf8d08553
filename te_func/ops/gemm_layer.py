"""The FP8 (or FP4) GEMM every GEMM layer's op is built from: `GemmSlot`.

A slot is one GEMM's part of an op: the tensors it reads and returns, by name under its GEMM's
prefix (`Gemm.slot`), and its two halves. Forward quantizes the input once (both copies when
backward needs the weight gradient) and runs the forward GEMM; backward quantizes the output
gradient once and runs the two backward GEMMs. The layers differ only around their slots.

Tensors of a slot with prefix p (None where the recipe keeps no such state):
    inputs   p+w, p+w_scale_inv, p+w_t, p+w_t_scale_inv   the weight's cast, both layouts
             p+w_amax                    NVFP4: the weight's global amax
             p+x_record, p+x_scale       the input's DelayedScaling history and scale (batch
                                         scope: the batch's amax, no scale)
             p+g_record, p+g_scale       ... the output gradient's
             p+g_sink                    the entry whose "gradient" carries the backward amax
             p+g_rng                     NVFP4: the RNG state the backward rounds with
    outputs  p+new_x_record              the input record with this call's amax
             p+new_g_record              carried state: its backward-time value is g_sink's gradient
             p+x_saved, p+x_saved_scale_inv, p+x_saved_amax   what the weight-gradient GEMM
                                         reads of the input (per the recipe's backward_override)"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..gemm import gemm, weight_only_gemm
from ..quant import (BatchAmax, DelayedState, Gemm, Quantized, Scheme, WeightCast, dequantize, quantize_scheme,
                     quantize_with_transpose)
from ..quant import scheme_for
from ..recipe import derivation, derived

__all__ = ["GemmConfig", "GemmSlot", "GradCasts", "forward_gemm", "backward_gemm", "backward_gemms", "quantize_grad",
           "backward_amax"]

# TE's accumulation without MMParams: fast forward, split (more precise) backward GEMMs.
_DEFAULT_FAST_ACCUM = (True, False, False)


@dataclass(frozen=True)
class GemmConfig:
    """Static (hashable) description of one FP8 GEMM: scaling, accumulation and what backward reads."""
    input: Scheme
    weight: Scheme
    grad: Scheme
    # Whether forward keeps what the weight-gradient GEMM reads (the caller sees requires_grad).
    save_input: bool = True
    fast_accum: tuple[bool, bool, bool] = _DEFAULT_FAST_ACCUM     # fprop, dgrad, wgrad
    backward_override: str | None = None
    # Inference only (te_func.freeze): te_func.gemm.weight_only_gemm. Not a TE mode.
    weight_only: bool = False

    def __post_init__(self):
        if self.weight_only and self.save_input:
            raise ValueError("GemmConfig: weight_only is a forward-only (inference) GEMM; it saves nothing "
                             "for backward (save_input=False)")

    @classmethod
    def of(cls, recipe, save_input: bool, weight_only: bool = False) -> GemmConfig:
        """The config `recipe` gives one GEMM (MMParams.use_split_accumulator -> fast_accum)."""
        if save_input and weight_only:      # no such derivation: the config itself says why
            return cls._make(recipe, save_input, weight_only)
        return derived(recipe, ("gemm config", save_input, weight_only))

    @classmethod
    def _make(cls, recipe, save_input: bool, weight_only: bool) -> GemmConfig:
        def fast(gemm: str, default: bool) -> bool:
            mm = getattr(recipe, f"fp8_gemm_{gemm}", None)
            return default if mm is None else not mm.use_split_accumulator
        fprop, dgrad, wgrad = _DEFAULT_FAST_ACCUM
        return cls(scheme_for(recipe, "input"), scheme_for(recipe, "weight"), scheme_for(recipe, "grad"),
                   save_input=save_input, fast_accum=(fast("fprop", fprop), fast("dgrad", dgrad), fast("wgrad", wgrad)),
                   backward_override=recipe.backward_override, weight_only=weight_only)


# The GEMM configs a recipe gives: trained with and without the weight gradient, and frozen.
for _save, _weight_only in ((True, False), (False, False), (False, True)):
    derivation(("gemm config", _save, _weight_only),
               lambda recipe, s=_save, w=_weight_only: GemmConfig._make(recipe, s, w))


def forward_gemm(x: torch.Tensor, w: Quantized, bias: torch.Tensor | None, cfg: GemmConfig,
                 x_state: DelayedState | BatchAmax | None = None, x_amax: torch.Tensor | None = None,
                 x_scale_inv: torch.Tensor | None = None):
    """x (tokens, in) @ w (out, in).T + bias -> (out, x's cast, x.T's cast or None, new x state).
    x.T's cast (what the weight-gradient GEMM reads) is made when backward needs it, in one pass with
    x's where the scheme allows; cfg.weight_only quantizes nothing. x_amax: as quantize_scheme's.
    x_scale_inv: the reciprocal of x_state's scale, where the caller keeps it."""
    if cfg.weight_only:
        return weight_only_gemm(x, w, bias), None, None, x_state
    if cfg.save_input and cfg.backward_override is None:
        xq, xq_t, new_state = quantize_with_transpose(x, cfg.input, x_state, x_amax)
    else:
        (xq, new_state), xq_t = quantize_scheme(x, cfg.input, x_state, x_amax), None
    if x_scale_inv is not None:
        xq = replace(xq, scale_inv=x_scale_inv)
    return gemm(xq, w, x.dtype, fast_accum=cfg.fast_accum[0], bias=bias), xq, xq_t, new_state


def quantize_grad(grad_out: torch.Tensor, cfg: GemmConfig, with_transpose: bool, g_state=None,
                  amax: torch.Tensor | None = None):
    """The output gradient's casts: (gq, gq_t (of grad_out.T) or None, new grad state)."""
    if not with_transpose:          # input gradient only: one cast, along out_features
        gq, new_state = quantize_scheme(grad_out, cfg.grad, g_state, amax)
        return gq, None, new_state
    return quantize_with_transpose(grad_out, cfg.grad, g_state, amax)


def backward_gemms(gq: Quantized, gq_t: Quantized | None, w_t: Quantized | None, xq_t: Quantized | None,
                   cfg: GemmConfig, x_dtype: torch.dtype | None, w_dtype: torch.dtype):
    """The backward GEMMs from the gradient's casts: (dx where w_t is given, dw where xq_t, gq_t are)."""
    dx = None if w_t is None or x_dtype is None else gemm(gq, w_t, x_dtype, fast_accum=cfg.fast_accum[1])
    dw = None if xq_t is None or gq_t is None else gemm(gq_t, xq_t, w_dtype, fast_accum=cfg.fast_accum[2])
    return dx, dw


def backward_gemm(grad_out: torch.Tensor, w_t: Quantized | None, xq_t: Quantized | None, cfg: GemmConfig,
                  x_dtype: torch.dtype, w_dtype: torch.dtype, g_state=None):
    """grad_out (tokens, out) -> (dx or None, dw or None, new grad state): dx when `w_t` is given, dw
    when `xq_t` is. g_state: a DelayedState, NVFP4's RNG state, or None."""
    if w_t is None and xq_t is None:
        return None, None, g_state
    gq, gq_t, new_state = quantize_grad(grad_out, cfg, xq_t is not None, g_state)
    return (*backward_gemms(gq, gq_t, w_t, xq_t, cfg, x_dtype, w_dtype), new_state)


@dataclass
class GradCasts:
    """A slot's backward's first half: which GEMMs run, and the output gradient as they read it
    (its casts and new grad state, or with backward_override the gradient itself)."""
    need_dx: bool
    need_dw: bool
    gq: Quantized | None = None
    gq_t: Quantized | None = None
    new_g: object = None
    grad_out: torch.Tensor | None = None


def _state(s: Scheme, record, scale) -> DelayedState | BatchAmax | None:
    """A role's state from its tensors: a history and scale, or a batch amax and (per-sample) its
    scale; a scale alone is forward-only (te_func.freeze)."""
    if s.rule == "delayed":
        return None if scale is None else DelayedState(record, scale)
    return None if record is None else BatchAmax(record, scale)


def backward_amax(new_g) -> torch.Tensor | None:
    """The grad record's "gradient": for a history, zeros but for slot 0, this backward's amax, which
    a max merges into the current step's slot whenever backward runs (as in TE); for a batch amax,
    the amax this backward quantized with."""
    return new_g.record if isinstance(new_g, (DelayedState, BatchAmax)) else None


def _straight_through(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (fp32), with `t`'s derivatives: t - t.detach() is exactly zero."""
    return value + (t - t.detach()).float()


@dataclass(frozen=True)
class GemmSlot:
    """One FP8 GEMM inside an op: its config, and the GEMM, whose tensors carry its prefix."""
    cfg: GemmConfig
    gemm: Gemm

    def __post_init__(self):
        # Every tensor name of the slot carries this prefix: formed once, not at each of ~75 names a
        # call. Not a field: torch.compile rebuilds a constant GemmSlot from its fields alone.
        object.__setattr__(self, "_prefix", self.gemm.slot)

    @property
    def weight(self) -> str:
        return self.gemm.weight

    def _n(self, name: str) -> str:
        return self._prefix + name      # type: ignore[attr-defined]  # set in __post_init__

    @property
    def input_cast_takes_partials(self) -> bool:
        """The input's cast is current scaling's tensor-wise cast alone (no transposed copy, not
        weight-only): it can take its producer's partial maxes (te_func.quant.quantize_scheme)."""
        s = self.cfg.input
        return s.rule == "current" and s.block is None and not self.cfg.save_input and not self.cfg.weight_only

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(map(self._n, ("new_x_record", "new_g_record", "x_saved", "x_saved_scale_inv",
                                   "x_saved_amax")))

    @property
    def carried(self) -> dict[str, str]:
        return {self._n("new_g_record"): self._n("g_sink")}

    @property
    def saved(self) -> tuple[str, ...]:
        # The weight as the input-gradient GEMM reads it (backward_override: the forward cast, or it).
        w = {None: ("w_t", "w_t_scale_inv", "w_amax"), "dequantized": ("w", "w_scale_inv", "w_amax"),
             "high_precision": ()}[self.cfg.backward_override]
        own = tuple(map(self._n, (*w, "x_saved", "x_saved_scale_inv", "x_saved_amax", "g_record", "g_scale",
                                  "g_rng")))
        return own + ((self.weight,) if self.cfg.backward_override == "high_precision" else ())

    def inputs(self, cast: WeightCast, x_state: DelayedState | BatchAmax | None,
               g_state: DelayedState | BatchAmax | None, g_sink: torch.Tensor | None,
               g_rng: torch.Tensor | None = None) -> dict:
        """This slot's input tensors by name, from the GEMM's weight cast and states for this call."""
        record = lambda st: None if st is None else st.record                       # noqa: E731
        scale = lambda st: None if st is None else st.scale                          # noqa: E731
        return {self._n(k): v for k, v in (
            ("w", cast.rowwise.data), ("w_scale_inv", cast.rowwise.scale_inv),
            ("w_t", cast.columnwise.data), ("w_t_scale_inv", cast.columnwise.scale_inv),
            ("w_amax", cast.rowwise.global_amax),
            ("x_record", record(x_state)), ("x_scale", scale(x_state)),
            ("g_sink", g_sink), ("g_record", record(g_state)), ("g_scale", scale(g_state)), ("g_rng", g_rng))}

    def forward_inputs(self, w: Quantized, x_scale: torch.Tensor | None,
                       x_scale_inv: torch.Tensor | None = None) -> dict:
        """This slot's inputs for a forward-only call (te_func.freeze): the forward cast and, under
        DelayedScaling, the input's scale (and its reciprocal where the caller keeps it)."""
        return {self._n(k): v for k, v in (
            ("w", w.data), ("w_scale_inv", w.scale_inv), ("w_amax", w.global_amax), ("x_record", None),
            ("x_scale", x_scale), ("x_scale_inv", x_scale_inv), ("g_record", None))}

    def new_states(self, outputs: dict, x_state, g_state):
        """The input and grad roles' states after the call, as the op returned them."""
        def after(state, name):
            return None if state is None else state.with_record(outputs[self._n(name)])
        return after(x_state, "new_x_record"), after(g_state, "new_g_record")

    @property
    def linearization_reads(self) -> tuple[str, ...]:
        """What `linearized` reads besides the input and bias: the weight, its cast, the input state."""
        return (self.weight, *map(self._n, ("w", "w_scale_inv", "w_amax", "x_record", "x_scale")))

    def linearized(self, t: dict, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias as the forward GEMM computes it in fp32 on its dequantized casts, each cast
        passing derivatives straight through: the GEMM's derivatives beyond the first order."""
        n, cfg = self._n, self.cfg
        w = dequantize(Quantized(t[n("w")], t[n("w_scale_inv")], cfg.weight.block, t[n("w_amax")], None))
        xq, _ = quantize_scheme(x.detach(), cfg.input, _state(cfg.input, t[n("x_record")], t[n("x_scale")]))
        out = _straight_through(x, dequantize(xq)) @ _straight_through(t[self.weight], w).t()
        return (out if bias is None else out + bias.float()).to(x.dtype)

    def forward(self, t: dict, x: torch.Tensor, bias: torch.Tensor | None, x_amax: torch.Tensor | None = None):
        """x (tokens, in) -> (out in x's dtype, this slot's outputs by name)."""
        n, cfg = self._n, self.cfg
        w = Quantized(t[n("w")], t[n("w_scale_inv")], cfg.weight.block, t[n("w_amax")], None)
        out, xq, xq_t, new_x = forward_gemm(x, w, bias, cfg, _state(cfg.input, t[n("x_record")], t[n("x_scale")]),
                                            x_amax, t.get(n("x_scale_inv")))
        saved: tuple = (None, None, None)
        if cfg.save_input:
            saved = {None: (None, None, None) if xq_t is None else (xq_t.data, xq_t.scale_inv, xq_t.global_amax),
                     "dequantized": (xq.data, xq.scale_inv, xq.global_amax),
                     # a view: a Function may not save an input it returns as is
                     "high_precision": (x.view_as(x), None, None)}[cfg.backward_override]
        g_record = t[n("g_record")]
        return out, {n("new_x_record"): None if new_x is None else new_x.record,
                     # a copy: a Function may not return an input as it is
                     n("new_g_record"): None if g_record is None else g_record.clone(),
                     **dict(zip(map(n, ("x_saved", "x_saved_scale_inv", "x_saved_amax")), saved))}

    def backward(self, s: dict, grad_out: torch.Tensor, need_dx: bool, dx_dtype: torch.dtype | None, ctx):
        """grad_out (tokens, out) -> (dx (tokens, in) or None, dw or None, {g_sink's name: its gradient})."""
        return self.backward_gemms(s, self.backward_cast(s, grad_out, need_dx, ctx), dx_dtype, ctx)

    def backward_cast(self, s: dict, grad_out: torch.Tensor, need_dx: bool, ctx,
                      amax: torch.Tensor | None = None) -> GradCasts:
        """`backward`'s first half: grad_out quantized once for the GEMMs that will run (a caller that
        drops grad_out lowers eager's peak memory). amax: as `forward_gemm`'s x_amax."""
        n, cfg = self._n, self.cfg
        need_dw = ctx.need[self.weight]
        if need_dw and s[n("x_saved")] is None:
            raise RuntimeError(f"te_func: the gradient of {self.weight} was requested but the forward ran without "
                               f"saving that GEMM's input ({self.weight}.requires_grad was False then)")
        if cfg.backward_override is not None:
            return GradCasts(need_dx, need_dw, grad_out=grad_out)
        if cfg.grad.rule == "delayed" and ctx.second_order:
            # Second-order cotangents have no history of their own and differ in size from the
            # gradients the history scales: scaled from their own amax, recorded nowhere.
            cfg = replace(cfg, grad=replace(cfg.grad, rule="current", margin=0))
            if not (need_dx or need_dw):
                return GradCasts(need_dx, need_dw)
            return GradCasts(need_dx, need_dw, *quantize_grad(grad_out, cfg, need_dw, None, amax))
        if cfg.grad.stochastic_rounding:
            g_state = s[n("g_rng")]
        else:
            g_state = _state(cfg.grad, s[n("g_record")], s[n("g_scale")])
            if isinstance(g_state, DelayedState) and g_state.amax_history is not None:
                # The amax goes into a zero history: only this backward's amax comes back (see backward_amax).
                g_state = DelayedState(torch.zeros_like(g_state.amax_history), g_state.scale)
        if not (need_dx or need_dw):
            return GradCasts(need_dx, need_dw, new_g=g_state)
        return GradCasts(need_dx, need_dw, *quantize_grad(grad_out, cfg, need_dw, g_state, amax))

    def backward_gemms(self, s: dict, casts: GradCasts, dx_dtype: torch.dtype | None, ctx):
        """`backward`'s second half: (dx or None, dw or None, {g_sink's name: its gradient})."""
        n, cfg, w_dtype = self._n, self.cfg, ctx.dtype.get(self.weight)
        if cfg.backward_override is not None:
            return (*self._backward_unquantized(s, casts.grad_out, casts.need_dx, casts.need_dw, dx_dtype, w_dtype),
                    {})
        w_t = Quantized(s[n("w_t")], s[n("w_t_scale_inv")], cfg.weight.block, s[n("w_amax")], None) \
            if casts.need_dx else None
        xq_t = Quantized(s[n("x_saved")], s[n("x_saved_scale_inv")], cfg.input.block,
                         s[n("x_saved_amax")], None) if casts.need_dw else None
        dx, dw = (None, None) if casts.gq is None else backward_gemms(casts.gq, casts.gq_t, w_t, xq_t, cfg,
                                                                      dx_dtype, w_dtype)
        # Given whether or not the sink is differentiated: the boundary records it either way.
        return dx, dw, {n("g_sink"): backward_amax(casts.new_g)}

    def _backward_unquantized(self, s, grad_out, need_dx, need_dw, dx_dtype, w_dtype):
        # TE's backward_override: the backward GEMMs run in high precision on the forward's casts
        # dequantized ("dequantized") or the original tensors ("high_precision").
        n, cfg, dtype = self._n, self.cfg, grad_out.dtype
        if cfg.backward_override == "dequantized":
            w = dequantize(Quantized(s[n("w")], s[n("w_scale_inv")], cfg.weight.block, s[n("w_amax")], None),
                           dtype) if need_dx else None
            x = dequantize(Quantized(s[n("x_saved")], s[n("x_saved_scale_inv")], cfg.input.block,
                                     s[n("x_saved_amax")], None), dtype) if need_dw else None
        else:
            w, x = s[self.weight].to(dtype), s[n("x_saved")]
        dx = (grad_out @ w).to(dx_dtype) if need_dx else None                   # (tokens, in)
        dw = (grad_out.t() @ x.to(dtype)).to(w_dtype) if need_dw else None     # (out, in)
        return dx, dw
