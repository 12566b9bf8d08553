"""Triton kernels of the tensor-wise FP8 cast: amax in one pass, then one pass that writes the
cast and, optionally, its transpose. And the GELU (tanh) or its input gradient with the amax and
column sums (fc1's bias gradient) in the same pass, as TE's fused activation kernels do.

Every formula mirrors te_func.quant and te_func.ops.activations bit for bit; that torch code is
the tests' reference. Indices are int32: callers keep numel below 2**31 - 2**24."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

FLT_MAX = tl.constexpr(3.4028234663852886e38)   # largest finite fp32
AMAX_BLOCK = 4096
TILE_M, TILE_N = 128, 64      # rows x cols of x per program of the cast
ACT_TILE_M, ACT_TILE_N = 32, 128   # ... of the activation (its column sums' order depends on ACT_TILE_M)
# dtype -> (Triton type, mantissa bits, exponent bias)
_FP8 = {torch.float8_e4m3fn: (tl.float8e4nv, 3, 7), torch.float8_e5m2: (tl.float8e5, 2, 15)}
# What `_activation_kernel` computes: gelu(x), or x * gelu'(y) (x the output's gradient, y the input).
ACT_GELU, ACT_DGELU = tl.constexpr(1), tl.constexpr(2)
ACTIVATIONS = {"gelu": ACT_GELU.value, "gelu_backward": ACT_DGELU.value}
# The GELU's constants as torch rounds them to fp32 (3 * 0.044715: a Python product, then rounded).
K_SQRT_2_PI = tl.constexpr(0.7978845834732056)
K_CUBE = tl.constexpr(0.044714998453855515)
K_3CUBE = tl.constexpr(0.13414500653743744)
# Round by integer arithmetic (always in Triton's interpreter, whose FP8 casts do not round to even).
SOFT_ROUND = os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("TE_FUNC_CAST_SOFT_ROUND") == "1"
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _tanh(x):
    if INTERPRETED:     # Triton's interpreter has no libdevice (its results are not bit-exact anyway)
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)
    else:
        return libdevice.tanh(x)     # CUDA's tanhf, which torch's kernels call


@triton.jit
def _gelu(x):
    # te_func.ops.activations._gelu, op for op in fp32 (no FMA contraction, as torch's eager ops).
    t = _tanh(K_SQRT_2_PI * (x + K_CUBE * (x * x * x)))
    return (0.5 * x) * (1.0 + t)


@triton.jit
def _gelu_backward(dy, x):
    # dy * te_func.ops.activations._dgelu(x), op for op in fp32 (no FMA contraction either).
    t = _tanh(K_SQRT_2_PI * (x + K_CUBE * (x * x * x)))
    left = 0.5 * (1.0 + t)
    right = ((0.5 * x) * (1.0 - t * t)) * K_SQRT_2_PI * (1.0 + (K_3CUBE * x) * x)
    return dy * (left + right)


@triton.jit
def _round_to(v, dtype: tl.constexpr):
    """fp32 v rounded to `dtype` (to nearest even), back in fp32."""
    if INTERPRETED and dtype == tl.bfloat16:
        # The interpreter's fp32 -> bf16 conversion truncates: round by the bits.
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    return v.to(dtype).to(tl.float32)


@triton.jit
def _activation_kernel(x_ptr, y_ptr, b_ptr, v_ptr, amax_bits_ptr, colsum_ptr, M, N, ACT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, COLSUM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, PARTIALS: tl.constexpr = False):
    """v = gelu(x) (ACT_GELU) or x * gelu'(y) (ACT_DGELU), (M, N) contiguous, in x's dtype, with max |v|
    into amax_bits_ptr (PARTIALS: each tile's, at pid_m * programs along N + pid_n), COLSUM: each
    tile's column sums (fp32) in row pid_m of colsum_ptr; HAS_BIAS: the bias (N,) first added to
    the GELU's input, rounded as torch's `+`."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    act_in = x if ACT == ACT_GELU else tl.load(y_ptr + offs, mask=mask, other=0.0)
    act_in = act_in.to(tl.float32)
    if HAS_BIAS:
        act_in = _round_to(act_in + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :], x.dtype)
    if ACT == ACT_GELU:
        v = _gelu(act_in)
    else:
        v = _gelu_backward(x.to(tl.float32), act_in)
    v = tl.where(mask, _round_to(v, x.dtype), 0.0)     # masked off: out of the amax and the sums
    tl.store(v_ptr + offs, v.to(x.dtype), mask=mask)
    a = tl.where(v != v, 0.0, tl.abs(v))
    if PARTIALS:
        tl.store(amax_bits_ptr + pid_m * tl.num_programs(1) + pid_n, tl.max(tl.max(a, axis=1), axis=0))
    else:
        tl.atomic_max(amax_bits_ptr, tl.max(tl.max(a.to(tl.int32, bitcast=True), axis=1), axis=0))
    if COLSUM:
        tl.store(colsum_ptr + pid_m * N + rn, tl.sum(v, axis=0), mask=rn < N)


