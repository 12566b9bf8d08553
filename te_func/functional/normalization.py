"""`layer_norm` and `rms_norm`: TE's LayerNorm and RMSNorm as functions.

They compute in high precision under every recipe, as TE's do, and keep no
workspace entries; they take `recipe` / `workspace` only so that every
per-op function has the same signature.
"""
from __future__ import annotations

import torch

from ..ops.normalization import norm_reference
from ._common import check_input
from ._fused import check_norm_params, norm_config

__all__ = ["layer_norm", "rms_norm"]


def _norm(layer, normalization, inp, weight, bias, eps, zero_centered_gamma, recipe, workspace):
    hidden = weight.shape[-1] if weight.dim() else 0
    check_input(layer, inp, hidden, {"weight": weight, "bias": bias}, recipe)
    check_norm_params(layer, hidden, weight, bias, normalization)
    cfg = norm_config(layer, normalization, eps, zero_centered_gamma)
    # The same under every recipe: torch's own layer_norm / rms_norm.
    return norm_reference(inp, weight, bias, cfg), ({} if workspace is None else workspace)


def layer_norm(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               eps: float = 1e-5, zero_centered_gamma: bool = False, recipe=None,
               workspace: dict | None = None, is_first_microbatch: bool | None = None,
               update_state: bool | None = None):
    """y = (x - mean) / sqrt(var + eps) * gamma + bias over the last dim (gamma = weight, or 1 + weight
    with zero_centered_gamma), in fp32 (float64 stays), returned in inp's dtype with `workspace`."""
    return _norm("LayerNorm", "LayerNorm", inp, weight, bias, eps, zero_centered_gamma, recipe, workspace)


def rms_norm(inp: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-5, zero_centered_gamma: bool = False,
             recipe=None, workspace: dict | None = None, is_first_microbatch: bool | None = None,
               update_state: bool | None = None):
    """y = x / sqrt(mean(x**2) + eps) * gamma over the last dim; as `layer_norm` otherwise."""
    return _norm("RMSNorm", "RMSNorm", inp, weight, None, eps, zero_centered_gamma, recipe, workspace)
