"""te_func.quant checked bit for bit against an independent numpy reference.

The reference at the top of this file is written from the format and recipe
definitions (TransformerEngine's semantics, see DESIGN.md), not from te_func's
code: the FP8 value tables come from the bit layout, rounding is done by table
look-up in float64, and scales are computed in numpy float32 so that every
result can be compared exactly. Nothing in the reference calls te_func or
torch's float8 cast; torch is only used to *read* the library's fp8 output.

"""
from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from te_func.quant import (CAST_FIELDS, DelayedState, Quantizer, dequantize, e8m0_scale_inv, e8m0_to_float,
                           quantize, quantize_weight, quantize_with_transpose, round_down_pow2,
                           scale_from_amax, scheme_for)
from te_func.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                            MXFP8BlockScaling, QParams)

workspace_module = importlib.import_module("te_func.quant.workspace")

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
FLT_TINY = np.finfo(np.float32).tiny        # smallest normal fp32, 2**-126
ROLES = ("input", "weight", "grad")


# =============================================================================
# Reference: FP8 formats
# =============================================================================

@dataclass(frozen=True)
class Fp8Format:
    """Sign bit, `ebits` exponent bits, `mbits` mantissa bits, exponent `bias`.

    Finite values: 2**(e - bias) * (1 + m / 2**mbits) for e > 0, subnormals
    2**(1 - bias) * m / 2**mbits for e = 0. Codes whose value would exceed `max`
    are NaN (E4M3: only 0x7F / 0xFF; no inf) or inf/NaN (E5M2: e = 31).
    """
    name: str
    ebits: int
    mbits: int
    bias: int
    max: float
    nan_code: int               # one NaN encoding, used by the reference only
    torch_dtype: torch.dtype    # what te_func should store; never used to compute

    def __repr__(self):
        return self.name


E4M3 = Fp8Format("E4M3", ebits=4, mbits=3, bias=7, max=448.0, nan_code=0x7F,
                 torch_dtype=torch.float8_e4m3fn)
E5M2 = Fp8Format("E5M2", ebits=5, mbits=2, bias=15, max=57344.0, nan_code=0x7F,
                 torch_dtype=torch.float8_e5m2)


def fp8_table(fmt: Fp8Format) -> np.ndarray:
    """All finite non-negative values of `fmt`, in code order (code = e << mbits | m).

    The encoding is monotonic, so the table is sorted and table[c] is the value of
    code c; c's parity is its mantissa's parity (used for ties to even).
    """
    values = []
    for e in range(2 ** fmt.ebits):
        for m in range(2 ** fmt.mbits):
            frac = m / 2 ** fmt.mbits
            values.append(2.0 ** (1 - fmt.bias) * frac if e == 0 else 2.0 ** (e - fmt.bias) * (1 + frac))
    values = np.array(values, dtype=np.float64)
    return values[values <= fmt.max]


TABLES = {fmt: fp8_table(fmt) for fmt in (E4M3, E5M2)}


def round_fp8(v, fmt: Fp8Format) -> np.ndarray:
    """FP8 codes (uint8) of `v` (any float array; compared as float64).

    Nearest table value, ties to the even mantissa; |v| > max (including inf)
    saturates to +-max; the sign bit is kept (so -0 is 0x80); NaN -> fmt.nan_code.
    """
    v = np.asarray(v, dtype=np.float64)
    table = TABLES[fmt]
    nan = np.isnan(v)
    a = np.where(nan, 0.0, np.minimum(np.abs(v), fmt.max))
    hi = np.searchsorted(table, a, side="left")            # table[hi] >= a
    lo = np.maximum(hi - 1, 0)
    below, above = a - table[lo], table[hi] - a           # exact in float64
    idx = np.where((above < below) | ((above == below) & (hi % 2 == 0)), hi, lo)
    codes = idx | (np.signbit(v).astype(np.int64) << 7)
    return np.where(nan, fmt.nan_code, codes).astype(np.uint8)


def decode_fp8(codes, fmt: Fp8Format) -> np.ndarray:
    """float64 value of each code: +-table[code & 0x7F]; NaN for codes beyond the table
    (NaNs, and E5M2's infs, which a saturating cast must never produce)."""
    codes = np.asarray(codes, dtype=np.int64)
    table = TABLES[fmt]
    mag = codes & 0x7F
    val = np.where(mag < len(table), table[np.minimum(mag, len(table) - 1)], np.nan)
    return np.where(codes & 0x80, -val, val)


# =============================================================================
# Reference: scales (numpy float32 arithmetic, as the library's fp32)
# =============================================================================

def ref_round_down_pow2(s) -> np.ndarray:
    """Largest power of two <= s (s positive normal fp32): s = f * 2**e, f in [0.5, 1) -> 2**(e-1)."""
    _, e = np.frexp(np.asarray(s, dtype=F32))
    return np.ldexp(F32(1), e - 1).astype(F32)


def ref_current_scale(amax, fp8_max: float, eps: float = 0.0, pow2: bool = False) -> np.ndarray:
    """Current scaling (TE compute_scale_from_amax): a = max(amax, eps) (NaN stays NaN);
    scale = fl32(fp8_max / a); the largest finite fp32 if that quotient is inf;
    1 where a is 0, inf or NaN; rounded down to a power of 2 if pow2."""
    amax = np.asarray(amax, dtype=F32)
    a = np.where(amax < F32(eps), F32(eps), amax)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = F32(fp8_max) / a
    s = np.where(np.isinf(s), FLT_MAX, s)
    s = np.where((a == 0) | ~np.isfinite(a), F32(1), s).astype(F32)
    return ref_round_down_pow2(s) if pow2 else s


def ref_e8m0(amax, fp8_max: float) -> tuple[np.ndarray, np.ndarray]:
    """MXFP8: ratio = fl32(amax * fl32(1/fp8_max)); scale_inv = 2**k, k the smallest integer
    with 2**k >= ratio, clamped to [-127, 127] (ratio 0 -> 2**-127, inf -> 2**127).
    Returns (E8M0 byte = k + 127, 0xFF for NaN; scale_inv as float32, NaN for NaN)."""
    amax = np.asarray(amax, dtype=F32)
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = amax * (F32(1) / F32(fp8_max))
    frac, e = np.frexp(ratio)                      # ratio = frac * 2**e, frac in [0.5, 1)
    k = np.where(frac == 0.5, e - 1, e)            # exact powers of two stay
    k = np.where(ratio == 0, -127, k)
    k = np.where(np.isinf(ratio), 127, k)
    k = np.clip(k, -127, 127)
    nan = np.isnan(ratio)
    bits = np.where(nan, 255, k + 127).astype(np.uint8)
    scale_inv = np.where(nan, np.nan, np.ldexp(F32(1), k)).astype(F32)
    return bits, scale_inv


