"""NVFP4's format math: E2M1 codes, the two-level scales, stochastic rounding, the Hadamard transform.

NVFP4 (TE's NVFP4BlockScaling) stores x ~= e2m1 * block_scale * global_amax / (6 * 448):

e2m1:        4-bit codes, sign bit 0x8 and magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6},
             two a byte (element 2j in the low nibble)
block_scale: one E4M3 value per 1x16 block along the reduction dim (16x16 for weights)
global_amax: the tensor's amax; S_enc = 6 * 448 / global_amax puts the largest block scale near 448

The arithmetic follows TE's CUDA kernels (cast/nvfp4/*.cuh) step by step, each fp32 operation
rounded where TE rounds it, in plain torch: every device, vmap and torch.compile."""
from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

__all__ = ["E2M1_MAX", "E4M3_MAX", "BLOCK", "RHT_SIGNS", "global_encode_scale", "block_decode_scale",
           "block_encode_scale", "round_to_e2m1", "stochastic_round_to_e2m1", "pack_e2m1", "unpack_e2m1",
           "e2m1_values", "E2M1_VALUES", "hadamard_transform", "philox4x32", "random_bytes", "rng_seed",
           "init_rng_state", "advance_rng"]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16
_FLT_MAX = torch.finfo(torch.float32).max

# TE's fixed sign pattern for the "random" Hadamard transform (get_wgrad_sign_vector, hard-coded):
# the transform of a 16-vector v is (v * signs) @ H16 / 4.
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


# --- scales ------------------------------------------------------------------------------------

