"""FP8 and FP4 GEMM dispatch: `torch._scaled_mm` where the device has it, exact emulation elsewhere.
Every GEMM is `a @ b.T` with both operands quantized along K, so the caller only picks the casts."""
from __future__ import annotations

import torch

from . import kernels
from .quant import Quantized, dequantize, nvfp4
from .quant.tensor import batched_by_vmap, nvfp4_block_values

__all__ = ["gemm", "grouped_gemm", "weight_only_gemm", "native_fp8_gemm_available"]


def native_fp8_gemm_available(device: torch.device) -> bool:
    """True on CUDA GPUs with FP8 tensor cores (Ada, Hopper and newer)."""
    return kernels.fp8_capable(device)


def _plain_2d(a: Quantized, b: Quantized) -> bool:
    return a.data.dim() == 2 and b.data.dim() == 2 and not (batched_by_vmap(a.data) or batched_by_vmap(b.data))


def _use_scaled_mm(a: Quantized, b: Quantized) -> bool:
    """Tensor-wise scaled operands that `torch._scaled_mm` takes, batched by vmap or not."""
    # The device first: a shape test on a symbolic size would guard on it, and a CPU never needs to.
    if not native_fp8_gemm_available(a.data.device):
        return False
    if a.block is not None or b.block is not None:
        return False
    if a.data.dtype == torch.float8_e5m2 and b.data.dtype == torch.float8_e5m2:
        return False  # no E5M2 x E5M2 kernel
    if a.data.dim() != 2 or b.data.dim() != 2:
        return False
    k, n = a.data.shape[-1], b.data.shape[0]
    return not (k % 16 or n % 16)   # _scaled_mm needs K and N multiples of 16


@torch.library.custom_op("te_func::scaled_mm", mutates_args=())
def _batched_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       out_dtype: torch.dtype, fast_accum: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a (M, K) x b (N, K) (+ bias) -> (M, N) in one torch._scaled_mm, with a batching rule (below)."""
    a, b, scale_a, scale_b = (_aligned(t.contiguous()) for t in (a, b, scale_a, scale_b))
    return _scaled_mm(a, b, scale_a, scale_b, out_dtype, fast_accum, None if bias is None else bias.contiguous())


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype, fast_accum: bool | None, bias: torch.Tensor | None) -> torch.Tensor:
    """torch._scaled_mm of a (M, K) row-major and b (N, K) (as column-major b.T), the bias added to the
    fp32 product before the one rounding (an fp32 result adds it after: the same sum). fast_accum
    None: torch's default (block-scaled GEMMs take no such option)."""
    fp32_bias = bias if out_dtype == torch.float32 else None
    accum: dict = {} if fast_accum is None else {"use_fast_accum": fast_accum}
    out = torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                           bias=None if fp32_bias is not None else bias, out_dtype=out_dtype, **accum)
    return out if fp32_bias is None else out + fp32_bias


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # cuBLASLt refuses operands and scales not on 16 bytes, as a sample's slice of a batch may be.
    return t if t.data_ptr() % 16 == 0 else t.clone()


@_batched_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, out_dtype, fast_accum, bias=None):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@_batched_scaled_mm.register_vmap
def _(info, in_dims, a, b, scale_a, scale_b, out_dtype, fast_accum, bias=None):
    dim_a, dim_b, dim_sa, dim_sb = in_dims[:4]
    dim_bias = in_dims[6] if len(in_dims) > 6 else None
    if dim_a is not None and dim_b is None and dim_sa is None and dim_sb is None and dim_bias is None:
        # Samples against a shared weight and scales: their rows stacked are the batch's GEMM, bit for bit.
        a = a.movedim(dim_a, 0)
        out = _batched_scaled_mm(a.flatten(0, 1), b, scale_a, scale_b, out_dtype, fast_accum, bias)
        return out.unflatten(0, a.shape[:2]), 0
    # Both operands per sample (a weight-gradient GEMM, an ensemble member's forward), per-sample
    # scales or biases: the samples' GEMMs as one grouped GEMM, a shared operand read by every group.
    n = info.batch_size

    def batched(t, dim):
        return t.movedim(dim, 0) if dim is not None else t.expand(n, *t.shape)
    out = _grouped_scaled_mm(batched(a, dim_a), batched(b, dim_b), batched(scale_a.reshape(()) if dim_sa is None
                             else scale_a, dim_sa).reshape(n), batched(scale_b.reshape(()) if dim_sb is None
                             else scale_b, dim_sb).reshape(n), out_dtype, fast_accum,
                             None if bias is None else batched(bias, dim_bias))
    return out, 0


