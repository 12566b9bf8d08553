"""When the fused Triton kernels run instead of te_func's torch code.

Eagerly, on CUDA, on plain tensors: the casts, the GELU with its amax, the norms, DelayedScaling's
bookkeeping. Everywhere else the torch path runs: on CPU, under torch.compile (inductor fuses it
faster: docs/benchmarks.md), under vmap, for other dtypes, empty or non-contiguous tensors.
Results are bit-identical either way, except the norms' (row sums in another order) and the
GEMMs' (weight-only FP8's and the grouped FP8 GEMM's: fp32 sums in another order). Under
torch.compile four run as graph ops: `gelu_partials`, `cast_from_partials` (current scaling's
cast from partial maxes; `partial_rows` says where), `weight_only_mm` and `grouped_mm`."""
from __future__ import annotations

import functools
import importlib
import os

import torch

from .. import _compat

__all__ = ["activation", "cast_from_partials", "cast_kernels_available", "delayed_record", "delayed_update",
           "device_capability", "fp8_capable", "gelu_partials", "grouped_mm", "norm_backward", "norm_forward",
           "partial_rows", "set_cast_kernels", "tensorwise_cast", "weight_only_mm"]

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_NUMEL = 2**31 - 2**24     # int32 indexing in the kernels
# On by default (bit-identical); TE_FUNC_CAST_KERNELS=0 or set_cast_kernels(False) turns them off.
_DEFAULT = "1"
_enabled = os.environ.get("TE_FUNC_CAST_KERNELS", _DEFAULT) == "1"
calls = {"fused": 0}           # how many casts the kernels made (tests check they ran)


