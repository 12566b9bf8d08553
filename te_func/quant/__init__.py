"""Scaling math, quantize / dequantize, cached weight casts, and the workspace format."""
from . import nvfp4
from .nvfp4 import advance_rng, init_rng_state
from .scheme import Scheme, scheme_for, scale_from_amax, e8m0_scale_inv, e8m0_to_float, round_down_pow2
from .tensor import (BatchAmax, DelayedState, Quantized, cast_runs, dequantize, quantize, quantize_scheme,
                     quantize_with_transpose, record_run_amaxes, run_amaxes, run_ids, transpose)
from .delayed import delayed_update, init_delayed_state
from .workspace import CAST_FIELDS, Entry, Gemm, GemmWorkspace, WeightCast
from .weight import Quantizer, cast_weight, quantize_weight
from .lowering import Lowering, lower

__all__ = ["Scheme", "scheme_for", "scale_from_amax", "e8m0_scale_inv", "e8m0_to_float", "round_down_pow2",
           "BatchAmax", "DelayedState", "Quantized", "dequantize", "quantize", "quantize_scheme",
           "quantize_with_transpose", "transpose", "run_ids", "run_amaxes", "record_run_amaxes", "cast_runs",
           "delayed_update", "init_delayed_state",
           "CAST_FIELDS", "Entry", "Gemm", "GemmWorkspace", "WeightCast", "Quantizer", "cast_weight",
           "quantize_weight", "nvfp4", "init_rng_state", "advance_rng", "Lowering", "lower"]
