"""Triton kernels of DelayedScaling's bookkeeping for the eager CUDA path: one launch each.

`update` is te_func.quant.delayed.delayed_update and `record` is te_func.quant.tensor.record_amax,
whose torch code is twenty-odd and five tiny ops per role (host-bound eagerly). The values are
the torch code's bit for bit: maxima and selections are exact, the one division rounds to
nearest (`div_rn`), as torch's does."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cast import FLT_MAX

MAX_HISTORY = 65536       # one program holds the whole history


@triton.jit
def _update_kernel(h_ptr, scale_ptr, h_out_ptr, scale_out_ptr, L, scaled_max, MOST_RECENT: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    inside = offs < L
    h = tl.load(h_ptr + offs, mask=inside, other=float("-inf"))
    last = tl.load(h_ptr)
    if MOST_RECENT:
        amax = last
    else:
        amax = tl.max(tl.where(h != h, 0.0, h), axis=0)       # NaN skipped
    amax = tl.where(last == 0, 0.0, amax)
    quotient = tl.math.div_rn(scaled_max + tl.zeros_like(amax), amax)
    keep = tl.load(scale_ptr)
    scale = tl.where((amax > 0) & (tl.abs(amax) < float("inf")), quotient, keep)
    scale = tl.where(tl.abs(scale) == float("inf"), FLT_MAX, scale)
    # roll by -1 and zero slot 0: [0, h[2], ..., h[L-1], h[0]]
    rolled = tl.load(h_ptr + offs + 1, mask=(offs >= 1) & (offs < L - 1), other=0.0)
    rolled = tl.where(offs == L - 1, last, rolled)
    rolled = tl.where(offs == 0, 0.0, rolled)
    tl.store(h_out_ptr + offs, tl.where(last == 0, h, rolled), mask=inside)
    tl.store(scale_out_ptr, scale)


@triton.jit
def _record_kernel(h_ptr, amax_ptr, h_out_ptr, L, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    inside = offs < L
    h = tl.load(h_ptr + offs, mask=inside, other=0.0)
    amax = tl.load(amax_ptr)
    # torch.maximum: NaN if either is NaN
    kept = tl.where(h != h, h, tl.where(amax != amax, amax, tl.maximum(h, amax)))
    tl.store(h_out_ptr + offs, tl.where(offs == 0, kept, h), mask=inside)


def update(history: torch.Tensor, scale: torch.Tensor, scaled_max: float, most_recent: bool):
    """history (L,) and scale () fp32, contiguous -> (new history, new scale), new tensors."""
    h_out, s_out = torch.empty_like(history), torch.empty_like(scale)
    _update_kernel[(1,)](history, scale, h_out, s_out, history.numel(), scaled_max, MOST_RECENT=most_recent,
                         BLOCK=triton.next_power_of_2(history.numel()))
    return h_out, s_out


def record(history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """history (L,) fp32 contiguous, amax () fp32 -> history with max(history[0], amax) in slot 0."""
    h_out = torch.empty_like(history)
    _record_kernel[(1,)](history, amax, h_out, history.numel(), BLOCK=triton.next_power_of_2(history.numel()))
    return h_out