# =============================================================================
# Reference: what each recipe does to each role (read from the recipe's fields)
# =============================================================================

@dataclass(frozen=True)
class RefConfig:
    fmt: Fp8Format
    block: tuple[int, int] | None        # None: one scale for the tensor
    rule: str                            # "current", "e8m0" or "fixed"
    eps: float = 0.0
    pow2: bool = False
    fixed_scale: float | None = None     # rule "fixed" (delayed scaling's given scale)


def ref_format(recipe, role) -> Fp8Format:
    """E4M3 everywhere, E5M2 everywhere, or HYBRID: E5M2 for gradients only."""
    f = recipe.fp8_format
    return E5M2 if f is Format.E5M2 or (f is Format.HYBRID and role == "grad") else E4M3


def ref_config(recipe, role) -> RefConfig:
    fmt = ref_format(recipe, role)
    if isinstance(recipe, MXFP8BlockScaling):
        # enable_2d_quantization: one E8M0 scale per 32x32 block of a weight
        return RefConfig(fmt, (32, 32) if role == "weight" and recipe.enable_2d_quantization else (1, 32), "e8m0")
    qp = {"input": recipe.fp8_quant_fwd_inp, "weight": recipe.fp8_quant_fwd_weight,
          "grad": recipe.fp8_quant_bwd_grad}[role]
    if isinstance(recipe, Float8CurrentScaling):
        # use_power_2_scales: power-of-2 scales for every role
        return RefConfig(fmt, None, "current", qp.amax_epsilon, qp.power_2_scale or recipe.use_power_2_scales)
    if isinstance(recipe, Float8BlockScaling):
        dim = {"input": recipe.x_block_scaling_dim, "weight": recipe.w_block_scaling_dim,
               "grad": recipe.grad_block_scaling_dim}[role]
        # use_f32_scales: no rounding to powers of 2 for any role
        return RefConfig(fmt, (1, 128) if dim == 1 else (128, 128), "current",
                         qp.amax_epsilon, qp.power_2_scale and not recipe.use_f32_scales)
    raise TypeError(recipe)


@dataclass
class RefQ:
    codes: np.ndarray           # uint8 FP8 codes, the input's shape
    scale_inv: np.ndarray       # float32, () or (row_blocks, col_blocks)
    scale_bits: np.ndarray | None = None   # E8M0 bytes (rule "e8m0")


