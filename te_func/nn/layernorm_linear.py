"""`te_func.nn.LayerNormLinear`: TE's LayerNormLinear as a parameter holder."""
from __future__ import annotations

import torch

from .. import functional as F
from ..functional.layernorm_linear import LAYERNORM_LINEAR_GEMMS
from ._fused import add_norm_params, te_outputs
from .module import TEModule, make_param, te_init

__all__ = ["LayerNormLinear"]


class LayerNormLinear(TEModule):
    """y = norm(x) @ weight.T + bias, the GEMMs in FP8 under a recipe (the norm in high precision).

    Parameters as TE: `layer_norm_weight`, `layer_norm_bias` (in_features,; LayerNorm only), `weight`
    (out_features, in_features), `bias`. forward(inp (..., in_features), *, is_first_microbatch=None);
    as in TE, `(out, bias)` with return_bias, `(out, ln_out)` with return_layernorm_output, or both."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, return_bias: bool = False, params_dtype=None,
                 device=None):
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"LayerNormLinear: in_features and out_features must be positive, got "
                             f"{in_features}, {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.return_bias, self.return_layernorm_output = return_bias, return_layernorm_output
        add_norm_params(self, "LayerNormLinear", in_features, eps, normalization, zero_centered_gamma,
                        params_dtype, device)
        self.weight = make_param((out_features, in_features), params_dtype, device, te_init())
        self.bias = make_param((out_features,), params_dtype, device) if bias else None

    def gemms(self):
        return LAYERNORM_LINEAR_GEMMS

    def forward(self, inp: torch.Tensor, *, is_first_microbatch: bool | None = None):
        out = self._run(F.layernorm_linear, inp, self.layer_norm_weight, self.layer_norm_bias, self.weight,
                        None if self.return_bias else self.bias, eps=self.eps, normalization=self.normalization,
                        zero_centered_gamma=self.zero_centered_gamma,
                        return_layernorm_output=self.return_layernorm_output, is_first_microbatch=is_first_microbatch)
        out, ln_out = out if self.return_layernorm_output else (out, None)
        return te_outputs(out, self.bias, ln_out, self.return_bias, self.return_layernorm_output)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, normalization={self.normalization}")
