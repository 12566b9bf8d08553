"""How each recipe scales each tensor role: one `Scheme` per (recipe, role).

The recipes differ only in the fields of a Scheme; `quantize` has one code
path for all of them (NVFP4's format math: te_func.quant.nvfp4).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..recipe import (ROLES, derivation, derived, DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                      MXFP8BlockScaling, NVFP4BlockScaling)
from .._compat import ensure_view_dtype_batching

ensure_view_dtype_batching()    # the bit views below under vmap on torch 2.11

__all__ = ["Scheme", "scheme_for", "scale_from_amax", "e8m0_scale_inv", "e8m0_to_float", "round_down_pow2"]


@dataclass(frozen=True)
class Scheme:
    """How one tensor role is quantized under one recipe (see `scheme_for`)."""
    dtype: torch.dtype            # float8_e4m3fn or float8_e5m2; uint8 for NVFP4 (two E2M1 codes a byte)
    fp8_max: float                # the format's largest value (6 for E2M1)
    # None: one scale per tensor; else a block's (rows, cols): MXFP8 32s, Float8BlockScaling 128s, NVFP4 16s.
    block: tuple[int, int] | None
    rule: str                     # "current", "delayed", "e8m0" or "nvfp4"
    amax_epsilon: float = 0.0
    power_2_scale: bool = False
    margin: int = 0
    # NVFP4 only: the columnwise copy's Hadamard transform, and stochastic rounding.
    hadamard: bool = False
    stochastic_rounding: bool = False

    @property
    def scale_dtype(self) -> torch.dtype:
        # E8M0 as its bytes, uint8, as TE keeps them (inductor's CPU code has no float8_e8m0fnu).
        return {"e8m0": torch.uint8, "nvfp4": torch.float8_e4m3fn}.get(self.rule, torch.float32)

    @property
    def nvfp4(self) -> bool:
        return self.rule == "nvfp4"

    @property
    def transposable(self) -> bool:
        """True when the cast of x.T is the transpose of the cast of x (same blocks, no transform)."""
        return (self.block is None or self.block[0] == self.block[1]) and not self.hadamard

    def data_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        """The shape of the quantized data of a (rows, cols) tensor: NVFP4 packs two per byte."""
        rows, cols = shape
        return (rows, -(-cols // 2)) if self.nvfp4 else (rows, cols)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.block is None:
            return ()
        rows, cols = shape
        return (-(-rows // self.block[0]), -(-cols // self.block[1]))


def scheme_for(recipe, role: str) -> Scheme:
    """The Scheme `recipe` uses for tensors of `role` ("input", "weight" or "grad")."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return derived(recipe, role)


def _make_scheme(recipe, role: str) -> Scheme:
    if isinstance(recipe, NVFP4BlockScaling):
        # TE's derived QParams: 16x16 weight blocks, the Hadamard transform of inputs' and gradients'
        # columnwise copies, stochastic rounding of gradients (each unless its `disable_*`).
        qp = recipe.qparams(role)
        block = (16, 16) if qp.fp4_2d_quantization else (1, 16)
        return _scheme(torch.uint8, recipe.fp4_format.max(role), block, "nvfp4",
                       hadamard=qp.random_hadamard_transform, stochastic_rounding=qp.stochastic_rounding)
    fmt = recipe.fp8_format
    dtype, fp8_max = fmt.dtype(role), fmt.max(role)
    if isinstance(recipe, Float8CurrentScaling):
        qp = recipe.qparams(role)
        return _scheme(dtype, fp8_max, None, "current", qp.amax_epsilon, qp.power_2_scale)
    if isinstance(recipe, DelayedScaling):
        return _scheme(dtype, fp8_max, None, "delayed", margin=recipe.margin)
    if isinstance(recipe, MXFP8BlockScaling):
        # enable_2d_quantization: 32x32 blocks for weights (one E8M0 scale per block).
        block = (32, 32) if role == "weight" and recipe.enable_2d_quantization else (1, 32)
        return _scheme(dtype, fp8_max, block, "e8m0")
    if isinstance(recipe, Float8BlockScaling):
        qp = recipe.qparams(role)
        block = (1, 128) if recipe.block_dim(role) == 1 else (128, 128)
        return _scheme(dtype, fp8_max, block, "current", qp.amax_epsilon, qp.power_2_scale)
    raise TypeError(f"not a te_func recipe: {recipe!r} (use te_func.recipe.DelayedScaling, "
                    f"Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling or NVFP4BlockScaling, or None)")


for _role in ROLES:
    derivation(_role, lambda recipe, role=_role: _make_scheme(recipe, role))


def _scheme(dtype, fp8_max, block, rule, amax_epsilon=0.0, power_2_scale=False, margin=0, hadamard=False,
            stochastic_rounding=False) -> Scheme:
    # Every field given (see Quantized.tensorwise).
    return Scheme(dtype, fp8_max, block, rule, amax_epsilon, power_2_scale, margin, hadamard, stochastic_rounding)


def round_down_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Largest power of 2 <= scale (positive normal fp32), by clearing the mantissa bits (log2 may
    round up just below a power of 2)."""
    bits = scale.view(torch.int32) & -(1 << 23)  # keep sign and exponent
    return bits.view(torch.float32)


def scale_from_amax(amax: torch.Tensor, fp8_max: float, amax_epsilon: float = 0.0,
                    power_2_scale: bool = False) -> torch.Tensor:
    """Current scaling: scale = fp8_max / max(amax, eps); 1 where amax is 0, inf or NaN; the largest
    finite fp32 where the quotient overflows, so that the cast stays finite."""
    amax = amax.float()
    if amax_epsilon > 0:
        amax = torch.clamp(amax, min=amax_epsilon)
    # One rounded division, as TE (`python_float / tensor` rounds twice).
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    bad = (amax == 0) | ~torch.isfinite(amax)
    scale = torch.where(bad, 1.0, scale)
    return round_down_pow2(scale) if power_2_scale else scale


def e8m0_scale_inv(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """MXFP8: the smallest power of 2 >= fl(amax * fl(1/fp8_max)) as E8M0 bytes (uint8), exact on
    the fp32 bits; within [2**-127, 2**127], amax 0 gives 2**-127, NaN gives 0xFF."""
    ratio = amax.float() * torch.tensor(1.0 / fp8_max, dtype=torch.float32)
    bits = ratio.view(torch.int32)
    exponent = (bits >> 23) & 0xFF                  # biased; 0 for zero and denormals
    mantissa = bits & 0x7FFFFF
    # Round up unless a power of 2; a denormal ratio <= 2**-127 is covered by 2**-127.
    round_up = (mantissa != 0) & ~((exponent == 0) & (mantissa <= 0x400000))
    biased = torch.clamp(exponent + round_up.to(torch.int32), 0, 254)
    biased = torch.where(torch.isnan(ratio), 255, biased)  # 0xFF encodes NaN in E8M0
    return biased.to(torch.uint8)


def e8m0_to_float(bits: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) -> fp32 2**(bits - 127), exactly, NaN for 0xFF (torch's float8_e8m0fnu's)."""
    e = bits.to(torch.int32)
    value = torch.where(e == 0, 0x00400000, e << 23).view(torch.float32)
    return torch.where(e == 255, float("nan"), value)
