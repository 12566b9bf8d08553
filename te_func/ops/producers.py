"""A forward-only LayerNormMLP's two current-scaling casts at few tokens, one launch each.

Under Float8CurrentScaling the casts of fc1's input (the norm's output) and of fc2's input (the
GELU's output) each wait for the amax of the whole tensor. At decode sizes that wait costs more
than the bytes: three or four launches per cast, where `te_func.kernels.producers` makes the
tensor and its cast in one (docs/inference.md). `norm_cast` and `gelu_cast` return the cast where
those kernels run (a CUDA device with FP8 conversions, few enough tokens, a tensor-wise current
scheme), else None and the caller goes its usual way. Their bits are those of that way's eager
kernels (the norm kernel, the GELU kernel, the cast), compiled or not: each is an op of its own,
which compiled graphs call as they are.

Only for calls that keep nothing for a backward (te_func.freeze): the norm's and the GELU's
high-precision outputs are never written.
"""
from __future__ import annotations

import torch

from .. import kernels
from ..quant import Quantized, Scheme, quantize_scheme
from ..quant.tensor import batched_by_vmap
from .activations import Activation, activation_with_amax
from .normalization import NormConfig, norm_output

__all__ = ["fits", "gelu_cast", "norm_cast"]


@torch.library.custom_op("te_func::norm_cast", mutates_args=())
def _norm_cast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, normalization: str, eps: float,
               zero_centered_gamma: bool, dtype: torch.dtype, fp8_max: float, amax_epsilon: float,
               power_2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale_inv) of the cast of norm(x), x (tokens, hidden)."""
    cfg = NormConfig(normalization, eps, zero_centered_gamma)
    made = kernels.norm_cast(x, weight, bias, eps, cfg.rms, zero_centered_gamma, dtype, fp8_max, amax_epsilon,
                             power_2_scale)
    if made is None:        # the kernels were turned off since the call was traced: the usual way
        y, _, _, amax = norm_output(x, weight, bias, cfg)
        made = _tensorwise(y, dtype, fp8_max, amax_epsilon, power_2_scale, amax)
    return made


@_norm_cast.register_fake
def _(x, weight, bias, normalization, eps, zero_centered_gamma, dtype, fp8_max, amax_epsilon, power_2_scale):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("te_func::gelu_cast", mutates_args=())
def _gelu_cast(x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, fp8_max: float,
               amax_epsilon: float, power_2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale_inv) of the cast of gelu(x + bias), x (tokens, ffn)."""
    made = kernels.gelu_cast(x, bias, dtype, fp8_max, amax_epsilon, power_2_scale)
    if made is None:
        y, amax, _, _ = activation_with_amax(Activation("gelu"), x, bias)
        made = _tensorwise(y, dtype, fp8_max, amax_epsilon, power_2_scale, amax)
    return made


@_gelu_cast.register_fake
def _(x, bias, dtype, fp8_max, amax_epsilon, power_2_scale):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((), dtype=torch.float32)


def _tensorwise(y, dtype, fp8_max, amax_epsilon, power_2_scale, amax):
    q, _ = quantize_scheme(y, Scheme(dtype, fp8_max, None, "current", amax_epsilon, power_2_scale), amax=amax)
    return q.data, q.scale_inv


def fits(x: torch.Tensor, s: Scheme, kind: str) -> bool:
    """Whether `norm_cast` (kind "norm") or `gelu_cast` ("gelu") runs for x cast by scheme `s`.
    Not for symbolic sizes (a dynamic token count, torch.export's Dim): the size test would be a
    guard that splits the graph, or that an export's declared range forbids."""
    return (s.rule == "current" and s.block is None and not s.nvfp4 and x.device.type != "meta"
            and all(isinstance(d, int) for d in x.shape) and not batched_by_vmap(x)
            and kernels.producer_fits(x, kind))


def norm_cast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: NormConfig,
              s: Scheme) -> Quantized | None:
    """The cast by scheme `s` of norm(x) (`norm_output`'s, in x's dtype), x (tokens, hidden), in one
    launch; None where that does not run here."""
    if not fits(x, s, "norm"):
        return None
    return Quantized(*_norm_cast(x, weight, bias, cfg.normalization, cfg.eps, cfg.zero_centered_gamma, s.dtype,
                                 s.fp8_max, s.amax_epsilon, s.power_2_scale))


def gelu_cast(act: Activation, x: torch.Tensor, bias: torch.Tensor | None, s: Scheme) -> Quantized | None:
    """The cast by scheme `s` of act(x + bias) (`activation_with_amax`'s), x (tokens, ffn), in one
    launch; None where that does not run here (also for activations other than the GELU)."""
    if act.name != "gelu" or not fits(x, s, "gelu"):
        return None
    return Quantized(*_gelu_cast(x, None if bias is None else bias.to(x.dtype), s.dtype, s.fp8_max, s.amax_epsilon,
                                 s.power_2_scale))
