"""Checks shared by the norm-fused per-op functions."""
from __future__ import annotations

from ..ops.normalization import NORMALIZATIONS, NormConfig


def norm_config(layer: str, normalization: str, eps: float, zero_centered_gamma: bool) -> NormConfig:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"{layer}: unknown normalization {normalization!r}; use 'LayerNorm' or 'RMSNorm'")
    if not eps > 0:
        raise ValueError(f"{layer}: eps must be positive, got {eps}")
    return NormConfig(normalization, float(eps), bool(zero_centered_gamma))


def check_norm_params(layer: str, hidden: int, ln_weight, ln_bias, normalization: str):
    if tuple(ln_weight.shape) != (hidden,):
        raise ValueError(f"{layer}: layer_norm_weight must have shape ({hidden},) to normalize "
                         f"{hidden} features, got {tuple(ln_weight.shape)}")
    if normalization == "RMSNorm" and ln_bias is not None:
        raise ValueError(f"{layer}: RMSNorm has no bias; pass layer_norm_bias=None")
    if ln_bias is not None and tuple(ln_bias.shape) != (hidden,):
        raise ValueError(f"{layer}: layer_norm_bias must have shape ({hidden},), got {tuple(ln_bias.shape)}")
