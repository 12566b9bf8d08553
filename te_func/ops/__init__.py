"""Autograd Functions: tensors in, tensors out; no module, no dict, no global state."""
from .gemm_layer import GemmConfig, backward_gemm, forward_gemm
from .linear import linear_fp8

__all__ = ["GemmConfig", "backward_gemm", "forward_gemm", "linear_fp8"]
