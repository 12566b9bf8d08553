"""Triton kernel of the grouped FP8 GEMM: G GEMMs `a_g @ b_g.T`, each scaled by its own pair of
tensor-wise scale_invs, in one launch.

Three layouts of the groups:
- batched: a (G, M, K), b (G, N, K) -> (G, M, N); a group stride of 0 shares an operand (or a
  scale) among the groups. A vmapped weight-gradient GEMM, an ensemble member's forward.
- offsets: a (T, K) whose rows are cut into G runs by `offs` (G,) int32, the runs' ends on the
  device (a MoE layer's tokens sorted by expert), b (G, N, K) -> (T, N). No host sync: the grid
  covers every run's tiles (at most cdiv(T, BLOCK_M) + G of them) and each program finds its run
  by walking `offs`; the programs past the last tile return at once.
- runs along K: a (M, T), b (N, T) whose columns are cut into G runs by `offs` -> (G, M, N), each
  group the product over its run (a MoE layer's weight gradients: dW_g = dY_g.T @ X_g); an
  empty run gives zeros.

Both operands are FP8 (E4M3 or E5M2, mixed: the tensor cores take either pair), read K-major,
multiplied on the FP8 tensor cores with fp32 accumulation; the epilogue scales by
scale_a[g] * scale_b[g], adds the bias and rounds once, as te_func.gemm's epilogue does. The sums
run in another order than cuBLAS's, so the bits differ from a loop of `torch._scaled_mm` by the
rounding of the tensor cores' accumulation (a K tile's products are summed with less than fp32's
precision, on these tensor cores as in cuBLAS). Indices are int64 where they cross a group."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETED = tl.constexpr(INTERPRETED)


def _configs():
    if INTERPRETED:     # the interpreter runs every candidate: one is enough there
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4)]
    # FP8 tiles for Hopper's tensor cores (K-major operands, 128-deep K steps): picked per shape.
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for m, n, k, w, s in ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3),
                                  (256, 128, 128, 8, 3), (128, 128, 64, 4, 4), (64, 128, 128, 4, 4),
                                  (64, 256, 128, 4, 3))]


@triton.jit
def _dot(a, b, acc, FAST_ACCUM: tl.constexpr):
    if _INTERPRETED:    # the interpreter has no FP8 product: the same values in fp32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif FAST_ACCUM:    # the tensor cores' own accumulation over all of K
        return tl.dot(a, b, acc)
    else:               # a K tile's sum added in fp32, as cuBLAS does with fast accumulation off
        return acc + tl.dot(a, b)


@triton.jit
def _tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """The (row tile, column tile) program `pid` computes, GROUP_M row tiles at a time across all
    column tiles: the programs running together read GROUP_M row tiles and every column tile, which
    stay in L2, instead of every row tile once per column tile (column-major order would re-read
    a 117 MB operand 32 times at a Mixtral expert's weight gradient)."""
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.autotune(configs=_configs(), key=["M", "N", "K", "G", "OFFSETS", "FAST_ACCUM"])
@triton.jit
def _grouped_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, offs_ptr, out_ptr, M, N, K, G,
                    a_group_stride, b_group_stride, sa_group_stride, sb_group_stride, bias_group_stride,
                    OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_ACCUM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr = 8):
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M + (G if OFFSETS else 0)   # as the grid counts them
    pid_m, pid_n = _tile(tl.program_id(0), tiles_m, (N + BLOCK_N - 1) // BLOCK_N, GROUP_M)
    if OFFSETS:
        # Which run's which row tile: walk the runs' tile counts (G scalar loads, from cache).
        group = tl.full([], -1, tl.int32)
        row0 = tl.full([], 0, tl.int32)
        row_end = tl.full([], 0, tl.int32)
        start = tl.full([], 0, tl.int32)
        tiles_before = tl.full([], 0, tl.int32)
        for g in range(0, G):
            end = tl.load(offs_ptr + g)
            tiles = (end - start + BLOCK_M - 1) // BLOCK_M
            inside = (pid_m >= tiles_before) & (pid_m < tiles_before + tiles)
            group = tl.where(inside, g, group)
            row0 = tl.where(inside, start + (pid_m - tiles_before) * BLOCK_M, row0)
            row_end = tl.where(inside, end, row_end)
            tiles_before += tiles
            start = end
        if group < 0:
            return
        out_base = out_ptr
    else:
        group = tl.program_id(1)
        row0 = pid_m * BLOCK_M
        row_end = M
        out_base = out_ptr + group.to(tl.int64) * M * N
    a_base = a_ptr + group.to(tl.int64) * a_group_stride
    b_base = b_ptr + group.to(tl.int64) * b_group_stride
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < row_end
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(a_base + rows[:, None].to(tl.int64) * K + k[None, :], mask=row_ok[:, None] & (k[None, :] < K),
                    other=0.0)
        # b's tile read as (BLOCK_K, BLOCK_N): the transpose the product needs, by addressing.
        b = tl.load(b_base + cols[None, :].to(tl.int64) * K + k[:, None], mask=col_ok[None, :] & (k[:, None] < K),
                    other=0.0)
        acc = _dot(a, b, acc, FAST_ACCUM)
    acc = acc * (tl.load(sa_ptr + group * sa_group_stride) * tl.load(sb_ptr + group * sb_group_stride))
    if HAS_BIAS:
        bias = tl.load(bias_ptr + group.to(tl.int64) * bias_group_stride + cols, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    where = row_ok[:, None] & col_ok[None, :]
    tl.store(out_base + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=where)


@triton.jit
def _run_edge(a_ptr, b_ptr, rows, cols, row_ok, col_ok, lda, ldb, T, k0, lo, hi, acc, FAST_ACCUM: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """One K tile from aligned k0, the columns outside [lo, hi) zeroed after the load: the load keeps
    its 16-byte vectors where T is a multiple of 16, and the select costs one tile."""
    k = tl.multiple_of(k0, 16) + tl.arange(0, BLOCK_K)
    k_ok = (k >= lo) & (k < hi)
    a = tl.load(a_ptr + rows[:, None].to(tl.int64) * lda + k[None, :], mask=row_ok[:, None] & (k[None, :] < T),
                other=0.0)
    b = tl.load(b_ptr + cols[None, :].to(tl.int64) * ldb + k[:, None], mask=col_ok[None, :] & (k[:, None] < T),
                other=0.0)
    a = tl.where(k_ok[None, :], a, tl.zeros_like(a))
    b = tl.where(k_ok[:, None], b, tl.zeros_like(b))
    return _dot(a, b, acc, FAST_ACCUM)


@triton.autotune(configs=_configs(), key=["M", "N", "T", "G", "FAST_ACCUM"])
@triton.jit
def _k_runs_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, offs_ptr, out_ptr, M, N, T, G, lda, ldb, sa_group_stride,
                   sb_group_stride, FAST_ACCUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr = 8):
    pid_m, pid_n = _tile(tl.program_id(0), (M + BLOCK_M - 1) // BLOCK_M, (N + BLOCK_N - 1) // BLOCK_N, GROUP_M)
    group = tl.program_id(1)
    start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0)
    end = tl.load(offs_ptr + group)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A run starts and ends anywhere. Its whole tiles from its first multiple of 16 load unmasked
    # along K, 16-byte aligned (the row strides are multiples of 16): a mask that changes inside 16
    # columns would split every load into bytes, 13x slower than the forward on the same FLOPs
    # (8 x 4096 x 14336, H100). The columns before and after them take one edge tile each.
    lo = tl.multiple_of((start + 15) // 16 * 16, 16)
    whole = tl.maximum(end - lo, 0) // BLOCK_K
    hi = lo + whole * BLOCK_K
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + ks
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * lda + k[None, :], mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptr + cols[None, :].to(tl.int64) * ldb + k[:, None], mask=col_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, FAST_ACCUM)
    head_end = tl.minimum(lo, end)
    if start < head_end:    # the head: under 16 columns
        acc = _run_edge(a_ptr, b_ptr, rows, cols, row_ok, col_ok, lda, ldb, T, lo - 16, start, head_end, acc,
                        FAST_ACCUM, BLOCK_K)
    if hi < end:            # the tail: under BLOCK_K columns
        acc = _run_edge(a_ptr, b_ptr, rows, cols, row_ok, col_ok, lda, ldb, T, hi, hi, end, acc, FAST_ACCUM, BLOCK_K)
    acc = acc * (tl.load(sa_ptr + group * sa_group_stride) * tl.load(sb_ptr + group * sb_group_stride))
    out = out_ptr + group.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernel addresses a group's rows as contiguous; a group stride of 0 (an expanded, shared
    # operand) stays as it is.
    if t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


def _scale_stride(s: torch.Tensor) -> int:
    return s.stride(0) if s.dim() == 1 and s.numel() > 1 else 0


def grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype, fast_accum: bool, bias: torch.Tensor | None = None,
               offs: torch.Tensor | None = None) -> torch.Tensor:
    """The layouts of te_func.gemm's `_grouped_scaled_mm`: offs None: a (G, M, K), b (G, N, K),
    scales (G,) or (), bias (G, N), (N,) or None -> (G, M, N). offs (G,) int32 with b (G, N, K):
    a (T, K) -> (T, N), rows past offs[-1] zeros; with b (N, T): a (M, T) -> (G, M, N), runs along
    K (no bias). A group stride of 0 shares an operand."""
    if offs is not None and b.dim() == 2:
        return _k_runs(a, b, scale_a.reshape(-1), scale_b.reshape(-1), out_dtype, fast_accum,
                       offs)
    offsets = offs is not None
    a = a.contiguous() if offsets else _inner_contiguous(a)
    b = _inner_contiguous(b)
    if offs is not None:
        g, (m, k) = offs.shape[0], a.shape
    else:
        g, m, k = a.shape
    n = b.shape[1]
    has_bias = bias is not None
    bias_stride = 0 if bias is None or bias.dim() == 1 else bias.stride(0)
    if bias is None:
        bias = scale_a      # any pointer: the kernel does not read it
    elif bias.stride(-1) != 1:
        bias = bias.contiguous()
    scale_a, scale_b = scale_a.reshape(-1), scale_b.reshape(-1)
    out = torch.zeros((m, n), device=a.device, dtype=out_dtype) if offsets else \
        torch.empty((g, m, n), device=a.device, dtype=out_dtype)
    if out.numel() == 0 or g == 0:
        return out

    def grid(meta):
        tiles = (triton.cdiv(m, meta["BLOCK_M"]) + (g if offsets else 0)) * triton.cdiv(n, meta["BLOCK_N"])
        return (tiles, 1) if offsets else (tiles, g)
    _grouped_kernel[grid](a, b, scale_a, scale_b, bias, offs if offsets else scale_a, out, m, n, k, g,
                          0 if offsets else a.stride(0), b.stride(0), _scale_stride(scale_a), _scale_stride(scale_b),
                          bias_stride, OFFSETS=offsets, HAS_BIAS=has_bias, FAST_ACCUM=fast_accum)
    return out


def _k_runs(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
            fast_accum: bool, offs: torch.Tensor) -> torch.Tensor:
    a, b = _rows_of_16(a), _rows_of_16(b)
    (m, t), n, g = a.shape, b.shape[0], offs.shape[0]
    out = torch.empty((g, m, n), device=a.device, dtype=out_dtype)
    if out.numel() == 0:
        return out

    def grid(meta):
        return triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), g
    _k_runs_kernel[grid](a, b, scale_a, scale_b, offs, out, m, n, t, g, a.stride(0), b.stride(0),
                         _scale_stride(scale_a), _scale_stride(scale_b), FAST_ACCUM=fast_accum)
    return out


def _rows_of_16(t: torch.Tensor) -> torch.Tensor:
    """t (R, T) with unit column stride, a row stride a multiple of 16 and its start 16-byte aligned:
    the kernel's K loads are then whole 16-byte vectors. A copy into padded rows where not."""
    if t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0:
        return t
    rows, cols = t.shape
    padded = t.new_empty((rows, -(-cols // 16) * 16))
    padded[:, :cols] = t
    return padded[:, :cols]
