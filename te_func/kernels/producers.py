"""Triton kernels that write a tensor's current-scaling FP8 cast in one launch, for few tokens.

A current-scaling cast waits for the amax of the whole tensor. At decode sizes, (16, 14336)
say, the passes that make it (the producer with the amax, a reduction over its partial maxima,
the cast) cost a launch each and more than their bytes. Here one launch does it all: every
program computes its tile (a norm's row, or a GELU tile) into registers, stores the tile's max
|v| in its slot, waits at a grid barrier, takes the max over the slots and writes its tile's
cast. The launch is cooperative (CUDA checks that every program is resident at once, which the
barrier needs), so a grid never exceeds the SM count.

Bit for bit what te_func.kernels.norm / cast compute in two launches: the norm's row by the same
`_row_stats` with the same block and warps, the GELU by the same formulas, the scale and the cast
by the same functions.

Each launch has a barrier of its own (an int32 counter, zeroed with its slots by one memset),
so concurrent launches on other streams never meet at it. Under Triton's interpreter, which runs
programs one after another, a launch cannot wait for the others: PHASE 1 then stores the slots
and PHASE 2 recomputes the tiles and casts them (the same results, in two launches).

Imported only by te_func.kernels.dispatch, once Triton is known to import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cast import _FP8, INTERPRETED, SOFT_ROUND, _gelu, _quantize, _round_to, _scale_from_amax
from .norm import _mean_factor, _row_stats, _warps

MAX_TILE = 16384        # elements a program of the GELU keeps in registers


@triton.jit
def _grid_barrier(bar_ptr, nprog):
    """Every program of the launch waits here until all have arrived at the counter (zero before
    the launch). The CTA barriers around the acq_rel atomics order every thread's writes before
    the arrival and every thread's reads after the last arrival, whichever thread issues an atomic."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1)
    while tl.load(bar_ptr, volatile=True) < nprog:     # polled by plain loads: cheaper than atomics
        pass
    tl.atomic_add(bar_ptr, 0)       # the acquire
    tl.debug_barrier()