@torch.library.custom_op("te_func::grouped_scaled_mm", mutates_args=())
def _grouped_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       out_dtype: torch.dtype, fast_accum: bool, bias: torch.Tensor | None = None,
                       offs: torch.Tensor | None = None) -> torch.Tensor:
    """G tensor-wise scaled FP8 GEMMs a_g @ b_g.T * scale_a[g] * scale_b[g] (+ bias) in one call.
    offs None: a (G, M, K), b (G, N, K) (an operand shared by the groups: expanded, group stride 0),
    scales (G,) or (), bias (G, N), (N,) or None -> (G, M, N) (vmap's batches).
    offs (G,) int32, the ends of G runs of tokens, on the device:
    - b (G, N, K): runs of a's rows, a (T, K) -> (T, N), rows past the last run zeros (a MoE
      layer's forward and input gradient);
    - b (N, T): runs along K, a (M, T) -> (G, M, N), an empty run zeros (its weight gradients).
    The Triton kernel (te_func.kernels.grouped_gemm) where it runs; elsewhere one GEMM a group as
    `gemm` runs it (torch._scaled_mm on FP8 GPUs, the fp32 emulation on CPUs): the loop this replaces."""
    k_runs = offs is not None and b.dim() == 2
    if k_runs and bias is not None:
        raise ValueError("te_func::grouped_scaled_mm: runs along K (weight gradients) take no bias")
    if bias is not None:
        bias = _bias(bias, b.shape[-2], out_dtype) if bias.dim() == 1 else bias.to(out_dtype)
    out = kernels.grouped_mm(a, b, scale_a, scale_b, out_dtype, fast_accum, bias, offs)
    if out is not None:
        return out
    if offs is not None and k_runs:
        scales = [s.reshape(-1).expand(offs.shape[0]) for s in (scale_a, scale_b)]
        empty = a.new_zeros((a.shape[0], b.shape[0]), dtype=out_dtype)
        return torch.stack([_one_gemm(a[:, start:end], b[:, start:end], scales[0][g], scales[1][g], None, out_dtype,
                                      fast_accum) if end > start else empty
                            for g, (start, end) in enumerate(_runs(offs))])
    groups = _groups(a, b, scale_a, scale_b, bias, offs)
    if offs is None:
        return torch.stack([_one_gemm(*g, out_dtype, fast_accum) for g in groups])
    out = a.new_zeros((a.shape[0], b.shape[-2]), dtype=out_dtype)
    for group, (start, end) in zip(groups, _runs(offs)):
        if end > start:
            out[start:end] = _one_gemm(*group, out_dtype, fast_accum)
    return out


def _runs(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


def _groups(a, b, scale_a, scale_b, bias, offs) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                               torch.Tensor | None]]:
    """Each group's (a, b, scale_a, scale_b, bias), a shared scale or bias in every one."""
    count = offs.shape[0] if offs is not None else a.shape[0]
    runs = _runs(offs) if offs is not None else None
    scales = [s.reshape(-1).expand(count) for s in (scale_a, scale_b)]
    return [(a[runs[g][0]:runs[g][1]] if runs is not None else a[g], b[g], scales[0][g], scales[1][g],
             None if bias is None else bias[g] if bias.dim() == 2 else bias) for g in range(count)]


def _one_gemm(a, b, scale_a, scale_b, bias, out_dtype, fast_accum) -> torch.Tensor:
    """One group's GEMM, as `gemm` runs the pair; where that is torch._scaled_mm, through the op that
    aligns a group's slice (and its scale's element) for cuBLAS."""
    qa, qb = Quantized.tensorwise(a, scale_a), Quantized.tensorwise(b, scale_b)
    if _use_scaled_mm(qa, qb):
        return _batched_scaled_mm(a, b, scale_a, scale_b, out_dtype, fast_accum, bias)
    return gemm(qa, qb, out_dtype, fast_accum=fast_accum, bias=bias)