@triton.jit
def _amax_kernel(x_ptr, amax_bits_ptr, numel, iters, BLOCK: tl.constexpr):
    # max |x| as the int32 bits of an fp32 >= 0, ordered like the floats; NaN counts as 0 (TE's fmax).
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(iters):        # program p reads blocks p, p + nprog, ...
        offs = (i * nprog + pid) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.where(x != x, 0.0, tl.abs(x)).to(tl.int32, bitcast=True))
    tl.atomic_max(amax_bits_ptr, tl.max(acc, axis=0))


@triton.jit
def _round_to_fp8_bits(v, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """|v| <= fp8_max, not NaN -> v's FP8 bits rounded to nearest even, by integer arithmetic."""
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
    # scale_from_amax: clamp to epsilon, one rounded division, inf -> FLT_MAX, amax 0 / inf / NaN -> 1.
    a = tl.where(amax < amax_epsilon, amax_epsilon, amax)
    scale = tl.math.div_rn(fp8_max + tl.zeros_like(a), a)
    scale = tl.where(scale == float("inf"), FLT_MAX, scale)
    bad = (a == 0) | (a != a) | (a == float("inf"))
    scale = tl.where(bad, 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -(1 << 23)).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _fp8_bits(x, scale, fp8_max, FP8: tl.constexpr, SOFT_ROUND: tl.constexpr, MANTISSA: tl.constexpr,
              BIAS: tl.constexpr):
    """te_func.quant.tensor._cast of fp32 x with `scale`, as FP8 bits (a NaN as torch's cast makes it)."""
    v = x * scale
    clamped = tl.minimum(tl.maximum(v, -fp8_max), fp8_max)
    if SOFT_ROUND:
        q = _round_to_fp8_bits(clamped, MANTISSA, BIAS)
    else:
        q = clamped.to(FP8).to(tl.uint8, bitcast=True)
    sign = ((v.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    return tl.where(v != v, sign | 0x7F, q)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, out_t_ptr, scale_inv_ptr, amax_bits_ptr, scale_ptr, M, N,
                 fp8_max, amax_epsilon, FP8: tl.constexpr, GIVEN_SCALE: tl.constexpr,
                 POW2: tl.constexpr, WRITE_T: tl.constexpr, SOFT_ROUND: tl.constexpr, MANTISSA: tl.constexpr,
                 BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """x (M, N) contiguous -> out (M, N) and, with WRITE_T, out_t (N, M), FP8 as uint8. GIVEN_SCALE
    (delayed): the scale from scale_ptr, and max |x| recorded into amax_bits_ptr; else the scale
    comes from the amax there."""
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
    q = _fp8_bits(x, scale, fp8_max, FP8, SOFT_ROUND, MANTISSA, BIAS)
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
         scale: torch.Tensor | None, with_transpose: bool, amax: torch.Tensor | None = None):
    """Tensor-wise FP8 cast of a contiguous (M, N) x: (data, data_t or None, scale_inv (), amax bits
    (1,) int32). `scale`: delayed (the amax recorded in the same pass); None: current scaling."""
    m, n = x2d.shape
    if scale is not None:
        bits = torch.zeros(1, dtype=torch.int32, device=x2d.device) if amax is None else amax
    else:
        bits = amax_bits(x2d) if amax is None else amax
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


def activation(x2d: torch.Tensor, y2d: torch.Tensor | None, act: str, column_sums: bool,
               bias: torch.Tensor | None = None):
    """The activation `act` of a contiguous (M, N) x (plus bias): (v, max |v| bits, column sums or None)."""
    m, n = x2d.shape
    v = torch.empty_like(x2d)
    bits = torch.zeros(1, dtype=torch.int32, device=x2d.device)
    grid = (triton.cdiv(m, ACT_TILE_M), triton.cdiv(n, ACT_TILE_N))
    partial = torch.empty((grid[0], n), dtype=torch.float32, device=x2d.device) if column_sums else bits
    _activation_kernel[grid](x2d, x2d if y2d is None else y2d, x2d if bias is None else bias, v, bits, partial, m,
                             n, ACT=ACTIVATIONS[act], HAS_BIAS=bias is not None, COLSUM=column_sums,
                             BLOCK_M=ACT_TILE_M, BLOCK_N=ACT_TILE_N, num_warps=4, enable_fp_fusion=False)
    return v, bits, partial.sum(0) if column_sums else None


# --- the casts a compiled graph calls -----------------------------------------------------------
# Under torch.compile a small x is written with the max |x| of each of its pieces by the pass that
# makes it (a norm's rows, or `gelu_partials`' tiles); `cast_from_partials` reduces those in every
# program and casts its tile: two launches, where inductor's chain takes three.
# Tiles of 1024 elements, 8 per thread: at a decode step's sizes, as many programs as SMs or more.
PARTIALS_TILE_M, PARTIALS_TILE_N, PARTIALS_BLOCK = 16, 64, 1024
GELU_PARTIALS_TILE_M, GELU_PARTIALS_TILE_N = 16, 64
# A large x (`large=True`, a prefill's): the GELU kernel takes one max of all of v by an atomic,
# and the cast reads it; inductor would compute the tanh-bound GELU twice (docs/benchmarks.md).
LARGE_GELU_TILE_M, LARGE_GELU_TILE_N = 32, 64
LARGE_CAST_TILE_M, LARGE_CAST_TILE_N = 32, 128


@triton.jit
def _partials_cast_kernel(x_ptr, out_ptr, scale_inv_ptr, partials_ptr, n_partials, M, N, fp8_max, amax_epsilon,
                          FP8: tl.constexpr, POW2: tl.constexpr, SOFT_ROUND: tl.constexpr, MANTISSA: tl.constexpr,
                          BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """x (M, N) contiguous -> out (M, N) FP8, its scale from the max of partials (n_partials,) fp32."""
    # fp32, as the eager launch passes Python floats (a compiled graph passes them as fp64).
    fp8_max, amax_epsilon = tl.cast(fp8_max, tl.float32), tl.cast(amax_epsilon, tl.float32)
    # The tile's load first: it does not wait for the partial maxes.
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        offs = start + tl.arange(0, BLOCK_P)
        acc = tl.maximum(acc, tl.load(partials_ptr + offs, mask=offs < n_partials, other=0.0))
    scale = _scale_from_amax(tl.max(acc, axis=0), fp8_max, amax_epsilon, POW2)
    if (pid_m == 0) & (pid_n == 0):
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0 + tl.zeros_like(scale), scale))  # torch.reciprocal
    q = _fp8_bits(x, scale, fp8_max, FP8, SOFT_ROUND, MANTISSA, BIAS)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], q.to(out_ptr.dtype.element_ty, bitcast=True), mask=mask)