def block_amax(x: np.ndarray, block) -> np.ndarray:
    """max |x| over each (br, bc) block; edge blocks are partial (zero padding: no effect)."""
    (rows, cols), (br, bc) = x.shape, block
    padded = np.zeros((-(-rows // br) * br, -(-cols // bc) * bc), dtype=F32)
    padded[:rows, :cols] = x
    r, c = padded.shape[0] // br, padded.shape[1] // bc
    # TE takes amaxes with fmax from 0: NaN elements are skipped
    return np.fmax.reduce(np.abs(padded.reshape(r, br, c, bc)), axis=(1, 3), initial=F32(0))


def expand(per_block: np.ndarray, block, shape) -> np.ndarray:
    """One value per block -> one per element."""
    return np.repeat(np.repeat(per_block, block[0], 0), block[1], 1)[:shape[0], :shape[1]]


def ref_scales(x, cfg: RefConfig):
    """(scale, scale_inv, E8M0 bytes or None), one per tensor (shape ()) or per block.

    current: scale from the block's amax, scale_inv = fl32(1 / scale); fixed: the given
    scale; e8m0: scale_inv = 2**k from the amax, scale = 2**-k (exact)."""
    x = np.asarray(x, dtype=F32)
    amax = np.fmax.reduce(np.abs(x), axis=None, initial=F32(0)) if cfg.block is None else block_amax(x, cfg.block)
    if cfg.rule == "e8m0":
        bits, scale_inv = ref_e8m0(amax, cfg.fmt.max)
        with np.errstate(divide="ignore", invalid="ignore"):
            return (F32(1) / scale_inv).astype(F32), scale_inv, bits
    if cfg.rule == "fixed":
        scale = np.asarray(cfg.fixed_scale, dtype=F32)
    else:
        scale = ref_current_scale(amax, cfg.fmt.max, cfg.eps, cfg.pow2)
    return scale, np.asarray(F32(1) / scale, dtype=F32), None


def ref_cast(x, scale, cfg: RefConfig) -> np.ndarray:
    """FP8 codes of round_fp8(clamp(fl32(x * scale of x's block), +-max))."""
    x = np.asarray(x, dtype=F32)
    per_elem = scale if cfg.block is None else expand(scale, cfg.block, x.shape)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        v = (x * per_elem).astype(F32)
    return round_fp8(np.clip(v, -cfg.fmt.max, cfg.fmt.max), cfg.fmt)


def ref_quantize(x, cfg: RefConfig) -> RefQ:
    scale, scale_inv, bits = ref_scales(x, cfg)
    return RefQ(ref_cast(x, scale, cfg), scale_inv, bits)


def block_all(mask: np.ndarray, block) -> np.ndarray:
    """Per block (or for the whole tensor): are all of its elements True?"""
    if block is None:
        return np.asarray(mask.all())
    (rows, cols), (br, bc) = mask.shape, block
    padded = np.ones((-(-rows // br) * br, -(-cols // bc) * bc), dtype=bool)
    padded[:rows, :cols] = mask
    return padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc).all(axis=(1, 3))


# =============================================================================
# Comparing the library's output with the reference
# =============================================================================

def _first(mask, *arrays, n=5):
    idx = np.argwhere(mask)[:n]
    return "; ".join(f"at {tuple(int(i) for i in ix)}: " + ", ".join(f"{a[tuple(ix)]!r}" for a in arrays)
                     for ix in idx)


def assert_fp8_equal(data: torch.Tensor, ref_codes: np.ndarray, fmt: Fp8Format, x=None):
    """Same dtype and shape; same NaN positions; identical codes and float64 values elsewhere."""
    assert data.dtype == fmt.torch_dtype, (data.dtype, fmt)
    assert tuple(data.shape) == ref_codes.shape
    got_codes = data.view(torch.uint8).numpy()
    got_values = data.double().numpy()                   # reading fp8 is allowed
    ref_values = decode_fp8(ref_codes, fmt)
    got_nan, ref_nan = np.isnan(got_values), np.isnan(ref_values)
    assert np.array_equal(got_nan, ref_nan), "NaN positions differ: " + _first(
        got_nan != ref_nan, got_values, ref_values)
    # The table must agree with torch's reading of the code (checks both sides).
    assert np.array_equal(decode_fp8(got_codes, fmt)[~got_nan], got_values[~got_nan])
    bad = (got_codes != ref_codes) & ~ref_nan
    x = np.zeros(ref_codes.shape) if x is None else np.asarray(x)
    assert not bad.any(), f"{int(bad.sum())} fp8 codes differ (x, got, expected): " + _first(
        bad, x, got_values, ref_values)


def assert_scale_inv_equal(scale_inv: torch.Tensor, ref: RefQ, cfg: RefConfig):
    assert tuple(scale_inv.shape) == ref.scale_inv.shape, (tuple(scale_inv.shape), ref.scale_inv.shape)
    if cfg.rule == "e8m0":
        assert scale_inv.dtype == torch.uint8           # E8M0 bytes, as TE keeps them
        got = scale_inv.numpy()
        bad = got != ref.scale_bits
        assert not bad.any(), "E8M0 bytes (got, expected): " + _first(bad, got, ref.scale_bits)
        return
    assert scale_inv.dtype == torch.float32
    got = scale_inv.numpy().astype(F32).view(np.int32).astype(np.int64)
    want = ref.scale_inv.view(np.int32).astype(np.int64)
    bad = got != want
    assert not bad.any(), "scale_inv (got, expected): " + _first(
        bad, scale_inv.numpy(), ref.scale_inv)


def assert_quantized(q, x32: np.ndarray, cfg: RefConfig):
    """`q` (te_func Quantized) equals the reference quantization of x32 under cfg."""
    ref = ref_quantize(x32, cfg)
    assert q.block == cfg.block
    assert_scale_inv_equal(q.scale_inv, ref, cfg)
    assert_fp8_equal(q.data, ref.codes, cfg.fmt, x32)


def scale_inv_values(scale_inv: torch.Tensor) -> np.ndarray:
    """fp32 values of a scale_inv; E8M0 bytes (uint8) decoded from the format's definition:
    2**(byte - 127), NaN for 0xFF."""
    if scale_inv.dtype != torch.uint8:
        return scale_inv.float().numpy()
    b = scale_inv.numpy().astype(np.int64)
    return np.where(b == 255, np.nan, np.ldexp(1.0, b - 127)).astype(F32)


def ref_dequantize(q, fmt: Fp8Format) -> np.ndarray:
    """fl32(value(data) * scale_inv of its block), from q's own bits."""
    values = decode_fp8(q.data.view(torch.uint8).numpy(), fmt).astype(F32)
    scale_inv = scale_inv_values(q.scale_inv)
    if q.block is not None:
        scale_inv = expand(scale_inv, q.block, values.shape)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        return (values * scale_inv).astype(F32)


def assert_same_f32(got: torch.Tensor, want: np.ndarray):
    """Bitwise-equal float32 arrays (any NaN equals any NaN)."""
    got = got.numpy()
    assert got.dtype == np.float32 and got.shape == want.shape
    same = (got.view(np.int32) == want.view(np.int32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), "(got, expected): " + _first(~same, got, want)


# =============================================================================
# Recipes, roles and inputs under test
# =============================================================================

CURRENT_P2_EPS = QParams(power_2_scale=True, amax_epsilon=1e-4)
BLOCK_NOP2_EPS = QParams(power_2_scale=False, amax_epsilon=1e-2)

RECIPES = {
    "current-hybrid": Float8CurrentScaling(),                     # E4M3 fwd, E5M2 grad
    "current-hybrid-all-pow2": Float8CurrentScaling(use_power_2_scales=True),   # E5M2 grads, pow2 everywhere
    "current-e4m3-pow2-eps": Float8CurrentScaling(fp8_format=Format.E4M3, fp8_quant_fwd_inp=CURRENT_P2_EPS,
                                                  fp8_quant_fwd_weight=CURRENT_P2_EPS,
                                                  fp8_quant_bwd_grad=CURRENT_P2_EPS),
    "mxfp8-e4m3": MXFP8BlockScaling(),
    "mxfp8-hybrid": MXFP8BlockScaling(fp8_format=Format.HYBRID),
    "block-e4m3": Float8BlockScaling(),                           # pow2 scales by default
    "block-hybrid-nopow2-eps": Float8BlockScaling(fp8_format=Format.HYBRID, fp8_quant_fwd_inp=BLOCK_NOP2_EPS,
                                                  fp8_quant_fwd_weight=BLOCK_NOP2_EPS,
                                                  fp8_quant_bwd_grad=BLOCK_NOP2_EPS),
    "block-f32-scales": Float8BlockScaling(use_f32_scales=True),
    "mxfp8-2d-weights": MXFP8BlockScaling(enable_2d_quantization=True),
}
RECIPE_ROLES = [pytest.param(name, role, id=f"{name}-{role}")
                for name, role in itertools.product(RECIPES, ROLES)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

ODD_SHAPES = [(r, c) for r in (1, 3, 129) for c in (1, 17, 33, 127, 129, 300)]


def random_matrix(rows, cols, dtype=torch.float32) -> torch.Tensor:
    """randn times 10**U(-3, 3) per row and 10**U(-1, 1) per column (|x| < ~6e4: fits fp16)."""
    row_mag = 10 ** (torch.rand(rows, 1, dtype=torch.float64) * 6 - 3)
    col_mag = 10 ** (torch.rand(1, cols, dtype=torch.float64) * 2 - 1)
    return (torch.randn(rows, cols, dtype=torch.float64) * row_mag * col_mag).to(dtype)


def as_f32(x: torch.Tensor) -> np.ndarray:
    """The input as the library sees it: exactly converted to float32."""
    return x.float().numpy()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The tensors here are small: more intra-op threads only contend (badly, on a busy
    2-core CI runner with 2 xdist workers). Restored for the other test modules."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# =============================================================================
# The reference checks itself
# =============================================================================

@pytest.mark.parametrize("fmt, count, smallest, largest_normal_exp", [
    (E4M3, 127, 2.0 ** -9, 8), (E5M2, 124, 2.0 ** -16, 15)])
def test_reference_table_matches_the_format_definition(fmt, count, smallest, largest_normal_exp):
    table = TABLES[fmt]
    assert len(table) == count and table[0] == 0 and table[1] == smallest
    assert table[-1] == fmt.max and np.all(np.diff(table) > 0)
    assert np.floor(np.log2(table[-1])) == largest_normal_exp
    # Reading every finite code through torch gives the same values.
    codes = torch.arange(count, dtype=torch.uint8)
    for sign in (0, 0x80):
        got = (codes | sign).view(fmt.torch_dtype).double().numpy()
        assert np.array_equal(got, decode_fp8((codes | sign).numpy(), fmt))


@pytest.mark.parametrize("fmt, v, want", [
    (E4M3, 1 + 1 / 16, 1.0),            # tie between 1 and 1.125: even mantissa (1.0)
    (E4M3, 1 + 3 / 16, 1.25),           # tie between 1.125 and 1.25: 1.25
    (E4M3, 2.0 ** -10, 0.0),            # half the smallest subnormal: ties to 0
    (E4M3, 3 * 2.0 ** -10, 2 * 2.0 ** -9),   # tie between subnormals 1 and 2 (x 2**-9): 2
    (E4M3, 464.0, 448.0),               # saturate, not NaN
    (E4M3, float("inf"), 448.0),
    (E4M3, -1e30, -448.0),
    (E5M2, 1 + 1 / 8, 1.0),
    (E5M2, 1 + 3 / 8, 1.5),
    (E5M2, 61440.0, 57344.0),
    (E5M2, float("-inf"), -57344.0),
    (E5M2, 2.0 ** -17 * 1.0000001, 2.0 ** -16),
])
def test_reference_rounding_hand_checked(fmt, v, want):
    assert decode_fp8(round_fp8(v, fmt), fmt) == want


# =============================================================================
# Scale helpers on hand-picked edge values
# =============================================================================

_below = lambda p: np.nextafter(F32(p), F32(0))      # noqa: E731  largest fp32 below p
_above = lambda p: np.nextafter(F32(p), F32(np.inf))  # noqa: E731


@pytest.mark.parametrize("s", [
    1.0, 2.0, 0.5, 2.0 ** 127, 2.0 ** -126, _below(2), _below(1), _below(2.0 ** -125), _above(1),
    3.0, 448 / 3, 57344.0, 448.0, FLT_MAX, 1.5 * 2.0 ** -126, 1e30, 1e-30])
def test_round_down_pow2_gives_largest_power_of_two_not_above(s):
    got = round_down_pow2(torch.tensor([s], dtype=torch.float32)).numpy()
    assert got.dtype == np.float32
    assert got.view(np.int32)[0] == ref_round_down_pow2([s]).view(np.int32)[0], (s, got)


_nan, _inf = float("nan"), float("inf")


def _amax_case(amax, fp8_max=448.0, eps=0.0, pow2=False):
    return pytest.param(amax, fp8_max, eps, pow2,
                        id=f"amax={amax!r}-max={fp8_max:g}-eps={eps:g}-{'pow2' if pow2 else 'exact'}")


@pytest.mark.parametrize("amax, fp8_max, eps, pow2", [
    _amax_case(1.0), _amax_case(2.0 ** 10), _amax_case(448.0), _amax_case(0.5, 57344.0),
    _amax_case(_below(2)), _amax_case(_below(2), pow2=True), _amax_case(_below(448), pow2=True),
    _amax_case(_above(448), pow2=True), _amax_case(_above(448)), _amax_case(_below(448)),
    _amax_case(3.0), _amax_case(3.0, 57344.0), _amax_case(0.1),
    _amax_case(0.0), _amax_case(_inf), _amax_case(_nan), _amax_case(0.0, pow2=True),
    _amax_case(_inf, pow2=True), _amax_case(_nan, pow2=True),
    _amax_case(1e-40), _amax_case(1e-45), _amax_case(1e-40, pow2=True),   # denormal: max finite
    _amax_case(1e-37), _amax_case(1e-37, 57344.0, pow2=True),            # normal, quotient overflows
    _amax_case(float(FLT_MAX)), _amax_case(float(FLT_MAX), pow2=True),
    # amax = fp8_max * 2**j, j >= 118: the quotient is exactly 2**-j, reciprocal(amax) is denormal
    _amax_case(448 * 2.0 ** 119, pow2=True), _amax_case(448 * 2.0 ** 118, pow2=True),
    _amax_case(57344 * 2.0 ** 112, 57344.0, pow2=True), _amax_case(448 * 2.0 ** 117, pow2=True),
    _amax_case(1e-5, eps=1e-3), _amax_case(1e-5, eps=2.0 ** -10, pow2=True),
    _amax_case(0.0, eps=2.0 ** -10),      # eps first (as TE): 0 -> eps, scale = max / eps
    _amax_case(0.0, eps=1e-3, pow2=True), _amax_case(_nan, eps=1e-3), _amax_case(_inf, eps=1e-3),
    _amax_case(1e-40, eps=1e-3), _amax_case(5.0, eps=1e-3),
])
def test_scale_from_amax_edge_values(amax, fp8_max, eps, pow2):
    got = scale_from_amax(torch.tensor(amax, dtype=torch.float32), fp8_max, eps, pow2).numpy()
    want = ref_current_scale(F32(amax), fp8_max, eps, pow2)
    assert got.dtype == np.float32
    assert got.view(np.int32) == want.view(np.int32), (amax, got, want)


@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
def test_scale_from_amax_is_the_correctly_rounded_quotient(fp8_max):
    amax = (torch.rand(4096, dtype=torch.float64) * 4 * 10 ** (torch.rand(4096) * 60 - 30)).float()
    got = scale_from_amax(amax, fp8_max).numpy()
    want = ref_current_scale(amax.numpy(), fp8_max)
    bad = got.view(np.int32) != want.view(np.int32)
    assert not bad.any(), f"{int(bad.sum())}/4096 scales differ, e.g. " + _first(
        bad, amax.numpy(), got, want)


def test_scale_from_amax_power_of_2_for_random_amax():
    amax = (torch.rand(4096, dtype=torch.float64) * 4 * 10 ** (torch.rand(4096) * 60 - 30)).float()
    for fp8_max in (448.0, 57344.0):
        got = scale_from_amax(amax, fp8_max, power_2_scale=True).numpy()
        assert np.array_equal(got.view(np.int32), ref_current_scale(amax.numpy(), fp8_max, pow2=True)
                              .view(np.int32))



def _e8m0_case(amax, fp8_max=448.0):
    return pytest.param(amax, fp8_max, id=f"amax={amax!r}-max={fp8_max:g}")


@pytest.mark.parametrize("amax, fp8_max", [
    _e8m0_case(0.0), _e8m0_case(_nan), _e8m0_case(_inf), _e8m0_case(448.0), _e8m0_case(1.0),
    _e8m0_case(_below(448)), _e8m0_case(_above(448)), _e8m0_case(448.0 * 2 ** 20),
    _e8m0_case(float(FLT_MAX)), _e8m0_case(float(FLT_MAX), 57344.0), _e8m0_case(57344.0, 57344.0),
    _e8m0_case(_above(57344), 57344.0), _e8m0_case(1.0, 57344.0), _e8m0_case(float(FLT_TINY)),
    _e8m0_case(448 * 2.0 ** -126),                  # ratio is the smallest normal: 2**-126
    _e8m0_case(448 * 2.0 ** -127 * 1.5),            # denormal ratio above 2**-127: 2**-126
    _e8m0_case(448 * 2.0 ** -127),        # ratio exactly 2**-127 (denormal): 2**-127
    _e8m0_case(1e-40), _e8m0_case(1e-40, 57344.0),
    _e8m0_case(1e-45),                              # the ratio underflows to 0: 2**-127
])
def test_e8m0_scale_inv_edge_values(amax, fp8_max):
    got = e8m0_scale_inv(torch.tensor([amax], dtype=torch.float32), fp8_max)
    assert got.dtype == torch.uint8
    want, _ = ref_e8m0([amax], fp8_max)
    assert got.item() == want[0], (amax, got.item(), want[0])
    # Decoded as torch's own E8M0 type decodes the byte (NaN for 0xFF).
    assert torch.equal(torch.nan_to_num(e8m0_to_float(got), 7.0),
                       torch.nan_to_num(got.view(torch.float8_e8m0fnu).float(), 7.0))


def test_e8m0_scale_inv_random_amax():
    amax = (torch.rand(4096, dtype=torch.float64) * 4 * 10 ** (torch.rand(4096) * 66 - 30)).float()
    for fp8_max in (448.0, 57344.0):
        got = e8m0_scale_inv(amax, fp8_max).numpy()
        assert np.array_equal(got, ref_e8m0(amax.numpy(), fp8_max)[0])


# =============================================================================
# quantize / quantize_with_transpose / dequantize on random inputs
# =============================================================================

def _quantize(x, recipe, role, cfg):
    q, state = quantize(x, recipe, role)
    assert state is None
    assert_quantized(q, as_f32(x), cfg)
    return q


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name, role", RECIPE_ROLES)
def test_quantize_matches_reference_odd_shapes_fp32(name, role, shape):
    recipe = RECIPES[name]
    x = random_matrix(*shape)
    x[0, 0] = 0.0
    _quantize(x, recipe, role, ref_config(recipe, role))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(3, 33), (129, 300)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name, role", RECIPE_ROLES)
def test_quantize_matches_reference_half_precision_inputs(name, role, shape, dtype):
    recipe = RECIPES[name]
    _quantize(random_matrix(*shape, DTYPES[dtype]), recipe, role, ref_config(recipe, role))


@pytest.mark.parametrize("shape", [(1, 33), (3, 129), (129, 300), (256, 1), (130, 17)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name, role", RECIPE_ROLES)
def test_quantize_with_transpose_second_copy_is_the_cast_of_x_t(name, role, shape):
    """q_t == quantize(x.T): for 1x32 / 1x128 blocks then run along x's columns."""
    recipe = RECIPES[name]
    cfg = ref_config(recipe, role)
    x = random_matrix(*shape)
    q, q_t, state = quantize_with_transpose(x, scheme_for(recipe, role))
    assert state is None
    assert_quantized(q, as_f32(x), cfg)
    assert_quantized(q_t, as_f32(x).T.copy(), cfg)


@pytest.mark.parametrize("shape", [(1, 17), (3, 129), (129, 300)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name, role", RECIPE_ROLES)
def test_dequantize_is_data_times_block_scale_inv(name, role, shape):
    recipe = RECIPES[name]
    cfg = ref_config(recipe, role)
    x = random_matrix(*shape)
    q = _quantize(x, recipe, role, cfg)
    got = dequantize(q)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert_same_f32(got, ref_dequantize(q, cfg.fmt))
    ref = ref_quantize(as_f32(x), cfg)     # and so the whole chain equals the reference's
    scale_inv = ref.scale_inv if cfg.block is None else expand(ref.scale_inv, cfg.block, shape)
    assert_same_f32(got, (decode_fp8(ref.codes, cfg.fmt).astype(F32) * scale_inv).astype(F32))


# =============================================================================
# Edge cases, for every recipe and role
# =============================================================================

EDGE_SHAPE = (130, 140)     # 2x2 blocks of 128x128 (partial edges), 2 of 1x128 and 5 of 1x32 per row


def zeros_case(dtype):
    return torch.zeros(EDGE_SHAPE, dtype=dtype)


def nan_inf_case(dtype):
    """NaN and +-inf in some blocks (one block with both), large finite values elsewhere."""
    x = random_matrix(*EDGE_SHAPE) * 100
    x[0, 0] = float("nan")
    x[0, 5] = float("inf")           # same 1x32 / 1x128 / 128x128 block as the NaN
    x[1, 40] = float("inf")          # blocks with an inf but no NaN
    x[129, 139] = float("-inf")      # edge block (partial in both dims)
    x[2, 135] = float("nan")
    x[128, 3] = -0.0
    return x.to(dtype)


def inf_no_nan_case(dtype):
    """Current scaling: inf amax -> scale 1, so finite values beyond the format max saturate."""
    x = random_matrix(*EDGE_SHAPE) * 100
    x[5, 7] = float("-inf")
    return x.to(dtype)


def denormal_case(dtype):
    """Inputs denormal in their own dtype (fp32: ~1e-39 .. 1e-45), plus exact 1e-40s."""
    tiny = torch.finfo(dtype).tiny
    x = (torch.randn(EDGE_SHAPE, dtype=torch.float64) * tiny / 4).to(dtype)
    if dtype != torch.float16:
        x[0, :4] = torch.tensor([1e-40, -1e-40, 1e-45, -1e-45]).to(dtype)
    return x


def fp8_subnormal_case(dtype, fmt_max):
    """Every 32-block holds the format max (scale ~1), the rest lands in FP8 subnormals."""
    x = torch.rand(EDGE_SHAPE, dtype=torch.float64) * 2 - 1
    x = x * (2.0 ** -5 if fmt_max == 448.0 else 2.0 ** -13)
    x[:, ::32] = fmt_max
    x[1::2, ::32] = -fmt_max
    return x.to(dtype)


def mixed_denormal_case(dtype):
    """fp32 denormals and normal values in the same blocks (of x and of x.T)."""
    x = random_matrix(*EDGE_SHAPE)
    i, j = torch.meshgrid(torch.arange(EDGE_SHAPE[0]), torch.arange(EDGE_SHAPE[1]), indexing="ij")
    x[(i + j) % 3 == 0] = 1e-40
    return x.to(dtype)


EDGE_CASES = ("zeros", "nan_inf", "inf_no_nan", "denormal", "fp8_subnormal", "mixed_denormal")
HALF_EDGE_CASES = ("nan_inf", "denormal", "fp8_subnormal")      # bf16 / fp16 inputs


def _edge_params():
    params = []
    for (name, role), dtype in itertools.product(itertools.product(RECIPES, ROLES), DTYPES):
        for case in EDGE_CASES if dtype == "fp32" else HALF_EDGE_CASES:
            params.append(pytest.param(name, role, dtype, case, id=f"{name}-{role}-{dtype}-{case}"))
    return params


@pytest.mark.parametrize("name, role, dtype, case", _edge_params())
def test_quantize_edge_case_matches_reference(name, role, dtype, case):
    """Zeros, NaN/inf (NaN positions; inf saturates; current scaling with a NaN or inf
    amax uses scale 1, MXFP8 a NaN / 2**127 block scale), denormals, FP8 subnormals."""
    recipe, dtype = RECIPES[name], DTYPES[dtype]
    cfg = ref_config(recipe, role)
    make = {"zeros": zeros_case, "nan_inf": nan_inf_case, "inf_no_nan": inf_no_nan_case,
            "denormal": denormal_case, "mixed_denormal": mixed_denormal_case,
            "fp8_subnormal": lambda d: fp8_subnormal_case(d, cfg.fmt.max)}[case]
    x = make(dtype)
    q = _quantize(x, recipe, role, cfg)
    assert_same_f32(dequantize(q), ref_dequantize(q, cfg.fmt))
    _, q_t, _ = quantize_with_transpose(x, scheme_for(recipe, role))
    assert_quantized(q_t, as_f32(x).T.copy(), cfg)


@pytest.mark.parametrize("name, role", RECIPE_ROLES)
def test_edge_case_expectations_spelled_out(name, role):
    """Some consequences of the reference, stated directly (documentation as much as test)."""
    recipe = RECIPES[name]
    cfg = ref_config(recipe, role)
    fmax = cfg.fmt.max
    # All zeros: data 0. scale_inv: 2**-127 for MXFP8 (E8M0 byte 0); 1 for current scaling
    # without eps; with eps > 0 (applied first, as TE) scale = fp8_max / eps.
    q, _ = quantize(torch.zeros(3, 40), recipe, role)
    assert (q.data.double() == 0).all()
    si = torch.from_numpy(scale_inv_values(q.scale_inv))
    if cfg.rule == "e8m0":
        assert (q.scale_inv == 0).all() and (si == 2.0 ** -127).all()
    elif cfg.eps == 0:
        assert (si == 1).all()
    elif cfg.pow2:      # the scale is rounded down, so its inverse is up to 2x larger
        assert ((si >= cfg.eps / fmax) & (si < 2 * cfg.eps / fmax)).all()
    else:
        assert torch.allclose(si, torch.tensor(cfg.eps / fmax), rtol=1e-6, atol=0)
    # NaN stays NaN, and only it: the amax skips NaN elements (TE's fmax), so here it is inf.
    # Current scaling with an inf amax uses scale 1: inf and 1e6 saturate and 2 stays 2.
    # MXFP8: the block's E8M0 scale is 2**127 (byte 254), under which the finite values vanish.
    q, _ = quantize(torch.tensor([[float("nan"), float("inf"), -float("inf"), 1e6, 2.0]]), recipe, role)
    v = q.data.double()[0]
    if cfg.rule == "e8m0":
        assert torch.isnan(v[0]) and v[1:].tolist() == [fmax, -fmax, 0.0, 0.0]
        assert q.scale_inv.item() == 254
    else:
        assert torch.isnan(v[0]) and v[1:].tolist() == [fmax, -fmax, fmax, 2.0]
        assert (q.scale_inv == 1).all()
    # inf amax: current scaling uses scale 1; MXFP8 uses scale_inv 2**127 (byte 254).
    q, _ = quantize(torch.tensor([[float("inf"), 1e6, -1e6, 2.0]]), recipe, role)
    v = q.data.double()[0]
    if cfg.rule == "e8m0":
        assert q.scale_inv.item() == 254 and v.tolist() == [fmax, 0.0, -0.0, 0.0]
    else:
        assert (q.scale_inv == 1).all() and v.tolist() == [fmax, fmax, -fmax, 2.0]


# (Pure E5M2 is refused, as in TE; HYBRID's gradient role is the E5M2 case.)
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=lambda f: f.value)
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("scale", [1000.0, 2.0 ** 4, 0.375])
def test_delayed_fixed_scale_saturates_at_format_max(fmt, role, scale):
    """Given scale s (delayed scaling): data = round(clamp(x * s, +-max)); scale_inv = 1/s;
    the history's current slot becomes max(slot, amax), the rest and the scale unchanged."""
    recipe = DelayedScaling(fp8_format=fmt, amax_history_len=4)
    x = random_matrix(65, 33) * 10
    x[3, 4], x[5, 6] = 1e9, -1e8                             # far beyond any format max
    cfg = RefConfig(ref_format(recipe, role), None, "fixed", fixed_scale=scale)
    history = torch.tensor([0.5, 7.0, 0.0, 3.0])
    state = DelayedState(history.clone(), torch.tensor(scale))
    q, new_state = quantize(x, recipe, role, state)
    ref = ref_quantize(as_f32(x), cfg)
    assert_fp8_equal(q.data, ref.codes, cfg.fmt, as_f32(x))
    assert_scale_inv_equal(q.scale_inv, ref, cfg)
    assert q.data.double().max() == cfg.fmt.max and q.data.double().min() == -cfg.fmt.max
    assert torch.equal(new_state.amax_history, torch.tensor([1e9, 7.0, 0.0, 3.0]))
    assert new_state.scale.item() == scale and torch.equal(state.amax_history, history)


# =============================================================================
# Weight cache: quantize_weight
# =============================================================================

W_SHAPE = (129, 300)      # (out_features, in_features): partial blocks everywhere
CACHE_RECIPES = {name: RECIPES[name] for name in
                 ("current-e4m3-pow2-eps", "mxfp8-e4m3", "block-e4m3", "current-hybrid")}


@pytest.fixture
def quantize_calls(monkeypatch):
    """Counts weight casts (every one is made by te_func.quant.workspace.make_cast)."""
    calls = []
    real = workspace_module.quantize_with_transpose

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(workspace_module, "quantize_with_transpose", counting)
    return calls


def snapshot(ws: dict):
    """Identity and bits of every entry, to check a dict was not mutated."""
    return {k: (v, v.detach().reshape(-1).view(torch.uint8).clone()) for k, v in ws.items()}


def assert_unchanged(ws: dict, snap):
    assert ws.keys() == snap.keys()
    for k, (obj, bits) in snap.items():
        assert ws[k] is obj and torch.equal(obj.detach().reshape(-1).view(torch.uint8), bits), k


def cast_fields(shape, recipe) -> list[str]:
    return list(workspace_module.cast_entries(tuple(shape), scheme_for(recipe, "weight")))


def assert_cast_is_reference(cast, new_ws, weight, recipe, stored: bool):
    cfg = ref_config(recipe, "weight")
    w32 = as_f32(weight)
    assert_quantized(cast.rowwise, w32, cfg)
    assert_quantized(cast.columnwise, w32.T.copy(), cfg)
    if stored:
        assert new_ws["data"] is cast.rowwise.data and new_ws["scale_inv"] is cast.rowwise.scale_inv
        assert new_ws["data_t"] is cast.columnwise.data
        if cfg.block is None:        # one tensor-wise scale decodes both layouts: stored once
            assert "scale_inv_t" not in new_ws and cast.columnwise.scale_inv is cast.rowwise.scale_inv
        else:
            assert new_ws["scale_inv_t"] is cast.columnwise.scale_inv
        assert set(new_ws) & set(CAST_FIELDS) == set(cast_fields(weight.shape, recipe))
    else:
        assert not set(CAST_FIELDS) & new_ws.keys()


@pytest.mark.parametrize("name", CACHE_RECIPES)
@pytest.mark.parametrize("workspace", ["none", "empty", "other-entries"])
def test_quantize_weight_cache_none_quantizes_and_stores_the_fresh_cast(name, workspace, quantize_calls):
    recipe = CACHE_RECIPES[name]
    w = random_matrix(*W_SHAPE)
    ws = {"none": None, "empty": {}, "other-entries": {"unrelated": torch.ones(3)}}[workspace]
    snap = snapshot(ws) if ws is not None else None
    cast, new_ws = quantize_weight(w, Quantizer(recipe, "weight"), ws, None)
    assert len(quantize_calls) == 1
    assert_cast_is_reference(cast, new_ws, w, recipe, stored=True)
    if ws is not None:
        assert_unchanged(ws, snap)
        assert new_ws is not ws and all(new_ws[k] is ws[k] for k in ws if k not in CAST_FIELDS)


def test_quantize_weight_cache_none_replaces_an_older_cast(quantize_calls):
    """No stale cast survives a cache=None call: a later cache=False call reuses the newest."""
    recipe = RECIPES["block-e4m3"]
    _, old_ws = quantize_weight(random_matrix(*W_SHAPE), Quantizer(recipe), None, True)
    w = random_matrix(*W_SHAPE)
    fresh, new_ws = quantize_weight(w, Quantizer(recipe), old_ws, None)
    assert all(new_ws[k] is not old_ws[k] for k in cast_fields(W_SHAPE, recipe))
    quantize_calls.clear()
    reused, _ = quantize_weight(w, Quantizer(recipe), new_ws, False)
    assert not quantize_calls and reused.rowwise.data is fresh.rowwise.data


@pytest.mark.parametrize("name", CACHE_RECIPES)
@pytest.mark.parametrize("workspace", ["none", "other-entries", "old-cast"])
def test_quantize_weight_cache_true_quantizes_and_stores_both_copies(name, workspace, quantize_calls):
    recipe = CACHE_RECIPES[name]
    quantizer = Quantizer(recipe, "weight")
    w = random_matrix(*W_SHAPE)
    ws = {"none": None, "other-entries": {"unrelated": torch.ones(3)},
          "old-cast": quantize_weight(random_matrix(*W_SHAPE), quantizer, None, True)[1]}[workspace]
    quantize_calls.clear()
    snap = snapshot(ws) if ws is not None else None
    cast, new_ws = quantize_weight(w, quantizer, ws, True)
    assert len(quantize_calls) == 1                  # True always quantizes, even over a valid cast
    assert set(cast_fields(W_SHAPE, recipe)) <= new_ws.keys()
    assert_cast_is_reference(cast, new_ws, w, recipe, stored=True)
    if ws is not None:
        assert_unchanged(ws, snap)
        assert new_ws is not ws
        if "unrelated" in ws:
            assert new_ws["unrelated"] is ws["unrelated"]


@pytest.mark.parametrize("name", CACHE_RECIPES)
def test_quantize_weight_cache_false_reuses_a_valid_cast(name, quantize_calls):
    """The same tensor objects come back and nothing is quantized, even if the weight
    changed meanwhile (TE's is_first_microbatch=False semantics)."""
    recipe = CACHE_RECIPES[name]
    quantizer = Quantizer(recipe, "weight")
    w = random_matrix(*W_SHAPE)
    _, ws = quantize_weight(w, quantizer, {"unrelated": torch.ones(2)}, True)
    snap = snapshot(ws)
    quantize_calls.clear()
    for weight in (w, random_matrix(*W_SHAPE)):
        cast, new_ws = quantize_weight(weight, quantizer, ws, False)
        assert quantize_calls == []
        assert cast.rowwise.data is ws["data"] and cast.rowwise.scale_inv is ws["scale_inv"]
        assert cast.columnwise.data is ws["data_t"]
        assert cast.columnwise.scale_inv is ws["scale_inv_t" if "scale_inv_t" in ws else "scale_inv"]
        assert cast.rowwise.block == cast.columnwise.block == ref_config(recipe, "weight").block
        assert new_ws.keys() == ws.keys() and all(new_ws[k] is ws[k] for k in ws)
        assert_unchanged(ws, snap)
    assert_cast_is_reference(cast, new_ws, w, recipe, stored=True)


# (old quantizer, old weight shape, new recipe, entry to drop): the old cast is not valid now.
# An E5M2 cast is what the HYBRID recipes make of gradients.
INVALID_CASTS = {
    "wrong-shape": (RECIPES["block-e4m3"], (64, 300), RECIPES["block-e4m3"], None),
    "transposed-shape": (RECIPES["mxfp8-e4m3"], W_SHAPE[::-1], RECIPES["mxfp8-e4m3"], None),
    "e5m2-cast-now-e4m3": (Quantizer(Float8CurrentScaling(), "grad"), W_SHAPE, RECIPES["current-e4m3-pow2-eps"], None),
    "e5m2-mxfp8-now-e4m3": (Quantizer(MXFP8BlockScaling(fp8_format=Format.HYBRID), "grad"), W_SHAPE,
                            RECIPES["mxfp8-e4m3"], None),
    "1x32-cast-now-32x32": (RECIPES["mxfp8-e4m3"], W_SHAPE, RECIPES["mxfp8-2d-weights"], None),
    "mxfp8-cast-now-block": (RECIPES["mxfp8-e4m3"], W_SHAPE, RECIPES["block-e4m3"], None),
    "block-cast-now-mxfp8": (RECIPES["block-e4m3"], W_SHAPE, RECIPES["mxfp8-e4m3"], None),
    "tensorwise-cast-now-block": (RECIPES["current-e4m3-pow2-eps"], W_SHAPE, RECIPES["block-e4m3"], None),
    "block-cast-now-tensorwise": (RECIPES["block-e4m3"], W_SHAPE, RECIPES["current-e4m3-pow2-eps"], None),
    "1x128-cast-now-128x128": (Float8BlockScaling(w_block_scaling_dim=1), W_SHAPE,
                               RECIPES["block-e4m3"], None),
    "missing-data_t": (RECIPES["block-e4m3"], W_SHAPE, RECIPES["block-e4m3"], "data_t"),
    "missing-scale_inv": (RECIPES["mxfp8-e4m3"], W_SHAPE, RECIPES["mxfp8-e4m3"], "scale_inv"),
}


@pytest.mark.parametrize("case", INVALID_CASTS)
def test_quantize_weight_cache_false_requantizes_an_invalid_cast(case, quantize_calls):
    old, old_shape, recipe, drop = INVALID_CASTS[case]
    old = old if isinstance(old, Quantizer) else Quantizer(old)
    _, ws = quantize_weight(random_matrix(*old_shape), old, {"unrelated": torch.ones(2)},
                            True)
    if drop:
        ws = {k: v for k, v in ws.items() if k != drop}
    snap = snapshot(ws)
    quantize_calls.clear()
    w = random_matrix(*W_SHAPE)
    cast, new_ws = quantize_weight(w, Quantizer(recipe), ws, False)
    assert len(quantize_calls) == 1
    assert_cast_is_reference(cast, new_ws, w, recipe, stored=True)     # and stored anew
    assert all(new_ws[k] is not ws.get(k) for k in cast_fields(W_SHAPE, recipe))
    assert new_ws["unrelated"] is ws["unrelated"]
    assert_unchanged(ws, snap)


def test_quantize_weight_cache_false_trusts_a_cast_that_fits(quantize_calls):
    """quantize_weight reads no data: a cast of the right shape, dtype and device is reused
    whichever recipe made it, as TE reuses its cache. Which recipe made a workspace is checked
    once per call by the frame (tests/shell/test_workspace_format.py)."""
    old = Float8CurrentScaling(Format.E4M3)
    new = RECIPES["current-e4m3-pow2-eps"]
    w = random_matrix(*W_SHAPE)
    _, ws = quantize_weight(w, Quantizer(old), None, True)
    quantize_calls.clear()
    cast, _ = quantize_weight(w, Quantizer(new), ws, False)
    assert not quantize_calls and cast.rowwise.data is ws["data"]


@pytest.mark.parametrize("name", CACHE_RECIPES)
@pytest.mark.parametrize("workspace", ["none", "empty"])
def test_quantize_weight_cache_false_without_a_cast_quantizes_and_stores(name, workspace, quantize_calls):
    recipe = CACHE_RECIPES[name]
    w = random_matrix(*W_SHAPE)
    ws = None if workspace == "none" else {}
    cast, new_ws = quantize_weight(w, Quantizer(recipe), ws, False)
    assert len(quantize_calls) == 1
    assert_cast_is_reference(cast, new_ws, w, recipe, stored=True)
    assert ws is None or ws == {}
