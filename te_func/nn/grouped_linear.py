"""`te_func.nn.GroupedLinear`: TE's GroupedLinear as a parameter holder."""
from __future__ import annotations

import torch

from .. import functional as F
from ..functional.grouped_linear import grouped_gemms
from .module import TEModule, make_param, te_init

__all__ = ["GroupedLinear"]


class GroupedLinear(TEModule):
    """num_gemms Linear layers applied to consecutive groups of tokens (e.g. MoE experts).

    Parameters as TE: `weight0..weight{n-1}` (out_features, in_features), `bias0..` (out_features,).
    forward(inp (tokens, in_features), m_splits, *, is_first_microbatch=None) -> (tokens, out_features):
    group i is the m_splits[i] tokens after the previous groups' (a list of ints or a 1-D integer
    tensor; zeros allowed, summing to the token count). return_bias=True returns `(out, [bias0, ...])`
    without adding them, as TE does."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype=None, device=None, return_bias: bool = False):
        super().__init__()
        if num_gemms <= 0 or in_features <= 0 or out_features <= 0:
            raise ValueError(f"GroupedLinear: num_gemms, in_features and out_features must be positive, got "
                             f"{num_gemms}, {in_features}, {out_features}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", make_param((out_features, in_features), params_dtype,
                                                             device, te_init()))
            self.register_parameter(f"bias{i}", make_param((out_features,), params_dtype, device)
                                    if bias else None)

    def _weights(self):
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _biases(self):
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]

    def gemms(self):
        return grouped_gemms(self.num_gemms)

    def forward(self, inp: torch.Tensor, m_splits, *, is_first_microbatch: bool | None = None):
        biases = self._biases()
        out = self._run(F.grouped_linear, inp, m_splits, self._weights(),
                        [None] * self.num_gemms if self.return_bias else biases,
                        is_first_microbatch=is_first_microbatch)
        return (out, biases) if self.return_bias else out

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}")