def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = (6 * 448) / amax in fp32 (one division), the largest finite fp32 where that overflows,
    1 where amax is 0 or inf (TE's compute_global_encode_scaling_factor_FP4)."""
    s = torch.full_like(amax, E2M1_MAX * E4M3_MAX) / amax
    s = torch.clamp(s, max=_FLT_MAX)
    return torch.where((amax == 0) | (s == 0), 1.0, s)


def block_decode_scale(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """Each block's E4M3 scale: fl(block_amax * fl(S_enc * fl32(1/6))) (TE folds 1/6 in first),
    rounded to nearest even and saturated to 448; a tiny block gets a subnormal scale, or 0."""
    s = block_amax * (s_enc * (1.0 / E2M1_MAX))        # a Python scalar multiplies in fp32
    return torch.clamp(s, max=E4M3_MAX).to(torch.float8_e4m3fn)


def block_encode_scale(block_scale: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """Each element's factor before rounding: 1 / (fp32(block_scale) * S_dec), the largest finite fp32
    where the block scale is 0 (TE's block_scale_inverse)."""
    return torch.clamp(torch.reciprocal(block_scale.float() * s_dec), max=_FLT_MAX)


# --- E2M1 codes ------------------------------------------------------------------------------

# The 8 magnitudes of E2M1 in code order: 1 sign, 2 exponent (bias 1) and 1 mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _with_sign(mag: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Codes from magnitude codes (float 0..7, NaN where v is NaN) and v's sign bit (0x8). The sign
    is kept (-0.0 gives 8), but a NaN becomes +6, as satfinite conversion to E2M1 gives (ptx.cuh)."""
    nan = torch.isnan(v)
    mag = torch.where(nan, 7.0, mag)
    return (mag + torch.where(torch.signbit(v) & ~nan, 8.0, 0.0)).to(torch.uint8)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of fp32 `v`: nearest, ties to even, |v| > 6 to 6, NaN to +6
    (cvt.rn.satfinite.e2m1x2.f32). On each stretch of the grid (0.5 apart below 2, 1 below 4, 2
    above) the code is an even offset plus round(a / spacing), which torch.round takes to even."""
    a = torch.clamp(v.abs(), max=E2M1_MAX)
    mag = torch.where(a < 2, torch.round(2 * a), torch.where(a < 4, 2 + torch.round(a), 4 + torch.round(0.5 * a)))
    return _with_sign(mag, v)


def stochastic_round_to_e2m1(v: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of fp32 `v` rounded at random with 8 random bits per element (`rbits` in [0, 256)),
    as TE rounds gradients (stochastic_round_fp4_e2m1, after cvt.rs.satfinite.e2m1x4.f32):

        a = |v|, u = rbits / 256, step = the grid spacing at a (0.5 below 2, 1 below 4, else 2)
        t = fl32(a + u * step);  the result: the grid point at or below t, at most 6

    so |v| rounds up with probability floor(256 f) / 256, f its position between its grid
    neighbours. Signs are kept, NaN gives +6, |v| > 6 gives 6."""
    a = v.abs()
    step = torch.where(a >= 4, 2.0, torch.where(a >= 2, 1.0, 0.5))
    t = a + rbits.to(torch.float32) * (1.0 / 256) * step            # u * step is exact: one rounding
    mag = torch.where(t < 2, torch.floor(2 * t), torch.where(t < 4, 2 + torch.floor(t), 4 + torch.floor(0.5 * t)))
    return _with_sign(torch.clamp(mag, max=7.0), v)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of each code (code 8 is -0.0)."""
    table = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(rows, cols) codes -> (rows, ceil(cols / 2)) uint8, element 2j in the low nibble (as TE)."""
    if codes.shape[-1] % 2:
        codes = F.pad(codes, (0, 1))
    # row-major whatever the strides of `codes` (a transposed tensor), as a checkpoint needs
    return (codes[..., 0::2] + codes[..., 1::2] * 16).contiguous()


def unpack_e2m1(data: torch.Tensor, columns: int | None = None) -> torch.Tensor:
    """(rows, bytes) uint8 -> (rows, columns) codes; columns defaults to 2 * bytes."""
    codes = torch.stack([data % 16, data // 16], dim=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])
    return codes if columns is None else codes[..., :columns]


# --- random Hadamard transform -----------------------------------------------------------------

def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (..., ceil(n / 16) * 16), zero-padded: each block of 16 times diag(RHT_SIGNS) @ H16 / 4,
    orthogonal, so (g Q) @ (x Q).T = g @ x.T. A fixed fp32 butterfly, rounded to x's dtype as TE's."""
    n = x.shape[-1]
    work = torch.promote_types(x.dtype, torch.float32)
    signs = torch.tensor(RHT_SIGNS, dtype=work, device=x.device) * 0.25     # 1/sqrt(16): exact
    v = F.pad(x.to(work), (0, -n % BLOCK))
    lead = v.shape[:-1]
    v = v.reshape(*lead, -1, BLOCK) * signs
    # v @ [[H, H], [H, -H]] = [(v1 + v2) @ H, (v1 - v2) @ H], down to 1x1 blocks.
    for half in (8, 4, 2, 1):
        v = v.reshape(*lead, -1, BLOCK // (2 * half), 2, half)
        a, b = v.unbind(-2)
        v = torch.stack([a + b, a - b], dim=-2)
    return v.reshape(*lead, -1).to(x.dtype)


# --- random bits: Philox4x32-10 in int64 arithmetic ----------------------------------------------

_MASK = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def _mulhilo(m: int, x: torch.Tensor):
    """(high, low) 32-bit words of m * x, m split in 16-bit halves so no int64 product overflows."""
    p_lo, p_hi = x * (m & 0xFFFF), x * (m >> 16)                 # each < 2**48
    t = p_hi + (p_lo >> 16)
    return t >> 16, ((t & 0xFFFF) << 16) | (p_lo & 0xFFFF)


def philox4x32(counter, key, rounds: int = 10):
    """Philox4x32-10 (cuRAND's, TE's) over int64 tensors of 32-bit words: counter, key -> 4 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        kr0, kr1 = (k0 + r * _PHILOX_W[0]) & _MASK, (k1 + r * _PHILOX_W[1]) & _MASK
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ kr0, lo1, hi0 ^ c3 ^ kr1, lo0
    return c0, c1, c2, c3


def _philox_bytes(rng_state: torch.Tensor, stream: int, numel: int) -> torch.Tensor:
    """rng_state (..., 2) -> (..., numel) integers in [0, 256): see `random_bytes`."""
    seed, counter = (t[..., None] for t in rng_state.unbind(-1))
    chunk = torch.arange(-(-numel // 16), dtype=torch.int64, device=rng_state.device)
    key = (seed & _MASK, (seed >> 32) & _MASK)
    counter_words = (chunk, torch.full_like(chunk, stream), counter & _MASK, (counter >> 32) & _MASK)
    words = torch.stack(torch.broadcast_tensors(*philox4x32(counter_words, key)), dim=-1)    # (..., chunks, 4)
    per_byte = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], dim=-1)           # (..., chunks, 4, 4)
    return per_byte.reshape(*per_byte.shape[:-3], -1)[..., :numel]


# One opaque op under torch.compile: traced, Philox's 300-odd integer ops cost seconds per GEMM.
@torch.library.custom_op("te_func::nvfp4_random_bytes", mutates_args=())
def _random_bytes_op(rng_state: torch.Tensor, stream: int, numel: int) -> torch.Tensor:
    return _philox_bytes(rng_state, stream, numel)


@_random_bytes_op.register_fake
def _(rng_state, stream, numel):
    return rng_state.new_empty((*rng_state.shape[:-1], numel))


def _random_bytes_vmap(info, in_dims, rng_state, stream, numel):
    # A batch of states (an ensemble's stacked workspaces) draws one stream per member.
    if in_dims[0] is None:
        return _random_bytes_op(rng_state, stream, numel), None
    return _random_bytes_op(rng_state.movedim(in_dims[0], 0), stream, numel), 0


torch.library.register_vmap(_random_bytes_op, _random_bytes_vmap)


def random_bytes(rng_state: torch.Tensor, stream: int, shape) -> torch.Tensor:
    """Integers in [0, 256), int64 of `shape`, in row-major order: a pure function of the RNG state
    (seed, counter), the stream and the index. Philox keyed by the seed, counter (chunk, stream,
    counter's two words); chunk i's four words give elements 16 i .. 16 i + 15, byte b of word w
    element 16 i + 4 w + b (as TE's kernels take byte k for the k-th of four)."""
    numel = 1
    for d in shape:
        numel *= d
    return _random_bytes_op(rng_state, stream, numel).reshape(*rng_state.shape[:-1], *shape)


# --- the RNG state a GEMM keeps ------------------------------------------------------------------

def rng_seed(name: str) -> int:
    """A 64-bit seed (as a signed int64) named by a string, e.g. a GEMM's module path."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little", signed=True)


def init_rng_state(seed: int, device=None) -> torch.Tensor:
    """A stream's first state: (seed, counter 0), int64 (2,)."""
    return torch.tensor([seed, 0], dtype=torch.int64, device=device)


def advance_rng(state: torch.Tensor) -> torch.Tensor:
    """The next state of the stream: the counter plus one (a new tensor; vmap-batched states too)."""
    return state + torch.tensor([0, 1], dtype=torch.int64, device=state.device)
