"""Triton kernel of weight-only FP8: out (M, N) = (x (M, K) @ w (N, K).T) * scale_inv + bias.

w is a tensor-wise FP8 cast, x bf16 or fp16. At a few tokens the GEMM is bound by reading its
weight: the kernel reads the FP8 bytes once and widens them in registers (exact), multiplies in
fp32, and applies scale and bias before the one rounding, as te_func.gemm's epilogue does. The
weight is the MMA's left operand (out.T = w @ x.T), so its rows fill the 64-row tiles; with too
few row tiles, K is split in ranges (by shape only: a shape always sums in the same order).
The torch reference is te_func.gemm's `_weight_only_reference`. Indices are int32."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETED = tl.constexpr(INTERPRETED)
MAX_TOKEN_BLOCK = 64    # tokens per program: a decode batch fits one block, more take several
K_GRANULE = 256         # splits of K are multiples of every tensor-core config's BLOCK_K: the same sums in each
NOMINAL_BLOCK_N = 128   # the weight rows per program the split is sized for
# One token takes the CUDA-core kernel, in one fixed config: the same bits in every process.
GEMV = {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 3}    # swept on an H200


def _configs():
    if INTERPRETED:     # the interpreter runs every candidate: one is enough there
        return [triton.Config({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4)]
    # Every config sums K in 16-wide MMA steps, in order: the choice changes the speed, not the bits.
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": 128}, num_warps=4, num_stages=s) for n in (64, 128) for s in (3, 5)]


@triton.autotune(configs=_configs(), key=["T_BUCKET", "N", "K", "K_PER_SPLIT"])
@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, scale_inv_ptr, bias_ptr, out_ptr, M, N, K, K_PER_SPLIT, T_BUCKET,
                        SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid_n, pid_k, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)          # of w, = columns of out
    tokens = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)        # rows of x and of out
    ks = tl.arange(0, BLOCK_K)
    k_end = tl.minimum(K, (pid_k + 1) * K_PER_SPLIT)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)    # out.T's tile
    for k0 in range(pid_k * K_PER_SPLIT, k_end, BLOCK_K):
        k = k0 + ks
        w = tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < N) & (k[None, :] < k_end), other=0.0)
        # x's tile read as (BLOCK_K, BLOCK_T): the transpose the product needs, by addressing.
        x_t = tl.load(x_ptr + tokens[None, :] * K + k[:, None], mask=(tokens[None, :] < M) & (k[:, None] < k_end),
                      other=0.0)
        if _INTERPRETED:    # Triton's interpreter multiplies bf16 tiles wrongly: fp32 there
            acc = tl.dot(w.to(tl.float32), x_t.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(x_t.dtype), x_t, acc)
    where = (rows[:, None] < N) & (tokens[None, :] < M)
    if SPLIT == 1:
        acc = acc * tl.load(scale_inv_ptr)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + tokens[None, :] * N + rows[:, None], acc.to(out_ptr.dtype.element_ty), mask=where)
    else:   # this split's fp32 sums, (SPLIT, M, N)
        tl.store(out_ptr + (pid_k * M + tokens[None, :]) * N + rows[:, None], acc, mask=where)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_inv_ptr, bias_ptr, out_ptr, N, K, K_PER_SPLIT,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token (M = 1): w's rows times x on the CUDA cores, no MMA tile to fill."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_end = tl.minimum(K, (pid_k + 1) * K_PER_SPLIT)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(pid_k * K_PER_SPLIT, k_end, BLOCK_K):
        k = k0 + ks
        w = tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < N) & (k[None, :] < k_end), other=0.0)
        x = tl.load(x_ptr + k, mask=k < k_end, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if SPLIT == 1:
        acc = acc * tl.load(scale_inv_ptr)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < N)
    else:
        tl.store(out_ptr + pid_k * N + rows, acc, mask=rows < N)


@triton.jit
def _sum_splits_kernel(partial_ptr, scale_inv_ptr, bias_ptr, out_ptr, numel, N, SPLIT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(partial_ptr + i, mask=i < numel, other=0.0)
    for s in tl.static_range(1, SPLIT):       # in order: the same bits every call
        acc += tl.load(partial_ptr + s * numel + i, mask=i < numel, other=0.0)
    acc = acc * tl.load(scale_inv_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=i < numel, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=i < numel)


def _sm_count(device: torch.device) -> int:
    if INTERPRETED:     # a CPU: any small number exercises the splits
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def weight_only_mm(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) bf16/fp16, w (N, K) FP8, scale_inv () fp32, bias (N,) or None -> (M, N) in x's dtype."""
    (m, k), n = x.shape, w.shape[0]
    has_bias = bias is not None
    bias = scale_inv if bias is None else bias      # any pointer: the kernels do not read it
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 1:
        split, k_per_split = _splits(triton.cdiv(n, GEMV["BLOCK_N"]), k, x.device)
        target = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
        _gemv_kernel[(triton.cdiv(n, GEMV["BLOCK_N"]), split)](x, w, scale_inv, bias, target, n, k, k_per_split,
                                                                 SPLIT=split, HAS_BIAS=has_bias, **GEMV)
    else:
        block_t = min(MAX_TOKEN_BLOCK, max(16, triton.next_power_of_2(m)))     # tl.dot takes >= 16
        token_blocks = triton.cdiv(m, block_t)
        split, k_per_split = _splits(triton.cdiv(n, NOMINAL_BLOCK_N) * token_blocks, k, x.device)
        target = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)

        def grid(meta):
            return triton.cdiv(n, meta["BLOCK_N"]), split, token_blocks
        _weight_only_kernel[grid](x, w, scale_inv, bias, target, m, n, k, k_per_split, block_t, SPLIT=split,
                                  HAS_BIAS=has_bias, BLOCK_T=block_t)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](target, scale_inv, bias, out, m * n, n, SPLIT=split,
                                                          HAS_BIAS=has_bias, BLOCK=block)
    return out


def _splits(tiles: int, k: int, device: torch.device) -> tuple[int, int]:
    """(ranges K is cut into, their length): enough programs for two per SM, each range a
    multiple of K_GRANULE and at least two of them."""
    split = max(1, min(-(-2 * _sm_count(device) // tiles), k // (2 * K_GRANULE), 16))
    k_per_split = triton.cdiv(triton.cdiv(k, split), K_GRANULE) * K_GRANULE
    return triton.cdiv(k, k_per_split), k_per_split
