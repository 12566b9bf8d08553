"""Scaling math, quantize / dequantize, and cached weight casts."""
from .scheme import Scheme, scheme_for, scale_from_amax, e8m0_scale_inv, round_down_pow2
from .tensor import (DelayedState, Quantized, dequantize, quantize, quantize_scheme,
                     quantize_with_transpose, transpose)
from .weight import CAST_FIELDS, Quantizer, WeightCast, quantize_weight, weight_cast_spec

__all__ = ["Scheme", "scheme_for", "scale_from_amax", "e8m0_scale_inv", "round_down_pow2",
           "DelayedState", "Quantized", "dequantize", "quantize", "quantize_scheme",
           "quantize_with_transpose", "transpose", "CAST_FIELDS", "Quantizer", "WeightCast",
           "quantize_weight", "weight_cast_spec"]
