"""The FP8 GEMM halves every GEMM layer's autograd Function is built from.

`forward_gemm` quantizes the input once (both copies, when backward needs
the weight gradient) and runs the forward GEMM; `backward_gemm` quantizes
the output gradient and runs the input- and weight-gradient GEMMs. Linear,
LayerNormLinear, LayerNormMLP and GroupedLinear differ only in what they
do around these calls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gemm import gemm
from ..quant import DelayedState, Quantized, Scheme, quantize_scheme, quantize_with_transpose

__all__ = ["GemmConfig", "forward_gemm", "backward_gemm", "delayed_state", "grad_history_gradient"]


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


# DelayedScaling through an autograd Function. A Function takes tensors, so a
# GEMM layer's Function takes, per GEMM, five optional tensors (None for the
# stateless recipes): x_history, x_scale (the input role's state), g_sink,
# g_history, g_scale (the grad role's). The states arrive already updated for
# the step (te_func.functional._common.step_states); forward returns the input
# history with this call's amax recorded as a non-differentiable output, and
# backward returns the grad history with the grad-output amax recorded as the
# "gradient" of g_sink, the raw workspace entry: tef.grad and tef.Stateful
# collect it from there ("overwrite with gradient", as Flax and TE-JAX do).


def delayed_state(history: torch.Tensor | None, scale: torch.Tensor | None) -> DelayedState | None:
    """The (amax history (L,), scale ()) pair a Function received, or None without state."""
    return None if history is None else DelayedState(history, scale)


def grad_history_gradient(new_g_state: DelayedState | None, wanted: bool) -> torch.Tensor | None:
    """What backward returns for g_sink: the recorded grad history (L,), or None."""
    return new_g_state.amax_history if wanted and new_g_state is not None else None