@torch.library.triton_op("te_func::cast_from_partials", mutates_args=())
def cast_from_partials(x2d: torch.Tensor, partials: torch.Tensor, dtype: torch.dtype, fp8_max: float,
                       amax_epsilon: float, power_2_scale: bool,
                       large: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling's cast of a contiguous (M, N) x whose amax is the max of `partials`: (data,
    scale_inv (1,)). `large`: larger tiles, the same bits. A Triton op, compiled into the graph."""
    m, n = x2d.shape
    data = torch.empty((m, n), dtype=dtype, device=x2d.device)
    # (1,), not (): inductor copied a 0-d output of the kernel into a new buffer, one launch more.
    scale_inv = torch.empty((1,), dtype=torch.float32, device=x2d.device)
    fp8, mantissa, bias = _FP8[dtype]
    tile_m, tile_n = (LARGE_CAST_TILE_M, LARGE_CAST_TILE_N) if large else (PARTIALS_TILE_M, PARTIALS_TILE_N)
    grid = (triton.cdiv(m, tile_m), triton.cdiv(n, tile_n))
    torch.library.wrap_triton(_partials_cast_kernel)[grid](
        x2d, data, scale_inv, partials, partials.numel(), m, n, fp8_max, amax_epsilon, FP8=fp8, POW2=power_2_scale,
        SOFT_ROUND=SOFT_ROUND, MANTISSA=mantissa, BIAS=bias, BLOCK_M=tile_m, BLOCK_N=tile_n,
        BLOCK_P=PARTIALS_BLOCK, num_warps=4)
    return data, scale_inv


def _per_sample(op, info, in_dims, *args):
    """A vmap rule for the ops below: the op on each sample (one amax each, as the torch path)."""
    outs = [op(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims))) for i in range(info.batch_size)]
    return tuple(torch.stack(parts) for parts in zip(*outs)), (0, 0)


cast_from_partials.register_vmap(lambda info, in_dims, *args: _per_sample(cast_from_partials, info, in_dims, *args))


@torch.library.triton_op("te_func::gelu_partials", mutates_args=())
def gelu_partials(x2d: torch.Tensor, bias: torch.Tensor | None,
                  large: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`activation`'s GELU of a contiguous (M, N) x (plus `bias`) for a compiled graph: (v; the max |v|
    of each tile (P,) fp32, or with `large` one max (1,)). Under inductor the kernel contracts
    multiply-adds as inductor's own GELU does, so v agrees with the eager bits to fp32 rounding."""
    m, n = x2d.shape
    v = torch.empty_like(x2d)
    tile_m, tile_n = (LARGE_GELU_TILE_M, LARGE_GELU_TILE_N) if large else (GELU_PARTIALS_TILE_M, GELU_PARTIALS_TILE_N)
    grid = (triton.cdiv(m, tile_m), triton.cdiv(n, tile_n))
    # Large: an atomic max on one word's bits (fp32 >= 0 orders as int32), which starts at 0.
    partials = torch.zeros((1,), dtype=torch.int32, device=x2d.device) if large else \
        torch.empty((grid[0] * grid[1],), dtype=torch.float32, device=x2d.device)
    # Unused pointers get x, which is only read: a graph must not see the written `partials` twice.
    torch.library.wrap_triton(_activation_kernel)[grid](
        x2d, x2d, x2d if bias is None else bias, v, partials, x2d, m, n, ACT=ACT_GELU.value,
        HAS_BIAS=bias is not None, COLSUM=False, BLOCK_M=tile_m, BLOCK_N=tile_n,
        PARTIALS=not large, num_warps=4, enable_fp_fusion=False)      # (honored eagerly)
    return v, partials.view(torch.float32) if large else partials


gelu_partials.register_vmap(lambda info, in_dims, *args: _per_sample(gelu_partials, info, in_dims, *args))
