"""Fused Triton kernels for the eager CUDA path (optional: Triton is imported lazily).

`te_func.quant` calls `tensorwise_cast` first for every tensor-wise FP8 cast and
`delayed_update` / `delayed_record` for DelayedScaling's state, te_func.ops
`activation` for LayerNormMLP's GELU and `norm_forward` / `norm_backward` for the
norms, te_func.gemm `weight_only_mm` for weight-only FP8's GEMM (compiled calls
too), and keep their torch code where these return None: the casts, the state and
the GELU give the same bits, the norms the same to fp32 rounding (their row sums'
order), the weight-only GEMM the same up to the order of its fp32 sums.
"""
from .dispatch import (activation, cast_kernels_available, delayed_record, delayed_update, norm_backward,
                       norm_forward, set_cast_kernels, tensorwise_cast, weight_only_mm)

__all__ = ["activation", "cast_kernels_available", "delayed_record", "delayed_update", "norm_backward",
           "norm_forward", "set_cast_kernels", "tensorwise_cast", "weight_only_mm"]
