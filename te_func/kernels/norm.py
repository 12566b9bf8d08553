"""Triton kernels of LayerNorm / RMSNorm for the eager CUDA path: one pass forward, one back.

The forward writes the output, mean and rsigma and takes the output's amax on the way; the
backward reads dy and x once and writes dx and per-program partial sums of dweight and dbias
(te_func.ops.normalization's formulas are ten-odd fp32 passes eagerly; these are TE's two).
The elementwise math is the formulas', op for op in fp32 without FMA contraction; the row
reductions add in the kernels' order, so they agree with the torch path to fp32 rounding
(tests/kernels/test_kernels.py bounds it). Rows fit one block: hidden <= MAX_HIDDEN."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .cast import INTERPRETED, _round_to

MAX_HIDDEN = 16384
ROWS_FORWARD = 8        # rows per program of the forward (one amax atomic per program)
PROGRAMS_PER_SM = 2     # of the backward: its partial sums are (programs, hidden) fp32


@triton.jit
def _rsqrt(v):
    if INTERPRETED:     # no libdevice in Triton's interpreter
        return 1.0 / tl.sqrt(v)
    else:
        return libdevice.rsqrt(v)   # torch.rsqrt's (and inductor's) rsqrtf


@triton.jit
def _row_stats(x, cmask, inv_n, eps, RMS: tl.constexpr):
    """(x_hat, mean, rsigma) of one fp32 row, masked lanes 0 (normalization.norm_forward)."""
    if RMS:
        mean = 0.0
        rsigma = _rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
        x_hat = x * rsigma
    else:
        mean = tl.sum(x, axis=0) * inv_n
        centered = tl.where(cmask, x - mean, 0.0)
        rsigma = _rsqrt(tl.sum(centered * centered, axis=0) * inv_n + eps)
        x_hat = centered * rsigma
    return x_hat, mean, rsigma


@triton.jit
def _norm_forward_kernel(x_ptr, gamma_ptr, beta_ptr, y_ptr, mean_ptr, rsigma_ptr, amax_bits_ptr, M, N,
                         inv_n, eps, RMS: tl.constexpr, HAS_BETA: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """Rows [pid * ROWS, pid * ROWS + ROWS) of x (M, N): y = x_hat * gamma (+ beta) in x's dtype,
    mean (LayerNorm) and rsigma (M,) fp32, max |y| into amax_bits_ptr (as `cast._amax_kernel`)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    gamma = tl.load(gamma_ptr + cols, mask=cmask, other=0.0)
    if HAS_BETA:
        beta = tl.load(beta_ptr + cols, mask=cmask, other=0.0)
    acc = tl.zeros([BLOCK_N], dtype=tl.int32)
    for r in range(ROWS):
        row = pid * ROWS + r
        mask = cmask & (row < M)
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
        x_hat, mean, rsigma = _row_stats(x.to(tl.float32), cmask, inv_n, eps, RMS)
        y = x_hat * gamma
        if HAS_BETA:
            y = y + beta
        y = _round_to(y, x.dtype)
        tl.store(y_ptr + row * N + cols, y.to(x.dtype), mask=mask)
        acc = tl.maximum(acc, tl.where(mask & (y == y), tl.abs(y), 0.0).to(tl.int32, bitcast=True))
        if not RMS:
            tl.store(mean_ptr + row, mean, mask=row < M)
        tl.store(rsigma_ptr + row, rsigma, mask=row < M)
    tl.atomic_max(amax_bits_ptr, tl.max(acc, axis=0))


