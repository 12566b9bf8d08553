"""Fused Triton kernels for the eager CUDA path (optional: Triton is imported lazily).

`te_func.quant` calls `tensorwise_cast` first for every tensor-wise FP8 cast and
keeps its torch code where it returns None; the results are bit-identical.
"""
from .dispatch import cast_kernels_available, set_cast_kernels, tensorwise_cast

__all__ = ["cast_kernels_available", "set_cast_kernels", "tensorwise_cast"]
