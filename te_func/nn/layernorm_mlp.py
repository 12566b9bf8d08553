"""`te_func.nn.LayerNormMLP`: TE's LayerNormMLP as a parameter holder."""
from __future__ import annotations

import torch

from .. import functional as F
from ..functional.layernorm_mlp import LAYERNORM_MLP_GEMMS
from ..ops.activations import activation_spec, is_gated
from ._fused import add_norm_params, te_outputs
from .module import TEModule, make_param, te_init

__all__ = ["LayerNormMLP"]


class LayerNormMLP(TEModule):
    """y = fc2(act(fc1(norm(x)))), the GEMMs in FP8 under a recipe.

    Parameters as TE: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only), `fc1_weight`
    (ffn_hidden_size, hidden_size; twice as tall for gated activations), `fc1_bias`, `fc2_weight`
    (hidden_size, ffn_hidden_size), `fc2_bias`. Activations as TE's: gelu (tanh), geglu, glu, qgelu,
    qgeglu, relu, reglu, srelu, sreglu, silu, swiglu, clamped_swiglu (`activation_params`). Returns
    as LayerNormLinear's with return_bias (fc2_bias) / return_layernorm_output."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", activation: str = "gelu", activation_params: dict | None = None,
                 zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, return_bias: bool = False, params_dtype=None,
                 device=None):
        super().__init__()
        if hidden_size <= 0 or ffn_hidden_size <= 0:
            raise ValueError(f"LayerNormMLP: hidden_size and ffn_hidden_size must be positive, got "
                             f"{hidden_size}, {ffn_hidden_size}")
        activation_spec(activation, activation_params)      # refuses unknown names and params now
        self.activation, self.activation_params = activation, activation_params
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.return_bias, self.return_layernorm_output = return_bias, return_layernorm_output
        add_norm_params(self, "LayerNormMLP", hidden_size, eps, normalization, zero_centered_gamma,
                        params_dtype, device)
        fc1_width = 2 * ffn_hidden_size if is_gated(activation) else ffn_hidden_size
        self.fc1_weight = make_param((fc1_width, hidden_size), params_dtype, device, te_init())
        self.fc1_bias = make_param((fc1_width,), params_dtype, device) if bias else None
        self.fc2_weight = make_param((hidden_size, ffn_hidden_size), params_dtype, device, te_init())
        self.fc2_bias = make_param((hidden_size,), params_dtype, device) if bias else None

    def gemms(self):
        return LAYERNORM_MLP_GEMMS

    def forward(self, inp: torch.Tensor, *, is_first_microbatch: bool | None = None):
        out = self._run(F.layernorm_mlp, inp, self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight,
                        self.fc1_bias, self.fc2_weight, None if self.return_bias else self.fc2_bias, eps=self.eps,
                        normalization=self.normalization, activation=self.activation,
                        activation_params=self.activation_params,
                        zero_centered_gamma=self.zero_centered_gamma,
                        return_layernorm_output=self.return_layernorm_output, is_first_microbatch=is_first_microbatch)
        out, ln_out = out if self.return_layernorm_output else (out, None)
        return te_outputs(out, self.fc2_bias, ln_out, self.return_bias, self.return_layernorm_output)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, normalization={self.normalization}")