@triton.jit
def _cast_at_grid_amax(v, tile_max_bits, offs, mask, out_ptr, scale_inv_ptr, slots_ptr, bar_ptr, fp8_max,
                       amax_epsilon, FP8: tl.constexpr, POW2: tl.constexpr, SOFT: tl.constexpr,
                       MANTISSA: tl.constexpr, BIAS: tl.constexpr, SLOTS: tl.constexpr, PHASE: tl.constexpr):
    """This program's tile v (fp32) cast with the scale of the whole tensor's amax: the max over
    every program's `tile_max_bits` (max |v| as int32 bits of an fp32 >= 0, NaN skipped)."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    if PHASE != 2:
        tl.atomic_xchg(slots_ptr + pid, tile_max_bits)   # an atomic: issued before the arrival
    if PHASE == 0:
        _grid_barrier(bar_ptr, nprog)
    if PHASE != 1:
        s = tl.arange(0, SLOTS)
        slots = tl.load(slots_ptr + s, mask=s < nprog, other=0, volatile=True)
        amax = tl.max(slots, axis=0).to(tl.float32, bitcast=True)
        scale = _scale_from_amax(amax, fp8_max, amax_epsilon, POW2)
        if pid == 0:
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0 + tl.zeros_like(scale), scale))  # torch.reciprocal
        tl.store(out_ptr + offs, _quantize(v, scale, fp8_max, FP8, SOFT, MANTISSA, BIAS), mask=mask)


@triton.jit
def _norm_cast_kernel(x_ptr, weight_ptr, beta_ptr, out_ptr, scale_inv_ptr, slots_ptr, bar_ptr, N, inv_n, eps,
                      fp8_max, amax_epsilon, RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_BETA: tl.constexpr,
                      BLOCK_N: tl.constexpr, FP8: tl.constexpr, POW2: tl.constexpr, SOFT: tl.constexpr,
                      MANTISSA: tl.constexpr, BIAS: tl.constexpr, SLOTS: tl.constexpr, PHASE: tl.constexpr):
    """Row pid of x (M, N): the norm's output in x's dtype (as norm._norm_forward_kernel), cast.
    The norm's weight and bias in their own dtypes: gamma = fp32(weight) (+ 1 where zero-centered),
    as te_func.ops.normalization._gamma makes it."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=cmask, other=0.0)
    x_hat, mean, rsigma = _row_stats(x.to(tl.float32), cmask, inv_n, eps, RMS)
    gamma = tl.load(weight_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        gamma = gamma + 1.0
    y = x_hat * gamma
    if HAS_BETA:
        y = y + tl.load(beta_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = _round_to(y, x.dtype)
    tile_max = tl.max(tl.where(cmask & (y == y), tl.abs(y), 0.0).to(tl.int32, bitcast=True), axis=0)
    _cast_at_grid_amax(y, tile_max, row * N + cols, cmask, out_ptr, scale_inv_ptr, slots_ptr, bar_ptr, fp8_max,
                       amax_epsilon, FP8, POW2, SOFT, MANTISSA, BIAS, SLOTS, PHASE)


@triton.jit
def _gelu_cast_kernel(x_ptr, b_ptr, out_ptr, scale_inv_ptr, slots_ptr, bar_ptr, numel, N, fp8_max, amax_epsilon,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr, POW2: tl.constexpr,
                      SOFT: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, SLOTS: tl.constexpr,
                      PHASE: tl.constexpr):
    """Elements [pid * BLOCK, pid * BLOCK + BLOCK) of x (M, N): gelu(x + bias) in x's dtype (as
    cast._activation_kernel), cast."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    a = x.to(tl.float32)
    if HAS_BIAS:
        a = _round_to(a + tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32), x.dtype)
    v = tl.where(mask, _round_to(_gelu(a), x.dtype), 0.0)
    tile_max = tl.max(tl.where(v != v, 0.0, tl.abs(v)).to(tl.int32, bitcast=True), axis=0)
    _cast_at_grid_amax(v, tile_max, offs, mask, out_ptr, scale_inv_ptr, slots_ptr, bar_ptr, fp8_max,
                       amax_epsilon, FP8, POW2, SOFT, MANTISSA, BIAS, SLOTS, PHASE)


def max_programs(device: torch.device) -> int:
    """How many programs a launch may have: one per SM (all resident at once)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def norm_cast(x2d: torch.Tensor, weight: torch.Tensor, beta: torch.Tensor | None, eps: float, rms: bool,
              zero_centered: bool, dtype: torch.dtype, fp8_max: float, amax_epsilon: float, power_2_scale: bool):
    """x (M, N) contiguous, M <= max_programs, the norm's weight / bias (N,) contiguous -> the
    current-scaling cast of norm(x) in x's dtype: (data (M, N) `dtype`, scale_inv () fp32)."""
    m, n = x2d.shape
    block_n = triton.next_power_of_2(n)
    out = torch.empty((m, n), dtype=dtype, device=x2d.device)
    fp8, mantissa, bias = _FP8[dtype]
    scale_inv = torch.empty((), dtype=torch.float32, device=x2d.device)
    slots, barrier = _scratch(m, x2d.device)
    for phase in _phases():
        _norm_cast_kernel[(m,)](
            x2d, weight, weight if beta is None else beta, out.view(torch.uint8), scale_inv, slots, barrier, n,
            _mean_factor(n), eps, fp8_max, amax_epsilon, RMS=rms, ZERO_CENTERED=zero_centered,
            HAS_BETA=beta is not None, BLOCK_N=block_n,
            FP8=fp8, POW2=power_2_scale, SOFT=SOFT_ROUND, MANTISSA=mantissa, BIAS=bias, SLOTS=slots.numel(),
            PHASE=phase, num_warps=_warps(block_n), enable_fp_fusion=False, **_cooperative())
    return out, scale_inv


def gelu_cast(x2d: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype, fp8_max: float, amax_epsilon: float,
              power_2_scale: bool):
    """x (M, N) contiguous, M * N <= max_programs * MAX_TILE, b (N,) of x's dtype or None -> the
    current-scaling cast of gelu(x + b) in x's dtype: (data (M, N) `dtype`, scale_inv () fp32)."""
    m, n = x2d.shape
    numel = m * n
    block = max(1024, triton.next_power_of_2(triton.cdiv(numel, max_programs(x2d.device))))
    grid = triton.cdiv(numel, block)
    out = torch.empty((m, n), dtype=dtype, device=x2d.device)
    fp8, mantissa, bias = _FP8[dtype]
    scale_inv = torch.empty((), dtype=torch.float32, device=x2d.device)
    slots, barrier = _scratch(grid, x2d.device)
    for phase in _phases():
        _gelu_cast_kernel[(grid,)](
            x2d, x2d if b is None else b, out.view(torch.uint8), scale_inv, slots, barrier, numel, n, fp8_max,
            amax_epsilon, HAS_BIAS=b is not None, BLOCK=block, FP8=fp8, POW2=power_2_scale, SOFT=SOFT_ROUND,
            MANTISSA=mantissa, BIAS=bias, SLOTS=slots.numel(), PHASE=phase, num_warps=8, enable_fp_fusion=False,
            **_cooperative())
    return out, scale_inv


def _scratch(programs: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A launch's slots (one per program, power-of-2 many) and its barrier's counter, zero: one
    allocation, one memset. Each launch has its own, so launches on other streams (or other
    replays of other CUDA graphs) never share a barrier."""
    scratch = torch.zeros(1 + triton.next_power_of_2(programs), dtype=torch.int32, device=device)
    return scratch[1:], scratch[:1]


def _phases() -> tuple[int, ...]:
    return (1, 2) if INTERPRETED else (0,)


def _cooperative() -> dict:
    return {} if INTERPRETED else {"launch_cooperative_grid": True}
