"""`te_func.nn.Linear`: TE's Linear as a parameter holder."""
from __future__ import annotations

import torch

from .. import functional as F
from ..functional.linear import LINEAR_GEMMS
from .module import TEModule, make_param, te_init

__all__ = ["Linear"]


class Linear(TEModule):
    """y = x @ weight.T + bias, in FP8 under a recipe.

    Parameters as TE: `weight` (out_features, in_features), `bias` (out_features,).
    forward(inp (..., in_features), *, is_first_microbatch=None) -> (..., out_features),
    or `(out, bias)` with return_bias=True (the bias then not added, as in TE).
    """

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
        recipe, ws, ifm, commit = self._bind(is_first_microbatch)
        bias = None if self.return_bias else self.bias
        out, new_ws = F.linear(inp, self.weight, bias, recipe=recipe, workspace=ws, is_first_microbatch=ifm)
        commit(new_ws)
        if self.return_bias:
            return out, self.bias
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
