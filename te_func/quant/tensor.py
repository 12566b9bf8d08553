"""`Quantized` tensors and the one quantize / dequantize path every recipe shares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from ..kernels import cast_from_partials, delayed_record, partial_rows, tensorwise_cast
from .. import _compat
from . import nvfp4
from .scheme import Scheme, e8m0_scale_inv, e8m0_to_float, scale_from_amax, scheme_for

__all__ = ["Quantized", "DelayedState", "BatchAmax", "quantize", "quantize_with_transpose",
           "quantize_scheme", "dequantize", "transpose", "record_amax", "cast_with_scale", "nvfp4_block_values",
           "run_ids", "run_amaxes", "record_run_amaxes", "cast_runs"]


@dataclass(frozen=True)
class Quantized:
    """A low-precision tensor and the factors that decode it: x ~= data * scale_inv (per block).

    data:        FP8 of the source's shape (blocks: 2-D, along the last dim); NVFP4: uint8
                 (rows, ceil(cols / 2)), two E2M1 codes a byte.
    scale_inv:   float32 `()`, or one per block (MXFP8: E8M0 bytes as uint8; NVFP4: E4M3).
    block:       None (per tensor) or the block's (rows, cols).
    global_amax: NVFP4 only: the tensor's amax, x ~= e2m1(data) * scale_inv * global_amax / (6 * 448).
    columns:     NVFP4 only: the columns `data` packs (None: 2 * its bytes per row).
    """
    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] | None = None
    global_amax: torch.Tensor | None = None
    columns: int | None = None

    # Built with every field given: a default makes torch 2.11's compiled code re-read the fields.
    @classmethod
    def tensorwise(cls, data: torch.Tensor, scale_inv: torch.Tensor) -> Quantized:
        """One scale for the whole tensor: `scale_inv` ()."""
        return cls(data, scale_inv, None, None, None)

    @property
    def nvfp4(self) -> bool:
        return self.global_amax is not None

    @property
    def shape(self):
        """The shape of the tensor it encodes (NVFP4: columns, not bytes)."""
        if not self.nvfp4:
            return self.data.shape
        return torch.Size((*self.data.shape[:-1], 2 * self.data.shape[-1] if self.columns is None else self.columns))


def _flatten(q: Quantized):
    leaves = [q.data, q.scale_inv] + ([q.global_amax] if q.nvfp4 else [])
    return leaves, (q.block, q.nvfp4, q.columns)


def _unflatten(leaves, aux):
    block, nvfp4, columns = aux
    return Quantized(leaves[0], leaves[1], block, leaves[2] if nvfp4 else None, columns)


pytree.register_pytree_node(Quantized, _flatten, _unflatten, serialized_type_name="te_func.quant.Quantized")


class DelayedState(NamedTuple):
    """Delayed-scaling state of one tensor role: its amax history and current scale. A history
    of None is forward-only (te_func.freeze): the scale is used and nothing is recorded."""
    amax_history: torch.Tensor | None  # (amax_history_len,) float32; [0] is the current step's slot
    scale: torch.Tensor                # () float32

    @property
    def record(self) -> torch.Tensor | None:
        """What a quantization writes its amax into: the history (None: forward-only)."""
        return self.amax_history

    def with_record(self, record: torch.Tensor) -> DelayedState:
        return DelayedState(record, self.scale)


class BatchAmax(NamedTuple):
    """Batch-scope state of one role under current scaling: the batch's amax, and for a per-sample
    call its scale, so the samples' GEMMs are the batch's (the batch's own pass has no scale)."""
    amax: torch.Tensor                  # () float32
    scale: torch.Tensor | None = None   # () float32: a per-sample call's

    @classmethod
    def of(cls, amax: torch.Tensor, s: Scheme, per_sample: bool) -> BatchAmax:
        scale = scale_from_amax(amax, s.fp8_max, s.amax_epsilon, s.power_2_scale) if per_sample else None
        return cls(amax, scale)

    @property
    def record(self) -> torch.Tensor:
        return self.amax

    def with_record(self, record: torch.Tensor) -> BatchAmax:
        return BatchAmax(record, self.scale)


def _cast(x: torch.Tensor, scale: torch.Tensor, s: Scheme) -> torch.Tensor:
    # Saturate as TE's kernels do (torch's cast gives NaN or inf past fp8_max); row-major
    # whatever x's strides, as cuBLAS's FP8 GEMMs take only row-major x column-major operands.
    return torch.clamp(x.float() * scale, -s.fp8_max, s.fp8_max).to(s.dtype, memory_format=torch.contiguous_format)


def batched_by_vmap(t: torch.Tensor) -> bool:
    """Whether `t` is batched by a torch.func.vmap, also under grad's wrapper (vmap(grad(f)))."""
    if torch.compiler.is_dynamo_compiling():
        # Dynamo cannot trace the unwrapping; what it traces directly has no grad wrapper.
        return _compat.is_batched(t)
    while _compat.is_wrapped(t):
        if _compat.is_batched(t):
            return True
        t = _compat.unwrap(t)
    return False


def abs_skipping_nan(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN as 0, in fp32: TE's fmax skips NaN, so a NaN neither freezes a delayed scale
    nor makes a block's scale NaN (the element still casts to NaN)."""
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


def _amax(x: torch.Tensor, known: torch.Tensor | None) -> torch.Tensor:
    # known: x's amax (), or the partial maxes (P,) of its pieces (a compiled producer's)
    return amax_of(x) if known is None else known.amax() if known.dim() == 1 else known


def _may_be_nonzero(n) -> bool:
    # No branch on a symbolic size (a routed group's): it would recompile for every routing.
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


def record_amax(state: DelayedState, amax: torch.Tensor) -> DelayedState:
    """`state` with amax () recorded in the current step's history slot (forward-only: as it is)."""
    # A DTensor's amax reduces over its shards: the history records the global value.
    full_tensor = getattr(amax, "full_tensor", None)
    amax = amax if full_tensor is None else full_tensor()
    history = state.amax_history
    if history is None:
        return state
    # Several casts in one step (microbatches) share one slot: keep the largest.
    fused = delayed_record(history, amax)       # eager CUDA: one kernel, the same bits
    if fused is not None:
        return DelayedState(fused, state.scale)
    return DelayedState(torch.cat([torch.maximum(history[:1], amax.reshape(1)), history[1:]]), state.scale)


def _fused_cast(x: torch.Tensor, s: Scheme, state: DelayedState | BatchAmax | None, with_transpose: bool,
                amax: torch.Tensor | None = None):
    """A tensor-wise cast by te_func.kernels, bit-identical: (q, q of x.T or None, new_state), or None."""
    if (s.rule == "delayed") != (state is not None):
        return None     # delayed without its state (an error below), or current with a batch amax
    delayed = state if isinstance(state, DelayedState) else None
    out = tensorwise_cast(x, s.dtype, s.fp8_max, s.amax_epsilon, s.power_2_scale,
                          None if delayed is None else delayed.scale, with_transpose, amax)
    if out is None:
        return None
    data, data_t, scale_inv, amax = out
    q_t = None if data_t is None else Quantized.tensorwise(data_t, scale_inv)
    return Quantized.tensorwise(data, scale_inv), q_t, None if delayed is None else record_amax(delayed, amax)


def _compiled_cast(x: torch.Tensor, s: Scheme, amax: torch.Tensor | None) -> Quantized | None:
    """Current scaling's cast of x under torch.compile on CUDA, or None: one kernel reduces the partial
    maxes of x's pieces and casts, the bits of `cast_with_scale` (a max is exact in any order)."""
    if amax is not None and amax.dim() == 1:
        partials = amax
    else:
        row = None if amax is not None else partial_rows(x)
        if row is None or batched_by_vmap(x):
            return None
        partials = abs_skipping_nan(x).reshape(-1, row).amax(1)
    data, scale_inv = cast_from_partials(x.reshape(-1, x.shape[-1]).contiguous(), partials, s.dtype, s.fp8_max,
                                         s.amax_epsilon, s.power_2_scale)
    return Quantized.tensorwise(data.reshape(x.shape), scale_inv)


def cast_with_scale(x: torch.Tensor, scale: torch.Tensor, s: Scheme) -> Quantized:
    """The tensor-wise cast of `x` with a given scale () fp32 (as quantize_scheme, given the scale)."""
    return Quantized.tensorwise(_cast(x, scale, s), torch.reciprocal(scale))


# --- runs of rows, each cast on its own (GroupedLinear's groups with their counts on the device) -----

def run_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The run each of `rows` rows belongs to, from the runs' ends `offs` (G,) int32, on the device."""
    ids = torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)
    return ids.clamp_(max=offs.shape[0] - 1)      # rows past the last run (refused by the caller) stay in bounds


def run_amaxes(x: torch.Tensor, ids: torch.Tensor, runs: int) -> torch.Tensor:
    """`amax_of` each run of x's rows (G,) fp32: max |x|, NaN skipped, 0 for an empty run."""
    rows = abs_skipping_nan(x).amax(1) if x.shape[1] else x.new_zeros(x.shape[0], dtype=torch.float32)
    return torch.zeros(runs, dtype=torch.float32, device=x.device).scatter_reduce(0, ids, rows, "amax")


def record_run_amaxes(histories: torch.Tensor, amaxes: torch.Tensor) -> torch.Tensor:
    """`record_amax` of each run's history (G, L) with its amax (G,), as G calls of it record them."""
    return torch.cat([torch.maximum(histories[:, :1], amaxes[:, None]), histories[:, 1:]], 1)


def cast_runs(x: torch.Tensor, ids: torch.Tensor, scales: torch.Tensor, s: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Each run of x's rows cast with its own tensor-wise scale (G,): (data (rows, cols), scale_inv (G,)),
    the bits of `cast_with_scale` run by run."""
    return _cast(x, scales[ids][:, None], s), torch.reciprocal(scales)


def _quantize_nvfp4(x: torch.Tensor, s: Scheme, rng: torch.Tensor | None, stream: int,
                    hadamard: bool = False) -> Quantized:
    """NVFP4 cast of a 2-D x (rows, cols), as TE's quantize kernels compute it:

        amax   = max |x| (NaN skipped)            S_enc = 2688 / amax,  S_dec = 1 / S_enc
        scale  = e4m3(block amax * S_enc / 6)     per 1x16 (or 16x16) block
        codes  = e2m1(x * 1 / (scale * S_dec))    nearest-even, or stochastic with `rng`

    hadamard: quantize x's random Hadamard transform along its rows (the weight-gradient GEMM's
    columnwise copy). `stream` numbers one cast's random bits (rowwise 0, columnwise 1, as TE).
    """
    if x.dim() != 2:
        raise ValueError(f"NVFP4 quantizes 2-D tensors (rows, cols), got shape {tuple(x.shape)}")
    if s.stochastic_rounding and rng is None:
        raise ValueError("NVFP4BlockScaling rounds gradients stochastically, which needs their RNG state "
                         "(te_func.quant.nvfp4.init_rng_state(seed)); layers keep one per GEMM in their "
                         "workspaces (tef.init_workspaces(model, recipe)), or set "
                         "NVFP4BlockScaling(disable_stochastic_rounding=True)")
    assert s.block is not None      # NVFP4's blocks
    v = (nvfp4.hadamard_transform(x) if hadamard else x).float()
    amax = amax_of(v)
    s_enc = nvfp4.global_encode_scale(amax)
    scale = nvfp4.block_decode_scale(torch.amax(abs_skipping_nan(_blocked(v, s.block)), dim=(1, 3)), s_enc)
    scaled = v * _expand(nvfp4.block_encode_scale(scale, torch.reciprocal(s_enc)), s.block, v.shape)
    if s.stochastic_rounding and rng is not None:       # (refused above without rng)
        codes = nvfp4.stochastic_round_to_e2m1(scaled, nvfp4.random_bytes(rng, stream, scaled.shape))
    else:
        codes = nvfp4.round_to_e2m1(scaled)
    return Quantized(nvfp4.pack_e2m1(codes), scale, s.block, amax, v.shape[1])


def quantize_scheme(x: torch.Tensor, s: Scheme, state=None, amax: torch.Tensor | None = None):
    """Quantize `x` by scheme `s`. Returns (Quantized, new_state).

    state: a DelayedState (new_state records x's amax); a BatchAmax in batch scope (new_state:
    the larger amax); NVFP4's RNG state (seed, counter) (new_state: the next); else None.
    amax: max |x| () or the maxes (P,) of x's pieces, where x's producer took them: a
    tensor-wise scheme uses it instead of a pass over x.
    """
    if s.nvfp4:
        return _quantize_nvfp4(x, s, state, 0), None if state is None else nvfp4.advance_rng(state)
    if s.block is None:
        if s.rule == "delayed" and state is None:
            raise ValueError("DelayedScaling needs its state (amax history and scale): call the "
                             "layer through tef.functional_call / tef.Stateful with workspaces "
                             "from tef.init_workspaces(model, recipe)")
        fused = _fused_cast(x, s, state, False, amax)
        if fused is not None:
            return fused[0], fused[2]
        if s.rule == "delayed":
            # A forward-only state (te_func.freeze) reads no amax: the reduction would be wasted.
            recorded = state if state.amax_history is None else record_amax(state, _amax(x, amax))
            scale, new_state = state.scale, recorded
        elif state is not None:     # batch scope (BatchAmax)
            batch_amax = torch.maximum(state.amax, _amax(x, amax))
            scale = (scale_from_amax(batch_amax, s.fp8_max, s.amax_epsilon, s.power_2_scale) if state.scale is None
                     else state.scale)
            new_state = state.with_record(batch_amax)
        else:
            compiled = _compiled_cast(x, s, amax)
            if compiled is not None:
                return compiled, None
            scale, new_state = scale_from_amax(_amax(x, amax), s.fp8_max, s.amax_epsilon, s.power_2_scale), None
        return cast_with_scale(x, scale, s), new_state

    if state is not None:
        raise ValueError(f"a {s.block} block scheme computes its scales from each block and takes no "
                         f"state, got {type(state).__name__}")
    blocks = _blocked(x, s.block)
    amax = torch.amax(abs_skipping_nan(blocks), dim=(1, 3))      # (row_blocks, col_blocks)
    if s.rule == "e8m0":
        scale_inv = e8m0_scale_inv(amax, s.fp8_max)
        scale = torch.reciprocal(e8m0_to_float(scale_inv))       # exact: a power of 2
    else:
        scale = scale_from_amax(amax, s.fp8_max, s.amax_epsilon, s.power_2_scale)
        scale_inv = torch.reciprocal(scale)
    data = _cast(x, _expand(scale, s.block, x.shape), s)
    return Quantized(data, scale_inv, s.block, None, None), None


def quantize(x: torch.Tensor, recipe, role: str = "input", state=None):
    """Quantize `x` as `recipe` quantizes tensors of `role` ("input", "weight" or "grad").
    Returns `(Quantized, new_state)`, the states as `quantize_scheme`'s. Under NVFP4 this is
    the rowwise copy (TE applies the Hadamard transform to the columnwise copy only)."""
    return quantize_scheme(x, scheme_for(recipe, role), state)


def transpose(q: Quantized) -> Quantized:
    """The cast of x.T from the cast of x, for schemes whose blocks are square."""
    if q.block is not None and q.block[0] != q.block[1]:
        raise ValueError(f"a {q.block} block cast cannot be transposed: quantize x.T instead")
    if q.global_amax is not None:     # NVFP4: unpack, transpose the codes, pack again; the same amax
        codes = nvfp4.unpack_e2m1(q.data, q.shape[-1]).t()
        scale_inv = q.scale_inv.t().clone(memory_format=torch.contiguous_format)
        return Quantized(nvfp4.pack_e2m1(codes), scale_inv, q.block, q.global_amax.clone(), q.data.shape[0])
    # clone, not contiguous(): a contiguous transpose would share storage, which checkpoints refuse.
    scale_inv = q.scale_inv if q.block is None else q.scale_inv.t().clone(memory_format=torch.contiguous_format)
    return Quantized(q.data.t().clone(memory_format=torch.contiguous_format), scale_inv, q.block, None, None)


def quantize_with_transpose(x: torch.Tensor, s: Scheme, state=None, amax: torch.Tensor | None = None):
    """Both copies a GEMM layer needs of a 2-D `x`: (q, q_t, new_state), q_t the cast of x.T."""
    if s.nvfp4:
        q = _quantize_nvfp4(x, s, state, 0)
        q_t = transpose(q) if s.transposable else _quantize_nvfp4(x.t(), s, state, 1, hadamard=s.hadamard)
        return q, q_t, None if state is None else nvfp4.advance_rng(state)
    fused = _fused_cast(x, s, state, True, amax) if s.block is None else None
    if fused is not None:     # one pass writes both copies
        return fused
    q, new_state = quantize_scheme(x, s, state, amax)
    if s.transposable:
        return q, transpose(q), new_state
    q_t, _ = quantize_scheme(x.t(), s, None)
    return q, q_t, new_state


def nvfp4_block_values(q: Quantized) -> torch.Tensor:
    """An NVFP4 tensor's e2m1 values times their block scales, fp32, (rows, 2 * bytes), without the
    per-tensor factor: exact (2 significant bits times 4 fit fp32, bf16 and tf32 alike)."""
    assert q.block is not None
    values = nvfp4.e2m1_values(nvfp4.unpack_e2m1(q.data))
    return values * _expand(q.scale_inv.float(), q.block, values.shape)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data * scale_inv, block by block, in `dtype`. NVFP4 as TE's dequantize kernel:
    e2m1 * fl(fl(scale_inv * global_amax) * fl32(1 / 2688)) in fp32; the result has `q.shape`."""
    if q.global_amax is not None and q.block is not None:     # NVFP4
        values = nvfp4.e2m1_values(nvfp4.unpack_e2m1(q.data, q.shape[-1]))
        factor = (q.scale_inv.float() * q.global_amax) * (1.0 / (nvfp4.E2M1_MAX * nvfp4.E4M3_MAX))
        return (values * _expand(factor, q.block, values.shape)).to(dtype)
    scale_inv = e8m0_to_float(q.scale_inv) if q.scale_inv.dtype == torch.uint8 else q.scale_inv.float()
    if q.block is not None:
        scale_inv = _expand(scale_inv, q.block, q.data.shape)
    return (q.data.float() * scale_inv).to(dtype)