@triton.jit
def _norm_backward_kernel(dy_ptr, x_ptr, mean_ptr, rsigma_ptr, gamma_ptr, dx_ptr, dgamma_ptr, dbeta_ptr, M, N,
                          rows_per_program, inv_n, RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx (M, N) in x's dtype, and this program's sums over its rows of dy * x_hat and dy in
    row pid of dgamma_ptr / dbeta_ptr (programs, N) fp32, which the caller adds up."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    gamma = tl.load(gamma_ptr + cols, mask=cmask, other=0.0)
    dgamma = tl.zeros([BLOCK_N], dtype=tl.float32)
    dbeta = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r in range(rows_per_program):
        row = pid * rows_per_program + r
        in_rows = row < M
        mask = cmask & in_rows
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        rsigma = tl.load(rsigma_ptr + row, mask=in_rows, other=0.0)
        if RMS:
            x_hat = x.to(tl.float32) * rsigma
        else:
            x_hat = tl.where(mask, x.to(tl.float32) - tl.load(mean_ptr + row, mask=in_rows, other=0.0), 0.0) * rsigma
        dgamma += dy * x_hat
        dbeta += dy
        # normalization._norm_dx: dx_hat - x_hat * mean(dx_hat * x_hat) (- mean(dx_hat)), times rsigma
        dx_hat = dy * gamma
        inner = dx_hat - x_hat * (tl.sum(dx_hat * x_hat, axis=0) * inv_n)
        if not RMS:
            inner = inner - tl.sum(dx_hat, axis=0) * inv_n
        dx = _round_to(inner * rsigma, x.dtype)
        tl.store(dx_ptr + row * N + cols, dx.to(x.dtype), mask=mask)
    tl.store(dgamma_ptr + pid * N + cols, dgamma, mask=cmask)
    tl.store(dbeta_ptr + pid * N + cols, dbeta, mask=cmask)


def _warps(block_n: int) -> int:
    return max(1, min(16, block_n // 512))


@functools.cache
def _mean_factor(n: int) -> float:
    # torch's mean multiplies the sum by 1/n rounded to fp32 (cached: no tensor per eager call)
    return torch.tensor(1.0 / n, dtype=torch.float32).item()


def norm_forward(x2d: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None, eps: float, rms: bool):
    """x (M, N), gamma / beta (N,) fp32 -> (y, mean (M,) or None, rsigma (M,), max |y| as fp32 bits)."""
    m, n = x2d.shape
    y = torch.empty_like(x2d)
    mean = None if rms else torch.empty(m, dtype=torch.float32, device=x2d.device)
    rsigma = torch.empty(m, dtype=torch.float32, device=x2d.device)
    bits = torch.zeros(1, dtype=torch.int32, device=x2d.device)
    block_n = triton.next_power_of_2(n)
    _norm_forward_kernel[(triton.cdiv(m, ROWS_FORWARD),)](
        x2d, gamma, gamma if beta is None else beta, y, rsigma if mean is None else mean, rsigma, bits, m, n,
        _mean_factor(n), eps, RMS=rms, HAS_BETA=beta is not None, ROWS=ROWS_FORWARD, BLOCK_N=block_n,
        num_warps=_warps(block_n), enable_fp_fusion=False)
    return y, mean, rsigma, bits


def norm_backward(dy2d: torch.Tensor, x2d: torch.Tensor, mean: torch.Tensor | None, rsigma: torch.Tensor,
                  gamma: torch.Tensor, rms: bool):
    """dy, x (M, N), mean / rsigma (M,), gamma (N,) fp32 -> (dx in x's dtype, dgamma, dbeta fp32)."""
    m, n = x2d.shape
    dx = torch.empty_like(x2d)
    sms = torch.cuda.get_device_properties(x2d.device).multi_processor_count if x2d.is_cuda else 2
    programs = max(1, min(m, PROGRAMS_PER_SM * sms))
    rows = triton.cdiv(m, programs)
    programs = triton.cdiv(m, rows)
    dgamma = torch.empty((programs, n), dtype=torch.float32, device=x2d.device)
    dbeta = torch.empty((programs, n), dtype=torch.float32, device=x2d.device)
    block_n = triton.next_power_of_2(n)
    _norm_backward_kernel[(programs,)](
        dy2d, x2d, rsigma if mean is None else mean, rsigma, gamma, dx, dgamma, dbeta, m, n, rows,
        _mean_factor(n), RMS=rms, BLOCK_N=block_n, num_warps=_warps(block_n), enable_fp_fusion=False)
    return dx, dgamma.sum(0), dbeta.sum(0)
