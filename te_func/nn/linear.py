"""`te_func.nn.Linear`: TE's Linear as a parameter holder."""
from __future__ import annotations

import torch

from .. import functional as F
from ..functional.linear import LINEAR_GEMMS
from .module import TEModule, make_param, te_init

__all__ = ["Linear", "TransposedLinear"]


class Linear(TEModule):
    """y = x @ weight.T + bias, in FP8 under a recipe; parameters and return_bias as TE's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, params_dtype=None,
                 device=None, return_bias: bool = False):
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear: in_features and out_features must be positive, got "
                             f"{in_features}, {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.return_bias = return_bias
        self.weight = make_param((out_features, in_features), params_dtype, device, te_init())
        self.bias = make_param((out_features,), params_dtype, device) if bias else None

    def gemms(self):
        return LINEAR_GEMMS

    def forward(self, inp: torch.Tensor, *, is_first_microbatch: bool | None = None):
        bias = None if self.return_bias else self.bias
        out = self._run(F.linear, inp, self.weight, bias, is_first_microbatch=is_first_microbatch)
        return (out, self.bias) if self.return_bias else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class TransposedLinear(Linear):
    """A Linear whose `weight` is stored (in, out), as transformers' Conv1D: y = x @ weight + bias;
    the GEMM, its cast and its entries are those of weight.T."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, params_dtype=None,
                 device=None, return_bias: bool = False):
        super().__init__(in_features, out_features, bias, params_dtype=params_dtype, device=device,
                         return_bias=return_bias)
        self.weight = make_param((in_features, out_features), params_dtype, device, te_init())

    def gemm_weight(self, name: str, value: torch.Tensor | None = None) -> torch.Tensor:
        return super().gemm_weight(name, value).t()         # (out_features, in_features), a view

    def forward(self, inp: torch.Tensor, *, is_first_microbatch: bool | None = None):
        bias = None if self.return_bias else self.bias
        out = self._run(F.linear, inp, self.weight.t(), bias, is_first_microbatch=is_first_microbatch)
        return (out, self.bias) if self.return_bias else out
