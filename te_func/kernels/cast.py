"""Triton kernels of the tensor-wise FP8 cast: amax in one pass, then one pass that
writes the cast and, optionally, its transpose.

Imported only by te_func.kernels.dispatch, and only once Triton is known to import.
Every formula mirrors te_func.quant (scheme.scale_from_amax, tensor._cast) bit for
bit; that torch code is the reference the tests compare against.

Indices are int32: callers keep numel below 2**31 - 2**24.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)   # largest finite fp32
AMAX_BLOCK = 4096
TILE_M, TILE_N = 128, 64      # rows x cols of x per program of the cast
# dtype -> (Triton type, mantissa bits, exponent bias)
_FP8 = {torch.float8_e4m3fn: (tl.float8e4nv, 3, 7), torch.float8_e5m2: (tl.float8e5, 2, 15)}
# Round by integer arithmetic (_round_to_fp8_bits) instead of the hardware conversion:
# always in Triton's interpreter, whose FP8 casts do not round to nearest even.
SOFT_ROUND = os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("TE_FUNC_CAST_SOFT_ROUND") == "1"


@triton.jit
def _amax_kernel(x_ptr, amax_bits_ptr, numel, iters, BLOCK: tl.constexpr):
    # max |x| as the int32 bits of an fp32 >= 0, ordered like the floats; a NaN counts
    # as 0 (te_func.quant.tensor.abs_skipping_nan: TE's fmax skips NaN).
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(iters):        # program p reads blocks p, p + nprog, ...
        offs = (i * nprog + pid) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.where(x != x, 0.0, tl.abs(x)).to(tl.int32, bitcast=True))
    tl.atomic_max(amax_bits_ptr, tl.max(acc, axis=0))


@triton.jit
def _round_to_fp8_bits(v, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """|v| <= fp8_max, not NaN -> the FP8 bits of v rounded to nearest even, as uint8,
    subnormals included; integer arithmetic only, so it is exact on any backend
    (Triton's interpreter rounds FP8 casts differently from the GPU)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exponent = mag >> 23
    # Normal FP8 range: drop 23 - MANTISSA mantissa bits (a carry moves into the exponent).
    drop: tl.constexpr = 23 - MANTISSA
    up = (1 << (drop - 1)) - 1 + ((mag >> drop) & 1)
    normal = ((mag + up) >> drop) - ((127 - BIAS) << MANTISSA)
    # Subnormal FP8 range: count steps of 2**(1 - BIAS - MANTISSA); the count is the encoding.
    significand = (mag & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)
    shift = tl.minimum(150 + (1 - BIAS) - MANTISSA - tl.maximum(exponent, 1), 30)
    shift = tl.maximum(shift, 1)
    kept = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    encoded = tl.where(exponent >= 127 + 1 - BIAS, normal, sub)
    return (sign | encoded).to(tl.uint8)


@triton.jit
def _scale_from_amax(amax, fp8_max, amax_epsilon, POW2: tl.constexpr):
    # te_func.quant.scheme.scale_from_amax: clamp to epsilon (NaN stays NaN), one
    # correctly rounded division, inf -> FLT_MAX, amax 0 / inf / NaN -> 1.
    a = tl.where(amax < amax_epsilon, amax_epsilon, amax)
    scale = tl.math.div_rn(fp8_max + tl.zeros_like(a), a)
    scale = tl.where(scale == float("inf"), FLT_MAX, scale)
    bad = (a == 0) | (a != a) | (a == float("inf"))
    scale = tl.where(bad, 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -(1 << 23)).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _cast_kernel(x_ptr, out_ptr, out_t_ptr, scale_inv_ptr, amax_bits_ptr, scale_ptr, M, N,
                 fp8_max, amax_epsilon, FP8: tl.constexpr, GIVEN_SCALE: tl.constexpr,
                 POW2: tl.constexpr, WRITE_T: tl.constexpr, SOFT_ROUND: tl.constexpr, MANTISSA: tl.constexpr,
                 BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """x (M, N) contiguous -> out (M, N) and, with WRITE_T, out_t (N, M), both FP8 as uint8.

    GIVEN_SCALE (delayed scaling): the scale is read from scale_ptr and this pass also
    records max |x| into amax_bits_ptr. Otherwise the scale comes from the amax there.
    """
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if GIVEN_SCALE:
        scale = tl.load(scale_ptr)
    else:
        scale = _scale_from_amax(tl.load(amax_bits_ptr).to(tl.float32, bitcast=True), fp8_max,
                                 amax_epsilon, POW2)
    if (pid_m == 0) & (pid_n == 0):
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0 + tl.zeros_like(scale), scale))  # torch.reciprocal
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    if GIVEN_SCALE:
        a = tl.where(x != x, 0.0, tl.abs(x))
        tl.atomic_max(amax_bits_ptr, tl.max(tl.max(a.to(tl.int32, bitcast=True), axis=1), axis=0))
    # te_func.quant.tensor._cast: fp32 product, clamp to +-fp8_max, round to nearest
    # even. A NaN product becomes the FP8 NaN 0x7F with its sign, as torch's cast makes it
    # (min/max here would drop the NaN).
    v = x * scale
    clamped = tl.minimum(tl.maximum(v, -fp8_max), fp8_max)
    if SOFT_ROUND:
        q = _round_to_fp8_bits(clamped, MANTISSA, BIAS)
    else:
        q = clamped.to(FP8).to(tl.uint8, bitcast=True)
    sign = ((v.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    q = tl.where(v != v, sign | 0x7F, q)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
    if WRITE_T:
        tl.store(out_t_ptr + rn[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))


def amax_bits(x: torch.Tensor) -> torch.Tensor:
    """max |x| of a contiguous x, as a (1,) int32 tensor holding fp32 bits."""
    bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    blocks = triton.cdiv(x.numel(), AMAX_BLOCK)
    programs = min(blocks, 8 * torch.cuda.get_device_properties(x.device).multi_processor_count) \
        if x.is_cuda else min(blocks, 4)
    _amax_kernel[(programs,)](x, bits, x.numel(), triton.cdiv(blocks, programs), BLOCK=AMAX_BLOCK, num_warps=8)
    return bits


def cast(x2d: torch.Tensor, dtype: torch.dtype, fp8_max: float, amax_epsilon: float, power_2_scale: bool,
         scale: torch.Tensor | None, with_transpose: bool):
    """Tensor-wise FP8 cast of a contiguous (M, N) x: (data (M, N), data_t (N, M) or None,
    scale_inv (), amax bits (1,) int32). `scale` given: delayed scaling (amax recorded
    in the same pass); None: current scaling (amax first, then the scale from it)."""
    m, n = x2d.shape
    bits = torch.zeros(1, dtype=torch.int32, device=x2d.device) if scale is not None else amax_bits(x2d)
    data = torch.empty((m, n), dtype=dtype, device=x2d.device)
    data_t = torch.empty((n, m), dtype=dtype, device=x2d.device) if with_transpose else None
    scale_inv = torch.empty((), dtype=torch.float32, device=x2d.device)
    fp8, mantissa, bias = _FP8[dtype]
    grid = (triton.cdiv(m, TILE_M), triton.cdiv(n, TILE_N))
    _cast_kernel[grid](x2d, data.view(torch.uint8), (data if data_t is None else data_t).view(torch.uint8),
                       scale_inv, bits, bits if scale is None else scale, m, n, fp8_max, amax_epsilon,
                       FP8=fp8, MANTISSA=mantissa, BIAS=bias, SOFT_ROUND=SOFT_ROUND, GIVEN_SCALE=scale is not None,
                       POW2=power_2_scale, WRITE_T=with_transpose, BLOCK_M=TILE_M, BLOCK_N=TILE_N, num_warps=8)
    return data, data_t, scale_inv, bits
