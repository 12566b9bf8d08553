"""Fused Triton kernels for the eager CUDA path (optional: Triton is imported lazily).

Callers (te_func.quant, te_func.ops, te_func.gemm) try these first and keep their torch code
where they return None; `dispatch` says when they run and how close their results are."""
import torch

from . import dispatch
from .dispatch import (activation, cast_from_partials, cast_kernels_available, delayed_record, delayed_update,
                       device_capability, fp8_capable, gelu_partials, grouped_mm, norm_backward, norm_forward,
                       partial_rows, set_cast_kernels, tensorwise_cast, weight_only_mm)

__all__ = ["activation", "cast_from_partials", "cast_kernels_available", "delayed_record", "delayed_update",
           "device_capability", "fp8_capable", "gelu_partials", "grouped_mm", "norm_backward", "norm_forward",
           "partial_rows", "set_cast_kernels", "tensorwise_cast", "weight_only_mm"]

# Where the kernels can run, their ops exist from `import te_func` on (for exported programs).
if torch.cuda.is_available():
    dispatch._kernels("cast")
