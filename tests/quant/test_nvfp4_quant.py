"""NVFP4 quantization checked bit for bit against an independent numpy reference.

The reference below is written from the format's definition (E2M1 from its bit
layout, E4M3 block scales from tests/quant/test_quant.py's FP8 reference, the
per-tensor scale from the amax) and from TransformerEngine's scale arithmetic
as its kernels round it, in numpy float32; rounding is done by table look-up
in float64. Stochastic rounding is checked against its rule with random bits
from a pure-Python Philox (Python integers, not te_func's int64 code), itself
checked against Random123's known answers; the Hadamard transform against
Sylvester's definition H[i, j] = (-1)**popcount(i & j) in float64. Nothing in
the reference calls te_func.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from te_func.gemm import gemm
from te_func.quant import dequantize, quantize, quantize_with_transpose, scheme_for, transpose
from te_func.quant import nvfp4
from te_func.recipe import NVFP4BlockScaling
from test_quant import E4M3, _first, as_f32, block_amax, decode_fp8, expand, random_matrix, round_fp8

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Recipes by what they change: TE's default (16x16 weights, stochastically rounded gradients,
# Hadamard-transformed wgrad copies), and with each technique off.
RECIPES = {"default": NVFP4BlockScaling(), "1d": NVFP4BlockScaling(disable_2d_quantization=True),
           "rn": NVFP4BlockScaling(disable_stochastic_rounding=True),
           "no-rht": NVFP4BlockScaling(disable_rht=True)}
ODD_SHAPES = [(1, 1), (3, 17), (16, 16), (17, 33), (33, 129), (130, 47)]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# =============================================================================
# Reference: E2M1
# =============================================================================

def e2m1_table() -> np.ndarray:
    """The 8 non-negative E2M1 values in code order, from the bit layout: 2 exponent bits
    (bias 1), 1 mantissa bit; exponent 0 is subnormal (m * 0.5)."""
    values = []
    for code in range(8):
        e, m = code >> 1, code & 1
        values.append(0.5 * m if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))
    return np.array(values)


E2M1 = e2m1_table()


def ref_round_e2m1(v) -> np.ndarray:
    """Codes of v: nearest value, ties to the even code, |v| > 6 saturates, the sign bit kept
    (0x8), NaN -> +6 (satfinite: E2M1 has no NaN)."""
    v = np.asarray(v, dtype=np.float64)
    nan = np.isnan(v)
    a = np.where(nan, 0.0, np.minimum(np.abs(v), 6.0))
    hi = np.searchsorted(E2M1, a, side="left")
    lo = np.maximum(hi - 1, 0)
    below, above = a - E2M1[lo], E2M1[hi] - a
    idx = np.where((above < below) | ((above == below) & (hi % 2 == 0)), hi, lo)
    return np.where(nan, 7, idx | (np.signbit(v).astype(np.int64) << 3)).astype(np.uint8)


def ref_stochastic_round_e2m1(v, rbits) -> np.ndarray:
    """Codes of v rounded by TE's stochastic rule, stated by neighbours: with lo <= |v| < hi the
    two E2M1 values around |v|, round up iff fl32(|v| + (rbits / 256) * (hi - lo)) >= hi."""
    v = np.asarray(v, dtype=F32)
    nan = np.isnan(v)
    a = np.where(nan, F32(0), np.minimum(np.abs(v), F32(6)))
    lo_idx = np.clip(np.searchsorted(E2M1, a, side="right") - 1, 0, 7)
    hi_idx = np.minimum(lo_idx + 1, 7)
    lo, hi = E2M1[lo_idx].astype(F32), E2M1[hi_idx].astype(F32)
    t = (a + (np.asarray(rbits).astype(F32) / F32(256)) * (hi - lo)).astype(F32)
    idx = np.where((lo_idx < 7) & (t >= hi), hi_idx, lo_idx)
    return np.where(nan, 7, idx | (np.signbit(v).astype(np.int64) << 3)).astype(np.uint8)


def decode_e2m1(codes) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.int64)
    mag = E2M1[codes & 7]
    return np.where(codes & 8, -mag, mag)


def unpack(data: torch.Tensor, columns: int) -> np.ndarray:
    """uint8 bytes -> codes: element 2j in the low nibble, 2j + 1 in the high one."""
    b = data.numpy().astype(np.int64)
    codes = np.empty((b.shape[0], 2 * b.shape[1]), dtype=np.int64)
    codes[:, 0::2], codes[:, 1::2] = b & 0xF, b >> 4
    return codes[:, :columns]


# =============================================================================
# Reference: Philox4x32-10 with Python integers, and the documented byte layout
# =============================================================================

def ref_philox(ctr, key, rounds=10):
    c, k = list(ctr), list(key)
    for r in range(rounds):
        if r:
            k = [(k[0] + 0x9E3779B9) & 0xFFFFFFFF, (k[1] + 0xBB67AE85) & 0xFFFFFFFF]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k[1], p0 & 0xFFFFFFFF]
    return c


def ref_random_bytes(seed: int, counter: int, stream: int, shape) -> np.ndarray:
    """Element i takes byte i % 4 of word (i % 16) // 4 of Philox at counter (i // 16, stream,
    counter's low and high words), keyed by the seed's two words."""
    n = int(np.prod(shape))
    seed &= (1 << 64) - 1
    key = (seed & 0xFFFFFFFF, seed >> 32)
    out = []
    for chunk in range(-(-n // 16)):
        words = ref_philox((chunk, stream, counter & 0xFFFFFFFF, counter >> 32), key)
        out += [(w >> (8 * b)) & 0xFF for w in words for b in range(4)]
    return np.array(out[:n], dtype=np.int64).reshape(shape)


# =============================================================================
# Reference: NVFP4 quantization (TE's arithmetic, fp32 step by step)
# =============================================================================

def ref_global_encode_scale(amax: F32) -> F32:
    """S_enc = fl(2688 / amax), FLT_MAX where that overflows, 1 where amax is 0 or inf."""
    with np.errstate(divide="ignore", over="ignore"):
        s = F32(6 * 448) / F32(amax)
    if np.isinf(s):
        s = FLT_MAX
    return F32(1) if amax == 0 or s == 0 else F32(s)


def ref_nvfp4(x32: np.ndarray, block, rbits=None):
    """(codes (rows, cols), E4M3 scale codes per block, amax) of a float32 matrix."""
    amax = np.fmax.reduce(np.abs(x32), axis=None, initial=F32(0))       # NaN skipped (TE's fmax)
    s_enc = ref_global_encode_scale(amax)
    s_dec = F32(1) / s_enc
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.minimum((block_amax(x32, block) * (s_enc * F32(1 / 6))).astype(F32), FLT_MAX)
    scale_codes = round_fp8(np.clip(s, 0, 448), E4M3)
    scale = decode_fp8(scale_codes, E4M3).astype(F32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        enc = np.minimum(F32(1) / (scale * s_dec), FLT_MAX).astype(F32)
        v = (x32 * expand(enc, block, x32.shape)).astype(F32)
    codes = ref_round_e2m1(v) if rbits is None else ref_stochastic_round_e2m1(v, rbits)
    return codes, scale_codes, F32(amax)


def ref_dequantize(codes, scale_codes, amax, block) -> np.ndarray:
    """TE's decode: e2m1 * fl(fl(scale * amax) * fl32(1 / 2688)), in fp32."""
    with np.errstate(over="ignore", invalid="ignore"):
        factor = ((decode_fp8(scale_codes, E4M3).astype(F32) * F32(amax)).astype(F32) * F32(1 / 2688)).astype(F32)
        return (decode_e2m1(codes).astype(F32) * expand(factor, block, codes.shape)).astype(F32)


