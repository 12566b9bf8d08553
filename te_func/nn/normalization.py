"""`te_func.nn.LayerNorm` and `RMSNorm`: TE's norms as parameter holders."""
from __future__ import annotations

import torch

from .. import functional as F
from .module import TEModule, make_param

__all__ = ["LayerNorm", "RMSNorm"]


def _ones(t):
    t.fill_(1.0)


class _Norm(TEModule):
    def __init__(self, hidden_size: int, eps: float, zero_centered_gamma: bool, params_dtype, device, bias: bool):
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"{type(self).__name__}: hidden_size must be positive, got {hidden_size}")
        self.hidden_size, self.eps, self.zero_centered_gamma = hidden_size, eps, zero_centered_gamma
        # zero_centered_gamma stores gamma - 1, so its identity init is zeros.
        self.weight = make_param((hidden_size,), params_dtype, device, None if zero_centered_gamma else _ones)
        self.bias = make_param((hidden_size,), params_dtype, device) if bias else None

    # High precision under every recipe, as TE: nothing to cache.
    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * gamma + bias over the last dim, in high precision.
    Parameters as TE: `weight` (gamma, or gamma - 1 with zero_centered_gamma), `bias` (hidden_size,)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, zero_centered_gamma: bool = False,
                 params_dtype=None, device=None):
        super().__init__(hidden_size, eps, zero_centered_gamma, params_dtype, device, bias=True)

    def forward(self, inp: torch.Tensor, *, is_first_microbatch: bool | None = None) -> torch.Tensor:
        return self._run(F.layer_norm, inp, self.weight, self.bias, eps=self.eps,
                         zero_centered_gamma=self.zero_centered_gamma, is_first_microbatch=is_first_microbatch)


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x**2) + eps) * gamma over the last dim, in high precision; `weight` as TE's."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, zero_centered_gamma: bool = False,
                 params_dtype=None, device=None):
        super().__init__(hidden_size, eps, zero_centered_gamma, params_dtype, device, bias=False)

    def forward(self, inp: torch.Tensor, *, is_first_microbatch: bool | None = None) -> torch.Tensor:
        return self._run(F.rms_norm, inp, self.weight, eps=self.eps, zero_centered_gamma=self.zero_centered_gamma,
                         is_first_microbatch=is_first_microbatch)
