"""Fused Triton kernels for the eager CUDA path (optional: Triton is imported lazily).

`te_func.quant` calls `tensorwise_cast` first for every tensor-wise FP8 cast and
`delayed_update` / `delayed_record` for DelayedScaling's state, te_func.ops
`activation` for LayerNormMLP's GELU and `norm_forward` / `norm_backward` for the
norms, te_func.gemm `weight_only_mm` for weight-only FP8's GEMM (compiled calls
too), and under torch.compile `partial_rows` / `gelu_partials` / `cast_from_partials` for
current scaling's cast of a small tensor; all keep their torch code where these return None:
the casts, the state and the GELU give the same bits, the norms the same to fp32
rounding (their row sums' order), the weight-only GEMM the same up to the order of
its fp32 sums.
"""
import torch

from . import dispatch
from .dispatch import (activation, cast_from_partials, cast_kernels_available, delayed_record, delayed_update,
                       device_capability, fp8_capable, gelu_partials, norm_backward, norm_forward, partial_rows,
                       set_cast_kernels, tensorwise_cast, weight_only_mm)

__all__ = ["activation", "cast_from_partials", "cast_kernels_available", "delayed_record", "delayed_update",
           "device_capability", "fp8_capable", "gelu_partials", "norm_backward", "norm_forward", "partial_rows",
           "set_cast_kernels", "tensorwise_cast", "weight_only_mm"]

# Where the kernels can run, their ops (te_func::cast_from_partials, te_func::gelu_partials) exist from
# `import te_func` on: a program exported with them runs in a process that has imported te_func.
if torch.cuda.is_available():
    dispatch._kernels("cast")
