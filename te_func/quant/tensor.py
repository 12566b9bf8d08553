"""`Quantized` tensors and the one quantize / dequantize path every recipe shares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from ..kernels import tensorwise_cast
from .scheme import Scheme, e8m0_scale_inv, scale_from_amax, scheme_for

__all__ = ["Quantized", "DelayedState", "quantize", "quantize_with_transpose",
           "quantize_scheme", "dequantize", "transpose"]


@dataclass(frozen=True)
class Quantized:
    """An FP8 tensor and the factors that decode it: x ~= data * scale_inv (per block).

    data:      FP8, the source's shape; block layouts need 2-D (rows, cols), blocks
               run along the last dim (the GEMM's reduction dim).
    scale_inv: float32 `()` for one scale per tensor, else one per block,
               `(ceil(rows / block[0]), ceil(cols / block[1]))` (float8_e8m0fnu for MXFP8).
    block:     None (per tensor) or the block's (rows, cols).
    """
    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def shape(self):
        return self.data.shape


pytree.register_pytree_node(
    Quantized,
    lambda q: ([q.data, q.scale_inv], q.block),
    lambda leaves, block: Quantized(leaves[0], leaves[1], block),
    serialized_type_name="te_func.quant.Quantized",
)


class DelayedState(NamedTuple):
    """Delayed-scaling state of one tensor role: its amax history and current scale.

    A history of None is a forward-only state (a frozen model, te_func.freeze): TE's
    DelayedScaling at inference quantizes with the scale it has and updates nothing,
    so nothing is recorded."""
    amax_history: torch.Tensor | None  # (amax_history_len,) float32; [0] is the current step's slot
    scale: torch.Tensor                # () float32


def _cast(x: torch.Tensor, scale: torch.Tensor, s: Scheme) -> torch.Tensor:
    # Saturate rather than overflow: torch's cast turns |v| > fp8_max into NaN
    # (E4M3) or inf (E5M2), TE's kernels clamp to the largest finite value.
    # Row-major whatever x's strides (a transposed input, a gradient): cuBLAS's FP8
    # GEMMs take only row-major x column-major operands.
    return torch.clamp(x.float() * scale, -s.fp8_max, s.fp8_max).to(s.dtype, memory_format=torch.contiguous_format)


def abs_skipping_nan(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN as 0, in fp32: TE takes amaxes with fmax, which skips NaN elements, so a
    NaN neither freezes a delayed scale nor turns a whole block's scale into NaN (the
    element itself still casts to NaN)."""
    a = x.float().abs()
    return torch.where(torch.isnan(a), 0.0, a)


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(rows, cols) -> (row_blocks, br, col_blocks, bc), zero-padded: zeros leave amax alone."""
    if x.dim() != 2:
        raise ValueError(f"block scaling needs a 2-D tensor, got shape {tuple(x.shape)}")
    (rows, cols), (br, bc) = x.shape, block
    pr, pc = -rows % br, -cols % bc
    if _may_be_nonzero(pr) or _may_be_nonzero(pc):
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x.reshape((rows + pr) // br, br, (cols + pc) // bc, bc)


def _may_be_nonzero(n) -> bool:
    # A size torch.compile keeps symbolic (a routed group's token count) is not branched
    # on: a branch would guard on its value and recompile for every new routing.
    return not isinstance(n, int) or n != 0


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| as fp32 (), NaN skipped, 0 for an empty x (a group that got no tokens)."""
    a = abs_skipping_nan(x)
    if isinstance(x.numel(), int):
        return torch.amax(a) if x.numel() else a.new_zeros(())
    # Symbolic size, possibly 0: one zero more is the reduction's identity (inductor fuses the pad).
    return torch.nn.functional.pad(a.reshape(1, -1), (0, 1)).amax()


def _expand(per_block: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """One value per block -> one per element of a (rows, cols) tensor."""
    rows, cols = shape
    return per_block.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def _record_amax(state: DelayedState, amax: torch.Tensor) -> DelayedState:
    """`state` with amax () recorded in the current step's history slot (forward-only: as it is)."""
    history = state.amax_history
    if history is None:
        return state
    # Several casts in one step (microbatches) share one slot: keep the largest.
    return DelayedState(torch.cat([torch.maximum(history[:1], amax.reshape(1)), history[1:]]), state.scale)


def _fused_cast(x: torch.Tensor, s: Scheme, state: DelayedState | None, with_transpose: bool):
    """A tensor-wise cast by te_func.kernels (eager CUDA; bit-identical to the torch code
    below): (q, q of x.T or None, new_state), or None where the kernels do not apply."""
    if s.rule == "delayed" and state is None:
        return None
    out = tensorwise_cast(x, s.dtype, s.fp8_max, s.amax_epsilon, s.power_2_scale,
                          state.scale if s.rule == "delayed" else None, with_transpose)
    if out is None:
        return None
    data, data_t, scale_inv, amax = out
    q_t = None if data_t is None else Quantized(data_t, scale_inv)
    return Quantized(data, scale_inv), q_t, _record_amax(state, amax) if s.rule == "delayed" else None


def quantize_scheme(x: torch.Tensor, s: Scheme, state: DelayedState | None = None):
    """Quantize `x` by scheme `s`. Returns (Quantized, new_state); new_state is None
    unless the scheme is delayed, then `state` with this tensor's amax recorded."""
    if s.block is None:
        if s.rule == "delayed" and state is None:
            raise ValueError("DelayedScaling needs its state (amax history and scale): call the "
                             "layer through tef.functional_call / tef.Stateful with workspaces "
                             "from tef.init_workspaces(model, recipe)")
        fused = _fused_cast(x, s, state, with_transpose=False)
        if fused is not None:
            return fused[0], fused[2]
        if s.rule == "delayed":
            # A forward-only state reads no amax: the reduction would be wasted.
            recorded = state if state.amax_history is None else _record_amax(state, amax_of(x))
            scale, new_state = state.scale, recorded
        else:
            scale, new_state = scale_from_amax(amax_of(x), s.fp8_max, s.amax_epsilon, s.power_2_scale), None
        return Quantized(_cast(x, scale, s), torch.reciprocal(scale)), new_state

    blocks = _blocked(x, s.block)
    amax = torch.amax(abs_skipping_nan(blocks), dim=(1, 3))      # (row_blocks, col_blocks)
    if s.rule == "e8m0":
        scale_inv = e8m0_scale_inv(amax, s.fp8_max)
        scale = torch.reciprocal(scale_inv.float())              # exact: a power of 2
    else:
        scale = scale_from_amax(amax, s.fp8_max, s.amax_epsilon, s.power_2_scale)
        scale_inv = torch.reciprocal(scale)
    data = _cast(x, _expand(scale, s.block, x.shape), s)
    return Quantized(data, scale_inv, s.block), None


def quantize(x: torch.Tensor, recipe, role: str = "input", state: DelayedState | None = None):
    """Quantize `x` as `recipe` quantizes tensors of `role` ("input", "weight" or "grad").

    Returns `(Quantized, new_state)`; `state` and `new_state` are the role's
    `DelayedState` under DelayedScaling, None otherwise.
    """
    return quantize_scheme(x, scheme_for(recipe, role), state)


def transpose(q: Quantized) -> Quantized:
    """The cast of x.T from the cast of x, for schemes whose blocks are square."""
    if q.block is not None and q.block[0] != q.block[1]:
        raise ValueError(f"a {q.block} block cast cannot be transposed: quantize x.T instead")
    # clone, not contiguous(): a transpose that is already contiguous (one block of scales)
    # would otherwise share storage with the original, which a checkpoint cannot hold twice.
    scale_inv = q.scale_inv if q.block is None else q.scale_inv.t().clone(memory_format=torch.contiguous_format)
    return Quantized(q.data.t().clone(memory_format=torch.contiguous_format), scale_inv, q.block)


def quantize_with_transpose(x: torch.Tensor, s: Scheme, state: DelayedState | None = None):
    """Both copies a GEMM layer needs of a 2-D `x`: blocks along its rows and along its
    columns. Returns (q, q_t, new_state), q_t being the cast of x.T."""
    fused = _fused_cast(x, s, state, with_transpose=True) if s.block is None else None
    if fused is not None:     # one pass writes both copies
        return fused
    q, new_state = quantize_scheme(x, s, state)
    if s.transposable:
        return q, transpose(q), new_state
    q_t, _ = quantize_scheme(x.t(), s, None)
    return q, q_t, new_state


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data * scale_inv, block by block, in `dtype`."""
    scale_inv = q.scale_inv.float()
    if q.block is not None:
        scale_inv = _expand(scale_inv, q.block, q.data.shape)
    return (q.data.float() * scale_inv).to(dtype)
