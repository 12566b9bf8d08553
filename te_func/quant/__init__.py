"""Scaling math, quantize / dequantize, and cached weight casts."""
from .scheme import Scheme, scheme_for, scale_from_amax, e8m0_scale_inv, round_down_pow2
from .tensor import (DelayedState, Quantized, dequantize, quantize, quantize_scheme,
                     quantize_with_transpose, transpose)
from .weight import CAST_FIELDS, Quantizer, WeightCast, quantize_weight, weight_cast_spec
from .delayed import GRAD_HISTORY, delayed_state_spec, delayed_update, init_delayed_state

__all__ = ["Scheme", "scheme_for", "scale_from_amax", "e8m0_scale_inv", "round_down_pow2",
           "DelayedState", "Quantized", "dequantize", "quantize", "quantize_scheme",
           "quantize_with_transpose", "transpose", "CAST_FIELDS", "Quantizer", "WeightCast",
           "quantize_weight", "weight_cast_spec", "GRAD_HISTORY", "delayed_state_spec",
           "delayed_update", "init_delayed_state"]