def ref_hadamard(x64: np.ndarray) -> np.ndarray:
    """Blocks of 16 along the last dim (zero-padded) times diag(signs) @ H16 / 4, in float64."""
    i = np.arange(16)
    h = np.where(np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :]), -1.0, 1.0)
    signs = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float64)
    q = np.diag(signs) @ h / 4
    rows, n = x64.shape
    padded = np.zeros((rows, -(-n // 16) * 16))
    padded[:, :n] = x64
    return (padded.reshape(rows, -1, 16) @ q).reshape(rows, -1)


# =============================================================================
# Comparing
# =============================================================================

def assert_nvfp4_equal(q, x32: np.ndarray, block, rbits=None):
    """q (te_func Quantized) is the reference's cast of x32: same codes, scale bytes and amax bits."""
    codes, scale_codes, amax = ref_nvfp4(x32, block, rbits)
    rows, cols = x32.shape
    assert q.nvfp4 and q.block == block and q.shape == (rows, cols)
    assert q.data.dtype == torch.uint8 and tuple(q.data.shape) == (rows, -(-cols // 2))
    assert q.scale_inv.dtype == torch.float8_e4m3fn and tuple(q.scale_inv.shape) == scale_codes.shape
    assert q.global_amax.dtype == torch.float32 and q.global_amax.shape == ()
    assert q.global_amax.numpy().view(np.int32) == amax.view(np.int32), (q.global_amax, amax)
    got_scale = q.scale_inv.view(torch.uint8).numpy()
    bad = got_scale != scale_codes
    assert not bad.any(), "E4M3 block scales (got, expected): " + _first(bad, got_scale, scale_codes)
    got = unpack(q.data, cols)
    bad = got != codes
    assert not bad.any(), f"{int(bad.sum())} E2M1 codes differ (x, got, expected): " + _first(bad, x32, got, codes)
    if cols % 2:        # the pad nibble of an odd row is 0
        assert (q.data.numpy()[:, -1] >> 4 == 0).all()
    return codes, scale_codes, amax


def assert_same_f32(got: torch.Tensor, want: np.ndarray):
    got = got.numpy()
    assert got.dtype == np.float32 and got.shape == want.shape
    same = (got.view(np.int32) == want.view(np.int32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), "(got, expected): " + _first(~same, got, want)


def rng(seed=12345, counter=0):
    return nvfp4.init_rng_state(seed) + torch.tensor([0, counter])


# =============================================================================
# The reference checks itself, and te_func's primitives against it
# =============================================================================

def test_e2m1_values_are_the_format_definition():
    assert E2M1.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    codes = torch.arange(16, dtype=torch.uint8)
    got = nvfp4.e2m1_values(codes)
    assert got.tolist() == decode_e2m1(np.arange(16)).tolist()
    assert torch.signbit(got[8]) and not torch.signbit(got[0])            # code 8 is -0.0


@pytest.mark.parametrize("v, want", [
    (0.25, 0.0), (0.2500001, 0.5), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0),
    (5.0, 4.0), (5.0001, 6.0), (7.0, 6.0), (float("inf"), 6.0), (-float("inf"), -6.0), (-0.1, -0.0),
    (float("nan"), 6.0), (-2.75, -3.0), (1e-30, 0.0)])
def test_round_to_e2m1_hand_checked(v, want):
    """Ties to the even code (codes 0, 2, 4, 6), saturation, signs kept, NaN to +6."""
    ref = ref_round_e2m1(np.float32(v))
    got = nvfp4.round_to_e2m1(torch.tensor([v], dtype=torch.float32))
    assert got.item() == ref and decode_e2m1(ref) == want and np.signbit(decode_e2m1(ref)) == np.signbit(want)


def test_round_to_e2m1_matches_reference_on_every_neighbourhood():
    v = torch.cat([torch.linspace(-7, 7, 20001), torch.tensor(E2M1 + 1e-7).float(),
                   torch.tensor(E2M1 - 1e-7).float(), torch.randn(4096) * 3])
    assert np.array_equal(nvfp4.round_to_e2m1(v).numpy(), ref_round_e2m1(v.numpy()))


def test_philox_matches_random123_known_answers():
    m = 0xFFFFFFFF
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((m, m, m, m), (m, m), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in kat:
        assert tuple(ref_philox(ctr, key)) == want
        got = nvfp4.philox4x32(tuple(torch.tensor(c) for c in ctr), tuple(torch.tensor(k) for k in key))
        assert tuple(int(w) for w in got) == want


@pytest.mark.parametrize("seed, counter, stream", [(12345, 0, 0), (-(2 ** 63), 7, 1), (2 ** 62 + 3, 2 ** 33 + 5, 1)])
def test_random_bytes_follow_the_documented_layout(seed, counter, stream):
    state = torch.tensor([seed, counter], dtype=torch.int64)
    got = nvfp4.random_bytes(state, stream, (7, 37))
    assert got.dtype == torch.int64 and np.array_equal(got.numpy(), ref_random_bytes(seed, counter, stream, (7, 37)))


def test_hadamard_transform_matches_the_definition():
    x = torch.randn(5, 40, dtype=torch.float64)
    want = ref_hadamard(x.numpy())
    assert np.allclose(nvfp4.hadamard_transform(x).numpy(), want, rtol=0, atol=1e-13)
    x32 = x.float()
    got = nvfp4.hadamard_transform(x32)
    assert got.dtype == torch.float32 and got.shape == (5, 48)
    assert np.allclose(got.numpy(), ref_hadamard(x32.double().numpy()), rtol=1e-6, atol=1e-6)
    # bf16 input: computed in fp32, rounded to bf16 once (TE writes the transform in the input's dtype)
    xb = x.bfloat16()
    assert torch.equal(nvfp4.hadamard_transform(xb), nvfp4.hadamard_transform(xb.float()).bfloat16())


@pytest.mark.parametrize("tokens", [16, 48, 37, 1])
def test_hadamard_transform_leaves_the_exact_product_unchanged(tokens):
    """Both wgrad operands transformed along tokens: (g Q)(x Q)^T = g x^T (Q orthogonal), also
    for token counts that need padding; the transform is not the identity."""
    g, x = torch.randn(24, tokens, dtype=torch.float64), torch.randn(40, tokens, dtype=torch.float64)
    hg, hx = nvfp4.hadamard_transform(g), nvfp4.hadamard_transform(x)
    assert torch.allclose(hg @ hx.t(), g @ x.t(), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(hg[:, :tokens], g)
    q = nvfp4.hadamard_transform(torch.eye(16, dtype=torch.float64))          # rows: the transform's matrix
    assert torch.allclose(q @ q.t(), torch.eye(16, dtype=torch.float64), atol=1e-15)


def test_hadamard_signs_are_tes_fixed_vector():
    """Deterministic: TE's hard-coded sign vector, whatever the torch seed."""
    assert nvfp4.RHT_SIGNS == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
    x = torch.randn(3, 16)
    torch.manual_seed(1)
    a = nvfp4.hadamard_transform(x)
    torch.manual_seed(2)
    assert torch.equal(a, nvfp4.hadamard_transform(x))


# =============================================================================
# quantize / dequantize
# =============================================================================

def _block(recipe, role):
    return (16, 16) if role == "weight" and not recipe.disable_2d_quantization else (1, 16)


ROLES_CASES = [pytest.param(name, role, id=f"{name}-{role}") for name in ("default", "1d", "rn")
               for role in ("input", "weight", "grad")]


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name, role", ROLES_CASES)
def test_quantize_matches_reference_odd_shapes(name, role, shape):
    recipe = RECIPES[name]
    x = random_matrix(*shape)
    x[0, 0] = 0.0
    sr = scheme_for(recipe, role).stochastic_rounding
    state = rng(counter=3) if sr else None
    q, new_state = quantize(x, recipe, role, state)
    rbits = ref_random_bytes(12345, 3, 0, shape) if sr else None
    codes, scale_codes, amax = assert_nvfp4_equal(q, as_f32(x), _block(recipe, role), rbits)
    assert_same_f32(dequantize(q), ref_dequantize(codes, scale_codes, amax, _block(recipe, role)))
    if sr:
        assert new_state.tolist() == [12345, 4]          # the stream moved on; nothing mutated
        assert state.tolist() == [12345, 3]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name, role", ROLES_CASES)
def test_quantize_matches_reference_half_precision_inputs(name, role, dtype):
    recipe = RECIPES[name]
    x = random_matrix(33, 70, DTYPES[dtype])
    sr = scheme_for(recipe, role).stochastic_rounding
    q, _ = quantize(x, recipe, role, rng() if sr else None)
    assert_nvfp4_equal(q, as_f32(x), _block(recipe, role), ref_random_bytes(12345, 0, 0, x.shape) if sr else None)


EDGE_SHAPE = (35, 70)


def _edge(case: str) -> torch.Tensor:
    x = torch.randn(EDGE_SHAPE)
    if case == "zeros":
        return torch.zeros(EDGE_SHAPE)
    if case == "saturation":            # one block holds the amax: others are far below, none above
        x[3, 20] = 1e4
        x[7, :16] = -9e3
    elif case == "denormal-block-scales":     # blocks 1e-4 .. 1e-9 of the amax: E4M3 subnormal or 0 scales
        x = x * 10.0 ** -torch.randint(4, 10, (EDGE_SHAPE[0], 1)).float()
        x[0, 0] = 1.0
    elif case == "nan-inf":
        x[0, 0], x[0, 5], x[2, 40], x[34, 69], x[5, 1] = float("nan"), float("inf"), float("-inf"), float("nan"), -0.0
    elif case == "inf-only":            # amax inf: S_enc = 1, block scale saturates to 448
        x[1, 1] = float("inf")
    elif case == "all-nan":
        x[:] = float("nan")
    elif case == "fp32-denormals":
        x = x * 1e-39
    elif case == "tiny-and-huge":       # the encode scale reaches FLT_MAX in all-zero blocks
        x[:, 16:32] = 0.0
        x[0, 0] = 3e38
    return x


EDGE_CASES = ("zeros", "saturation", "denormal-block-scales", "nan-inf", "inf-only", "all-nan", "fp32-denormals",
              "tiny-and-huge")


@pytest.mark.parametrize("case", EDGE_CASES)
@pytest.mark.parametrize("name, role", ROLES_CASES)
def test_quantize_edge_case_matches_reference(name, role, case):
    recipe = RECIPES[name]
    x = _edge(case)
    sr = scheme_for(recipe, role).stochastic_rounding
    q, _ = quantize(x, recipe, role, rng() if sr else None)
    codes, scale_codes, amax = assert_nvfp4_equal(q, as_f32(x), _block(recipe, role),
                                                  ref_random_bytes(12345, 0, 0, x.shape) if sr else None)
    assert_same_f32(dequantize(q), ref_dequantize(codes, scale_codes, amax, _block(recipe, role)))


def test_edge_case_expectations_spelled_out():
    """Consequences of the reference, stated directly (documentation as much as test)."""
    recipe = RECIPES["rn"]
    # All zeros: amax 0, S_enc 1, every block scale 0, codes 0; decodes to 0.
    q, _ = quantize(torch.zeros(2, 32), recipe)
    assert q.global_amax == 0 and (q.scale_inv.float() == 0).all() and (q.data == 0).all()
    assert (dequantize(q) == 0).all()
    # The amax's block gets scale 448 and its amax element code 7 (6): 6 * 448 * amax / 2688 = amax.
    x = torch.randn(4, 32)
    x[1, 3] = 100.0
    q, _ = quantize(x, recipe)
    assert q.scale_inv.float()[1, 0] == 448 and dequantize(q)[1, 3] == 100.0
    # NaN becomes +6 (satfinite), inf saturates to +-6; the amax skips NaN.
    q, _ = quantize(torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0] + [0.0] * 12]), recipe)
    assert nvfp4.unpack_e2m1(q.data)[0, :4].tolist() == [7, 7, 15, 0] and q.global_amax == float("inf")
    # A block 1e-6 of the amax: its E4M3 scale underflows to 0, the encode scale saturates, it decodes to 0.
    x = torch.cat([torch.full((1, 16), 1.0), torch.full((1, 16), 1e-6)], dim=1)
    q, _ = quantize(x, recipe)
    assert q.scale_inv.float()[0, 1] == 0 and (dequantize(q)[0, 16:] == 0).all()


def test_packing_puts_even_elements_in_the_low_nibble():
    x = torch.tensor([[0.5, 1.0, -6.0] + [0.0] * 13])      # amax 6: S_enc = 448, block scale 448 -> x as is
    q, _ = quantize(x, RECIPES["rn"])
    assert q.data[0, 0].item() == 0x21 and q.data[0, 1].item() == 0x0F


# =============================================================================
# Both copies: the 2-D weight's transpose, the Hadamard-transformed wgrad copies
# =============================================================================

@pytest.mark.parametrize("shape", [(48, 32), (33, 70), (5, 17)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", ["default", "1d"])
def test_weight_copies_are_the_casts_of_w_and_w_t(name, shape):
    """16x16 blocks: the cast of w.T is the transpose of the cast of w; 1x16: cast separately."""
    recipe = RECIPES[name]
    w = random_matrix(*shape)
    q, q_t, _ = quantize_with_transpose(w, scheme_for(recipe, "weight"))
    block = _block(recipe, "weight")
    assert_nvfp4_equal(q, as_f32(w), block)
    assert_nvfp4_equal(q_t, as_f32(w).T.copy(), block)
    if block == (16, 16):
        t = transpose(q)
        assert torch.equal(t.data, q_t.data) and t.data.is_contiguous()


@pytest.mark.parametrize("tokens", [32, 37, 8])
@pytest.mark.parametrize("name, role", [("default", "input"), ("default", "grad"), ("rn", "grad"),
                                        ("no-rht", "input"), ("no-rht", "grad")])
def test_wgrad_copy_is_the_cast_of_the_transform_of_x_t(name, role, tokens):
    """The columnwise copy of inputs and gradients is the cast of RHT(x.T) (tokens padded to a
    multiple of 16), with its own global amax and, for gradients, its own random stream (1);
    disable_rht makes it the plain cast of x.T."""
    recipe = RECIPES[name]
    s = scheme_for(recipe, role)
    x = torch.randn(tokens, 40)
    q, q_t, _ = quantize_with_transpose(x, s, rng(counter=9) if s.stochastic_rounding else None)
    bits = (lambda stream, shape: ref_random_bytes(12345, 9, stream, shape)) if s.stochastic_rounding \
        else (lambda stream, shape: None)
    assert_nvfp4_equal(q, as_f32(x), (1, 16), bits(0, x.shape))
    if s.hadamard:
        xt = nvfp4.hadamard_transform(x.t())             # checked against its definition above
        assert xt.shape == (40, -(-tokens // 16) * 16)
        assert_nvfp4_equal(q_t, as_f32(xt), (1, 16), bits(1, xt.shape))
    else:
        assert_nvfp4_equal(q_t, as_f32(x).T.copy(), (1, 16), bits(1, (40, tokens)))


# =============================================================================
# Stochastic rounding
# =============================================================================

def _grid_neighbours(a: np.ndarray):
    lo = E2M1[np.clip(np.searchsorted(E2M1, a, side="right") - 1, 0, 7)]
    hi = E2M1[np.minimum(np.searchsorted(E2M1, a, side="right"), 7)]
    return lo, hi


def test_stochastic_rounding_matches_reference_and_lands_on_a_neighbour():
    v = torch.cat([torch.rand(2000) * 12 - 6, torch.tensor(E2M1).float(), torch.tensor([7.0, -9.0, float("nan")])])
    rbits = nvfp4.random_bytes(rng(), 0, v.shape)
    got = nvfp4.stochastic_round_to_e2m1(v, rbits).numpy()
    assert np.array_equal(got, ref_stochastic_round_e2m1(v.numpy(), rbits.numpy()))
    a = np.minimum(np.abs(v.numpy()[:-1]), 6)
    lo, hi = _grid_neighbours(a)
    mag = np.abs(decode_e2m1(got[:-1]))
    assert ((mag == lo) | (mag == hi)).all()
    assert (mag[np.isin(a, E2M1)] == a[np.isin(a, E2M1)]).all()            # grid values stay


DRAWS = 4096


def _mean_of_draws(v: torch.Tensor) -> np.ndarray:
    """Mean over DRAWS independent roundings of each element of v (one stream, DRAWS rows of bits)."""
    rbits = nvfp4.random_bytes(rng(seed=777), 0, (DRAWS, v.numel()))
    return decode_e2m1(nvfp4.stochastic_round_to_e2m1(v.expand(DRAWS, -1), rbits).numpy()).mean(0)


def test_stochastic_rounding_is_unbiased():
    """Mean of 4096 roundings = the value, within 5 standard errors, for values whose position
    between their neighbours is a multiple of 1/256 (the resolution of TE's 8 random bits)."""
    lo_idx = torch.randint(0, 7, (512,))
    lo, hi = torch.tensor(E2M1).float()[lo_idx], torch.tensor(E2M1).float()[lo_idx + 1]
    f = torch.randint(0, 256, (512,)).float() / 256
    sign = torch.where(torch.rand(512) < 0.5, -1.0, 1.0)
    v = sign * (lo + f * (hi - lo))
    mean = _mean_of_draws(v)
    sigma = ((hi - lo) * torch.sqrt(f * (1 - f))).numpy()                 # std of one rounding
    err = np.abs(mean - v.numpy())
    assert (err <= 5 * sigma / np.sqrt(DRAWS) + 1e-7).all(), err.max()
    # Round to nearest is biased on the same values: its mean error is many standard errors off.
    rn = decode_e2m1(nvfp4.round_to_e2m1(v).numpy())
    assert np.abs(rn - v.numpy()).mean() > 20 * (sigma / np.sqrt(DRAWS)).mean()


def _up_probability(a: np.ndarray):
    """(lo, hi, P(round up)) of magnitudes a in [0, 6] under TE's rule: floor(256 f) / 256, f the
    position of a between lo and hi (8 random bits), so the std of one rounding is
    (hi - lo) * sqrt(p (1 - p))."""
    lo, hi = _grid_neighbours(a)
    f = np.where(hi > lo, (a - lo) / np.where(hi > lo, hi - lo, 1), 0)
    return lo, hi, np.floor(256 * f) / 256


def test_stochastic_rounding_bias_on_any_value_is_under_its_resolution():
    """Any value: within step / 256 (+ 5 standard errors) of unbiased, low in magnitude, as TE's
    8 random bits round up with probability floor(256 f) / 256."""
    v = (torch.rand(1024) * 12 - 6).float()
    a = np.abs(v.numpy())
    lo, hi, p = _up_probability(a)
    step = hi - lo
    mean = _mean_of_draws(v)
    se = step * np.sqrt(p * (1 - p)) / np.sqrt(DRAWS)
    expected = np.sign(v.numpy()) * (lo + step * p)                          # TE's exact expectation
    assert (np.abs(mean - expected) <= 5 * se + 1e-6).all()
    assert (np.abs(mean - v.numpy()) <= step / 256 + 5 * se + 1e-6).all()


def test_a_stochastically_rounded_gradient_dequantizes_to_itself_on_average():
    """End to end through quantize: E[dequantize(quantize(g))] = g for the grad role, within 5
    standard errors and the 8 random bits' resolution (1/256 of the gap between the two values an
    element rounds to), except where NVFP4 clips: a block scale rounded down to E4M3 can put the
    block's largest elements beyond 6, which saturate whatever the rounding (as in TE)."""
    g = torch.randn(4, 32)
    recipe, n = RECIPES["default"], 512
    casts = [quantize(g, recipe, "grad", rng(counter=k))[0] for k in range(n)]
    draws = torch.stack([dequantize(q) for q in casts])
    factor = casts[0].scale_inv.float().repeat_interleave(16, 1) * casts[0].global_amax / 2688   # per element
    scaled = (g.abs() / factor).numpy()
    lo, hi, p = _up_probability(np.minimum(scaled, 6))
    step = torch.from_numpy(hi - lo).float() * factor
    se = step * torch.from_numpy(np.sqrt(p * (1 - p))).float() / np.sqrt(n)
    inside = torch.from_numpy(scaled < 6 * (1 - 1e-6))
    err = (draws.mean(0) - g).abs()
    bound = 5 * se + step / 256 + 1e-5 * g.abs()
    assert (err <= bound)[inside].all() and inside.float().mean() > 0.8
    assert not torch.equal(draws[0], draws[1])


# =============================================================================
# The emulated FP4 GEMM
# =============================================================================

def _alpha(qa, qb) -> F32:
    """TE's per-tensor GEMM scale: fl(fl(amax_a * amax_b) * fl32(1 / (36 * 448 * 448)))."""
    return F32(F32(qa.global_amax.numpy() * qb.global_amax.numpy()) * F32(1 / (36 * 448 * 448)))


def _block_values(q) -> np.ndarray:
    codes = unpack(q.data, 2 * q.data.shape[1])
    s = decode_fp8(q.scale_inv.view(torch.uint8).numpy(), E4M3)
    return decode_e2m1(codes) * expand(s, q.block, codes.shape)


@pytest.mark.parametrize("k", [16, 70, 256])
def test_gemm_is_the_block_scaled_product_times_tes_alpha(k):
    """out = fl32(acc * alpha), acc the fp32 sum of exact block products: bit for bit where the
    fp32 accumulation is exact (one block, K = 16), to fp32 accumulation order otherwise."""
    recipe = RECIPES["rn"]
    a, _ = quantize(torch.randn(24, k), recipe, "input")
    b, _ = quantize(torch.randn(40, k) * 0.05, recipe, "weight")
    acc = _block_values(a) @ _block_values(b).T                          # float64, exact here
    got = gemm(a, b, torch.float32).numpy()
    if k == 16:
        assert np.array_equal(got, (acc.astype(F32) * _alpha(a, b)).astype(F32))
    else:
        assert np.allclose(got, acc * _alpha(a, b), rtol=1e-5, atol=1e-6 * np.abs(acc * _alpha(a, b)).max())
    # and it is the product of the dequantized operands up to the decode factors' rounding
    assert np.allclose(got, (dequantize(a).double() @ dequantize(b).double().t()).numpy(), rtol=1e-4, atol=1e-5)
    assert gemm(a, b, torch.bfloat16).dtype == torch.bfloat16