@_grouped_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, out_dtype, fast_accum, bias=None, offs=None):
    if offs is not None and b.dim() == 2:
        return a.new_empty((offs.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype)
    if offs is not None:
        return a.new_empty((a.shape[0], b.shape[-2]), dtype=out_dtype)
    return a.new_empty((a.shape[0], a.shape[1], b.shape[1]), dtype=out_dtype)


@_grouped_scaled_mm.register_vmap
def _(info, in_dims, a, b, scale_a, scale_b, out_dtype, fast_accum, bias=None, offs=None):
    # A grouped GEMM under another vmap (an ensemble's per-sample gradients): one call an outer sample.
    dims = list(in_dims) + [None] * (8 - len(in_dims))

    def sample(t, dim, i):
        return t if dim is None else t.select(dim, i)
    return torch.stack([_grouped_scaled_mm(sample(a, dims[0], i), sample(b, dims[1], i), sample(scale_a, dims[2], i),
                                           sample(scale_b, dims[3], i), out_dtype, fast_accum,
                                           sample(bias, dims[6], i), sample(offs, dims[7], i))
                        for i in range(info.batch_size)]), 0


def _use_blockwise_scaled_mm(a: Quantized, b: Quantized) -> bool:
    """Float8BlockScaling's pairs cuBLAS (12.9+, Hopper) runs: 1x128 x 128x128, 1x128 x 1x128."""
    if a.data.device.type != "cuda" or kernels.device_capability(a.data.device) != (9, 0):   # Hopper
        return False
    if a.block != (1, 128) or b.block not in ((1, 128), (128, 128)):
        return False
    if a.scale_inv.dtype != torch.float32 or a.data.dtype != torch.float8_e4m3fn or b.data.dtype != a.data.dtype:
        return False
    if not _plain_2d(a, b):
        return False
    (m, k), n = a.data.shape, b.data.shape[0]
    if m % 128 or k % 128 or n % 128:
        return False   # no partial blocks: their scale layout differs
    if b.block == (128, 128) and (k // 128) % 4:
        # b's 128x128 scales reach cuBLAS with a leading dimension of K/128 floats: unless a multiple
        # of 16 bytes the result is wrong (NaN on an H200). Emulate those.
        return False
    return True


def _pow2_blocks_on_gpu(a: Quantized, b: Quantized) -> bool:
    # An FP8 value times an E8M0 scale is exact in bf16: a bf16 GEMM accumulating in fp32 is the same
    # function as the fp32 one, at tensor-core speed.
    return (a.data.device.type == "cuda" and a.scale_inv.dtype == torch.uint8    # E8M0 bytes
            and b.scale_inv.dtype == torch.uint8)


def _nvfp4_gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """NVFP4 x NVFP4 as the FP4 tensor cores compute it: exact per-block products accumulated in fp32,
    times TE's per-tensor alpha = fl(fl(amax_a * amax_b) * fl32(1 / (6 * 6 * 448 * 448))), plus the
    bias. Hopper and CPUs have no FP4 GEMM: this fp32 GEMM is the same function up to accumulation
    order (its operands are exact in tf32 too)."""
    if a.global_amax is None or b.global_amax is None:
        raise ValueError("an NVFP4 GEMM needs two NVFP4 operands (te_func.quant.Quantized with global_amax)")
    acc = nvfp4_block_values(a) @ nvfp4_block_values(b).t()
    alpha = (a.global_amax * b.global_amax) * (1.0 / (nvfp4.E2M1_MAX ** 2 * nvfp4.E4M3_MAX ** 2))
    return _rounded(acc * alpha, bias, out_dtype)


def _bias(bias: torch.Tensor | None, n: int, dtype: torch.dtype) -> torch.Tensor | None:
    # One bias per output column, in the output's dtype (else the emulation and cuBLAS would differ).
    if bias is None:
        return None
    if bias.shape != (n,):
        raise ValueError(f"a GEMM's bias has one value per output column: expected shape ({n},), "
                         f"got {tuple(bias.shape)}")
    return bias.to(dtype)


def _rounded(acc: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    # The epilogue of every path: the fp32 result plus the bias, rounded once.
    return (acc if bias is None else acc + bias.float()).to(out_dtype)


def gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype, *, fast_accum: bool = True,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """(M, K) x (N, K) -> (M, N) = dequantize(a) @ dequantize(b).T + bias, in `out_dtype`.

    The bias (N,) is added to the fp32 product before its rounding, as cuBLAS's epilogue does for TE.
    Tensor-wise scales on FP8 GPUs (and Float8BlockScaling's block pairs on Hopper) run one
    `torch._scaled_mm` (`fast_accum` as TE: forward on, backward off); MXFP8 without MXFP8 GEMMs
    dequantizes to bf16 (exact); elsewhere, and NVFP4 everywhere, the GEMM is emulated in fp32:
    the same function up to accumulation order."""
    if a.data.shape[-1] != b.data.shape[-1]:
        raise ValueError(f"GEMM reduction dims differ: a {tuple(a.data.shape)}, b {tuple(b.data.shape)}")
    bias = _bias(bias, b.data.shape[0], out_dtype)
    if a.nvfp4 or b.nvfp4:
        return _nvfp4_gemm(a, b, out_dtype, bias)
    if _use_scaled_mm(a, b):
        if any(batched_by_vmap(t) for t in (a.data, b.data, a.scale_inv, b.scale_inv, bias) if t is not None):
            # Detached: no derivative, and torch.func.grad would refuse the op's autograd node.
            return _batched_scaled_mm(a.data.detach(), b.data.detach(), a.scale_inv.detach(), b.scale_inv.detach(),
                                      out_dtype, fast_accum, None if bias is None else bias.detach())
        return _scaled_mm(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype, fast_accum, bias)
    if _use_blockwise_scaled_mm(a, b):
        # cuBLAS wants 1x128 scales outer-dim-major: (rows, K/128) stored column-major.
        scale_a = a.scale_inv.t().contiguous().t()
        scale_b = b.scale_inv.t() if b.block == (128, 128) else b.scale_inv.t().contiguous()
        return _scaled_mm(a.data, b.data, scale_a, scale_b, out_dtype, None, bias)
    if out_dtype == torch.bfloat16 and _pow2_blocks_on_gpu(a, b):
        # Only for a bf16 result; addmm's 1-D bias is added in cuBLAS's fp32 epilogue.
        a_bf16, b_bf16 = dequantize(a, torch.bfloat16), dequantize(b, torch.bfloat16).t()
        return a_bf16 @ b_bf16 if bias is None else torch.addmm(bias, a_bf16, b_bf16)
    return _rounded(dequantize(a) @ dequantize(b).t(), bias, out_dtype)


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 out_dtype: torch.dtype, *, fast_accum: bool, bias: torch.Tensor | None = None,
                 offs: torch.Tensor | None = None) -> torch.Tensor:
    """G tensor-wise FP8 GEMMs in one call (te_func::grouped_scaled_mm, whose docstring gives the
    layouts): FP8 data and their scale_invs, one per group or one for all. No derivative: the
    layers' ops differentiate around it, as around `gemm`."""
    detached = [None if t is None else t.detach() for t in (a, b, scale_a, scale_b, bias)]
    return _grouped_scaled_mm(*detached[:4], out_dtype, fast_accum, detached[4], offs)


def weight_only_gemm(x: torch.Tensor, w: Quantized, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(M, K) x (N, K) quantized -> (M, N) = x @ dequantize(w).T + bias, in x's dtype: weight-only FP8
    (not a TE mode; te_func.freeze picks it per call shape). The bias goes in as `gemm` adds it.
    A tensor-wise cast runs te_func::weight_only_mm (the fp32 sum times the scale, plus the bias,
    rounded once; on FP8 GPUs one Triton kernel reading the FP8 weight once). Block scales dequantize
    the weight to x's dtype (exact for MXFP8) and run `F.linear`."""
    bias = _bias(bias, w.data.shape[0], x.dtype)
    if w.block is None and not w.nvfp4:
        if x.shape[-1] != w.data.shape[-1]:
            raise ValueError(f"GEMM reduction dims differ: x {tuple(x.shape)}, w {tuple(w.data.shape)}")
        out = _weight_only_mm(x.reshape(-1, x.shape[-1]), w.data, w.scale_inv, bias)
        return out.reshape(*x.shape[:-1], w.data.shape[0])
    wq = dequantize(w, x.dtype)     # NVFP4 packs two codes a byte: compare the decoded width
    if x.shape[-1] != wq.shape[-1]:
        raise ValueError(f"GEMM reduction dims differ: x {tuple(x.shape)}, w {tuple(wq.shape)}")
    return torch.nn.functional.linear(x, wq, bias)


def _weight_only_reference(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    return _rounded((x.float() @ w.float().t()) * scale_inv.float(), bias, x.dtype)


@torch.library.custom_op("te_func::weight_only_mm", mutates_args=())
def _weight_only_mm(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T * scale_inv + bias in x's dtype: an op, so compiled graphs call the Triton kernel."""
    out = kernels.weight_only_mm(x, w, scale_inv, bias)
    return _weight_only_reference(x, w, scale_inv, bias) if out is None else out


@_weight_only_mm.register_fake
def _(x, w, scale_inv, bias=None):
    return x.new_empty((x.shape[0], w.shape[0]))


@_weight_only_mm.register_vmap
def _(info, in_dims, x, w, scale_inv, bias=None):
    dim_x, dim_w, dim_s = in_dims[:3]
    dim_bias = in_dims[3] if len(in_dims) > 3 else None
    if dim_w is None and dim_s is None and dim_bias is None:
        # Samples of the input against one weight: their rows stacked are one GEMM.
        x = x.movedim(dim_x, 0)
        return _weight_only_mm(x.flatten(0, 1), w, scale_inv, bias).unflatten(0, x.shape[:2]), 0
    def sample(t, dim, i):
        return t if dim is None else t.select(dim, i)
    return torch.stack([_weight_only_mm(sample(x, dim_x, i), sample(w, dim_w, i), sample(scale_inv, dim_s, i),
                                        sample(bias, dim_bias, i))
                        for i in range(info.batch_size)]), 0
