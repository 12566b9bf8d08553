"""What the norm-fused modules share: their norm parameters and TE's return order."""
from __future__ import annotations

from ..functional._fused import norm_config
from .module import make_param


def _ones(t):
    t.fill_(1.0)


def add_norm_params(module, layer: str, hidden: int, eps: float, normalization: str,
                    zero_centered_gamma: bool, params_dtype, device):
    """Checks the norm options and adds `layer_norm_weight` and (LayerNorm only) `layer_norm_bias`."""
    norm_config(layer, normalization, eps, zero_centered_gamma)   # clear errors for bad options
    module.eps, module.normalization, module.zero_centered_gamma = eps, normalization, zero_centered_gamma
    # zero_centered_gamma stores gamma - 1, so its identity init is zeros.
    module.layer_norm_weight = make_param((hidden,), params_dtype, device,
                                          None if zero_centered_gamma else _ones)
    module.layer_norm_bias = make_param((hidden,), params_dtype, device) if normalization == "LayerNorm" else None


def te_outputs(out, bias, ln_out, return_bias: bool, return_layernorm_output: bool):
    """TE's order: out, then the bias (not added) with return_bias, then ln_out."""
    extra = ((bias,) if return_bias else ()) + ((ln_out,) if return_layernorm_output else ())
    return (out, *extra) if extra else out
