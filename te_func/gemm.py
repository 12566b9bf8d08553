"""FP8 GEMM dispatch: `torch._scaled_mm` where the device has it, exact emulation elsewhere.

Every GEMM here is `a @ b.T` with both operands quantized along K (their
last dim), so a forward, an input-gradient and a weight-gradient GEMM all
take the same form and the caller only picks which casts to pair.
"""
from __future__ import annotations

import functools

import torch

from .quant import Quantized, dequantize

__all__ = ["gemm", "native_fp8_gemm_available"]


@functools.lru_cache(maxsize=None)
def _device_has_fp8_gemm(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def native_fp8_gemm_available(device: torch.device) -> bool:
    """True on CUDA GPUs with FP8 tensor cores (Ada, Hopper and newer)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _device_has_fp8_gemm(device.index if device.index is not None else torch.cuda.current_device())


def _use_scaled_mm(a: Quantized, b: Quantized) -> bool:
    if a.block is not None or b.block is not None:
        # cuBLAS on Hopper refuses MXFP8's E8M0 blocks; blocks are emulated.
        return False
    if a.data.dtype == torch.float8_e5m2 and b.data.dtype == torch.float8_e5m2:
        return False  # no E5M2 x E5M2 kernel
    if torch._C._functorch.is_batchedtensor(a.data) or torch._C._functorch.is_batchedtensor(b.data):
        return False  # under vmap: _scaled_mm has no batching rule
    k, n = a.data.shape[-1], b.data.shape[0]
    if k % 16 or n % 16:
        return False  # _scaled_mm needs K and N multiples of 16
    return native_fp8_gemm_available(a.data.device)


def gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype, *, fast_accum: bool = True) -> torch.Tensor:
    """(M, K) x (N, K) -> (M, N) = dequantize(a) @ dequantize(b).T, in `out_dtype`.

    On FP8 GPUs with tensor-wise scales this is one `torch._scaled_mm`
    (`fast_accum` as TE: on for the forward GEMM, off for the backward ones).
    Elsewhere it dequantizes to fp32 and accumulates in fp32: the same
    function, exactly, up to accumulation order.
    """
    if a.data.shape[-1] != b.data.shape[-1]:
        raise ValueError(f"GEMM reduction dims differ: a {tuple(a.data.shape)}, b {tuple(b.data.shape)}")
    if _use_scaled_mm(a, b):
        return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv,
                                out_dtype=out_dtype, use_fast_accum=fast_accum)
    return (dequantize(a) @ dequantize(b).t()).to(out_dtype)