@functools.cache
def _kernels(name: str):
    """te_func.kernels.<name>, or None where it cannot import (no Triton, or no usable backend)."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except Exception:
        return None


# Triton's interpreter, read at import as the kernels' modules read it (not at every call).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def cast_kernels_available() -> bool:
    """Whether the fused casts can run here: Triton imports, and CUDA or TRITON_INTERPRET=1."""
    return (_INTERPRET or torch.cuda.is_available()) and _kernels("cast") is not None


def set_cast_kernels(enabled: bool) -> bool:
    """Use the fused casts where they apply (True) or never (False); returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def _plain(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor under torch.func.grad's wrappers (a cast is not differentiated), or None when
    it is batched, fake or a subclass other than Parameter."""
    while _compat.is_wrapped(t):
        if not _compat.is_grad_tracking(t):
            return None
        t = _compat.unwrap(t)
    # A Parameter (an nn.Module's bias reaching an op as is) is a plain tensor with a flag.
    return t if type(t) in (torch.Tensor, torch.nn.Parameter) else None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability: cached eagerly; traced, a constant of the graph."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_capability(index)
    return _capability(index)


def fp8_capable(device: torch.device | str) -> bool:
    """A CUDA device with FP8 tensor cores (sm_89 and newer): the one test, also for te_func.gemm."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and device_capability(device) >= (8, 9)


def _applies(x: torch.Tensor) -> bool:
    if not (_enabled and not torch.compiler.is_compiling() and x.dtype in _INPUT_DTYPES
            and 0 < x.numel() < _MAX_NUMEL):
        return False
    return _on_kernel_device(x)


def _on_kernel_device(x: torch.Tensor) -> bool:
    """x is where the kernels run: an FP8-capable CUDA device, or under Triton's interpreter not meta."""
    if _INTERPRET:
        return x.device.type != "meta"
    return fp8_capable(x.device)


def tensorwise_cast(x: torch.Tensor, dtype: torch.dtype, fp8_max: float, amax_epsilon: float,
                    power_2_scale: bool, scale: torch.Tensor | None, with_transpose: bool,
                    amax: torch.Tensor | None = None):
    """The tensor-wise FP8 cast of x by the fused kernels, or None where they do not apply.
    `scale` (): delayed scaling's; None: current scaling. `amax` (): x's, where its producer took it.
    Returns (data, data_t (cols, rows) or None, scale_inv (), amax ()), the amax meaningful only
    with `scale` or `amax` given."""
    if not _applies(x) or (with_transpose and x.dim() != 2):
        return None
    kernels = _kernels("cast")
    if kernels is None:
        return None
    # With functorch's dispatch off, the kernels' tensors mix with wrapped ones as constants.
    with _compat.functorch_disabled():
        x_plain = _plain(x)
        scale_plain = None if scale is None else _plain(scale)
        amax_plain = None if amax is None else _plain(amax)
        if x_plain is None or not x_plain.is_contiguous() or (scale is not None and scale_plain is None) \
                or (amax is not None and amax_plain is None):
            return None
        if scale_plain is not None:
            scale_plain = scale_plain.float().contiguous()
        bits = None if amax_plain is None else amax_plain.float().reshape(1).view(torch.int32).clone()
        data, data_t, scale_inv, bits = kernels.cast(x_plain.reshape(-1, x.shape[-1]) if x.dim() else
                                                     x_plain.reshape(1, 1), dtype, fp8_max, amax_epsilon,
                                                     power_2_scale, scale_plain, with_transpose, amax=bits)
        calls["fused"] += 1
        return data.reshape(x.shape), data_t, scale_inv, bits.view(torch.float32).reshape(())


# Compiled casts of at most COMPILED_CAST_ROWS rows (a decode step's tokens) take the two-launch
# path; past that, inductor's own amax chain (but a GELU's output: `gelu_partials`). One threshold
# for every tensor, so a dynamic token count makes two graphs at most. Each partial max covers a
# row chunk of at most PARTIAL_ROW elements (a norm's row, taken in the norm's own pass), at most
# MAX_PARTIALS of them; a width that needs more keeps inductor's chain.
COMPILED_CAST_ROWS = 64
PARTIAL_ROW, MIN_PARTIAL_ROW, MAX_PARTIALS = 4096, 256, 1024


@_compat.assume_constant_result
def _compiled_casts_ready() -> bool:
    # A constant of the traced graph: whether te_func.kernels.cast (and its op) imports here.
    return _kernels("cast") is not None


@_compat.assume_constant_result
def _gelu_tile() -> tuple[int, int]:
    return _kernels("cast").GELU_PARTIALS_TILE_M, _kernels("cast").GELU_PARTIALS_TILE_N


def _compiled_op_applies(x: torch.Tensor) -> bool:
    """Under torch.compile, x on an FP8-capable CUDA device where te_func's ops import (under
    torch.export a static shape only: a size test would narrow the exported program's range)."""
    if not (_enabled and torch.compiler.is_compiling() and x.is_cuda and x.dtype in _INPUT_DTYPES):
        return False
    if torch.compiler.is_exporting() and not all(isinstance(d, int) for d in x.shape):
        return False
    return fp8_capable(x.device) and _compiled_casts_ready()


def _few_rows(x: torch.Tensor) -> bool:
    # Under a dynamic token count the guard of both graphs' split (the one size test that is not static).
    return x.shape[-1] > 0 and 0 < x.numel() // x.shape[-1] <= COMPILED_CAST_ROWS


def partial_rows(x: torch.Tensor) -> int | None:
    """Under torch.compile: the row chunk length for `cast_from_partials`' maxes of x, or None."""
    # The device first: a CPU tensor never guards on its shape.
    if not _compiled_op_applies(x) or x.dim() < 1 or not isinstance(x.shape[-1], int) or x.shape[-1] == 0:
        return None     # (a dynamic width, rare, keeps inductor's chain rather than guard on it)
    width = x.shape[-1]
    pieces = next((k for k in range(1, width // MIN_PARTIAL_ROW + 1) if width % k == 0 and width // k <= PARTIAL_ROW),
                  1)
    if COMPILED_CAST_ROWS * pieces > MAX_PARTIALS or not _few_rows(x):
        return None
    return width // pieces


def cast_from_partials(x2d: torch.Tensor, partials: torch.Tensor, dtype: torch.dtype, fp8_max: float,
                       amax_epsilon: float, power_2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling's cast of x whose amax is partials.max(), by te_func::cast_from_partials."""
    data, scale_inv = torch.ops.te_func.cast_from_partials(x2d, partials, dtype, fp8_max, amax_epsilon,
                                                           power_2_scale, not _few_rows(x2d))
    return data, scale_inv.reshape(())


def gelu_partials(x: torch.Tensor, bias: torch.Tensor | None):
    """Under torch.compile: `activation`'s GELU of a 2-D x (plus bias) by te_func::gelu_partials,
    (v, partial maxes of |v| (P,) fp32) for `cast_from_partials`: one per tile, or over
    COMPILED_CAST_ROWS rows one of all of v, so the GELU is computed once. None where it does not apply."""
    if not _compiled_op_applies(x) or x.dim() != 2 or (bias is not None and (
            bias.shape != x.shape[-1:] or bias.dtype != x.dtype)):
        return None
    n = x.shape[-1]
    if not isinstance(n, int) or n == 0:
        return None
    if not _few_rows(x):
        return None if x.numel() == 0 else torch.ops.te_func.gelu_partials(x.contiguous(), bias, True)
    # one partial max per tile: at most MAX_PARTIALS for COMPILED_CAST_ROWS rows of this width
    tile_m, tile_n = _gelu_tile()
    if -(-COMPILED_CAST_ROWS // tile_m) * -(-n // tile_n) > MAX_PARTIALS:
        return None
    return torch.ops.te_func.gelu_partials(x.contiguous(), bias)


def activation(x: torch.Tensor, act: str, y: torch.Tensor | None = None, column_sums: bool = False,
               bias: torch.Tensor | None = None):
    """An activation by the fused kernel with its amax and column sums taken on the way, or None.
    act: "gelu" (v = gelu(x), tanh) or "gelu_backward" (v = x * gelu'(y)); x 2-D; bias added to the
    GELU's input first (rounded as torch's `+`). Returns (v, the bits of te_func.ops.activations'
    formulas; max |v| () fp32; v.sum(0), or None without `column_sums`)."""
    # _applies first: it says no under torch.compile before any shape is compared (no guard).
    if not _applies(x) or x.dim() != 2 or (y is not None and (y.shape != x.shape or y.dtype != x.dtype)) \
            or (bias is not None and (bias.shape != x.shape[-1:] or bias.dtype != x.dtype)) or _kernels("cast") is None:
        return None
    with _compat.functorch_disabled():
        plain = _plain_all(x, y, bias)
        if plain is None:
            return None
        x_p, y_p, b_p = (None if t is None else t.contiguous() for t in plain)
        v, bits, sums = _kernels("cast").activation(x_p, y_p, act, column_sums, b_p)
        calls["fused"] += 1
        return v, bits.view(torch.float32).reshape(()), None if sums is None else sums.to(x.dtype)


def _plain_all(*ts):
    """`_plain` of each tensor (None stays None), or None if any is not plain."""
    plain = tuple(None if t is None else _plain(t) for t in ts)
    return None if any(p is None and t is not None for p, t in zip(plain, ts)) else plain


def _norm_applies(x: torch.Tensor) -> bool:
    # _applies first, as in `activation`; a row must fit the kernels' one block
    return _applies(x) and x.dim() == 2 and _kernels("norm") is not None and x.shape[-1] <= _kernels("norm").MAX_HIDDEN


def norm_forward(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None, eps: float, rms: bool):
    """LayerNorm or RMSNorm (rms) of a 2-D x by the fused kernel, or None; gamma, beta fp32 as they
    multiply. Returns (y, mean or None, rsigma, max |y|): norm_forward's, row sums in the kernel's order."""
    if not _norm_applies(x):
        return None
    with _compat.functorch_disabled():
        plain = _plain_all(x, gamma, beta)
        if plain is None:
            return None
        x_p, g_p, b_p = plain
        y, mean, rsigma, bits = _kernels("norm").norm_forward(
            x_p.contiguous(), g_p.float().contiguous(), None if b_p is None else b_p.float().contiguous(), eps, rms)
        calls["fused"] += 1
        return y, None if mean is None else mean[:, None], rsigma[:, None], bits.view(torch.float32).reshape(())


def norm_backward(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor | None, rsigma: torch.Tensor,
                  gamma: torch.Tensor):
    """The norm's backward by the fused kernel, or None; mean (None: RMSNorm) and rsigma as
    `norm_forward` made them. Returns (dx in x's dtype, dgamma fp32, dbeta fp32)."""
    if not _norm_applies(x) or dy.shape != x.shape or dy.dtype not in _INPUT_DTYPES:
        return None
    with _compat.functorch_disabled():
        plain = _plain_all(dy, x, mean, rsigma, gamma)
        if plain is None:
            return None
        dy_p, x_p, mean_p, rsigma_p, g_p = plain
        out = _kernels("norm").norm_backward(
            dy_p.contiguous(), x_p.contiguous(), None if mean_p is None else mean_p.float().reshape(-1).contiguous(),
            rsigma_p.float().reshape(-1).contiguous(), g_p.float().contiguous(), mean is None)
        calls["fused"] += 1
        return out


def _delayed(history: torch.Tensor, other: torch.Tensor, launch):
    """launch(kernel module, history, other as a 0-d tensor) for a DelayedScaling history on eager
    CUDA (fp32, 1-D, one program's) and one fp32 number; else None."""
    # _applies first: it says no under torch.compile before anything else is traced.
    if not _applies(history) or history.dtype != torch.float32 or history.dim() != 1 \
            or other.dtype != torch.float32 or other.numel() != 1 or other.device != history.device:
        return None
    module = _kernels("delayed")
    if module is None or history.numel() > module.MAX_HISTORY:
        return None
    with _compat.functorch_disabled():
        plain = _plain_all(history, other)
        if plain is None:
            return None
        h, o = (t.contiguous() for t in plain)
        calls["fused"] += 1
        return launch(module, h, o.reshape(()))


def delayed_update(history: torch.Tensor, scale: torch.Tensor, scaled_max: float, most_recent: bool):
    """delayed_update's arithmetic by one kernel (the same bits), or None: (new history, new scale).
    scaled_max: fp8_max * 2**-margin; most_recent: amax_compute_algo "most_recent"."""
    out = _delayed(history, scale, lambda module, h, s: module.update(h, s, scaled_max, most_recent))
    return None if out is None else (out[0], out[1].reshape(scale.shape))


def delayed_record(history: torch.Tensor, amax: torch.Tensor):
    """record_amax's history by one kernel, or None where it does not apply."""
    return _delayed(history, amax, lambda module, h, a: module.record(h, a))


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def weight_only_mm(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """(x (M, K) @ w (N, K).T) * scale_inv + bias in x's dtype by the Triton kernel, or None: x
    bf16/fp16 on an FP8-capable device (or Triton's interpreter), w a tensor-wise FP8 cast."""
    if not (_enabled and x.dim() == 2 and w.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype in _FP8_DTYPES and scale_inv.dtype == torch.float32 and scale_inv.numel() == 1
            and x.shape[1] == w.shape[1] and min(x.shape[0], *w.shape) > 0
            and max(x.numel(), w.numel()) < _MAX_NUMEL and x.device == w.device == scale_inv.device
            and (bias is None or (bias.shape == (w.shape[0],) and bias.dtype == x.dtype and bias.device == x.device))
            and _on_kernel_device(x)):
        return None
    module = _kernels("weight_only")
    if module is None:
        return None
    calls["fused"] += 1
    return module.weight_only_mm(x.contiguous(), w.contiguous(), scale_inv.reshape(()).contiguous(),
                                 None if bias is None else bias.contiguous())


def grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype, fast_accum: bool, bias: torch.Tensor | None = None,
               offs: torch.Tensor | None = None) -> torch.Tensor | None:
    """G FP8 GEMMs a_g @ b_g.T * scale_a[g] * scale_b[g] + bias in one Triton launch
    (te_func.kernels.grouped_gemm says the layouts), or None: FP8 operands on an FP8-capable device
    (or Triton's interpreter), fp32 scales, a bf16/fp16/fp32 result. Also under torch.compile:
    te_func.gemm's op calls it at run time."""
    if not (_enabled and a.dtype in _FP8_DTYPES and b.dtype in _FP8_DTYPES and scale_a.dtype == torch.float32
            and scale_b.dtype == torch.float32 and out_dtype in _INPUT_DTYPES
            and max(a.numel(), b.numel()) < _MAX_NUMEL and a.device == b.device
            and (offs is None or offs.dtype == torch.int32) and _on_kernel_device(a)):
        return None
    module = _kernels("grouped_gemm")
    if module is None:
        return None
    calls["fused"] += 1
    return module.grouped_mm(a, b, scale_a, scale_b, out_dtype, fast_accum, bias,
                             None if offs is None else offs.contiguous())
