"""The workspace format: what te_func keeps between calls, and the flat names users see.

Every FP8 GEMM of a layer keeps one `GemmWorkspace`, a small pytree:

    cast      WeightCast | None     the weight's FP8 cast in both layouts (None without a recipe)
    input     DelayedState | None   DelayedScaling only: the GEMM input's amax history and scale,
    weight    DelayedState | None   the weight's,
    grad      DelayedState | None   and the output gradient's (updated in backward)
    rng       Tensor | None         NVFP4 with stochastic rounding only: the output gradient's
                                    random stream (seed, counter)

`Gemm(weight)` names one GEMM of a layer by its weight parameter, and its
activation states' prefix follows (`Gemm.prefix`). Its flat, op-local entries
(the frame prefixes each with the layer's module path, like a state_dict):

    {weight}_cast.data            (out, in)     FP8   the forward GEMM's layout
    {weight}_cast.scale_inv       () or blocks        the decode factors of `data`
    {weight}_cast.data_t          (in, out)     FP8   the cast of weight.T, for the input gradient
    {weight}_cast.scale_inv_t     blocks              only for block scales: a tensor-wise
                                                      scale is one number for both layouts
    {weight}_cast.global_amax     ()   fp32           NVFP4 only: the weight's amax, its per-tensor
                                                      scale, the same for both layouts; NVFP4's
                                                      data is uint8 (two E2M1 codes a byte, the
                                                      last dim halved) and its block scales E4M3
    {prefix}input_amax_history    (L,) fp32     \\
    {prefix}input_scale           ()   fp32      |  DelayedScaling only
    {weight}_amax_history, {weight}_scale        |
    {prefix}grad_amax_history     (L,) fp32      |  updated in backward (`Entry.backward`)
    {prefix}grad_scale            ()   fp32     /
    {prefix}grad_rng_state        (2,) int64    NVFP4 with stochastic rounding (and no
                                                backward_override): (seed, counter) of the stream
                                                the output gradient is rounded with; a forward
                                                that may be differentiated reads it (its backward
                                                draws from it) and leaves the next counter, so
                                                each backward gets its own numbers and the state
                                                comes back with the forward's entries

and every workspace dict holds one more entry, `RECIPE_KEY`: the format
version and a fingerprint of the recipe it was made for (`fingerprint`).
Names are plain (`[A-Za-z0-9_.]+`), no two entries share storage, and the
list of names of each layer x recipe is pinned by tests/golden_workspaces.json.

Batch scope (te_func.vmapped: per-sample gradients quantized as the whole batch
is) adds, for one call and under tensor-wise current scaling only, the amax the
whole batch had (`Lowering.batch_entries`; never kept between calls):

    {prefix}input_batch_amax      ()   fp32      the GEMM input's
    {prefix}grad_batch_amax       ()   fp32      the output gradient's (updated in backward)

Each entry declares its `kind`, which says how the copies a per-sample vmap
makes of it combine into the whole batch's (`Entry.records_amax`).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..recipe import fingerprint
from .scheme import Scheme
from .tensor import BatchAmax, DelayedState, Quantized, quantize_with_transpose

__all__ = ["FORMAT_VERSION", "RECIPE_KEY", "RECIPE_ENTRY", "CAST_FIELDS", "CarriedCast", "KINDS", "Entry", "Gemm",
           "GemmWorkspace", "WeightCast", "cast_entries", "is_cast_key", "cast_from_flat", "cast_to_flat", "make_cast",
           "fingerprint_entry", "ROLES_OF_GEMM"]

# 1: te_func 0.1 (recipe repr and made_by= in key names); 2: this module.
# 3: MXFP8's E8M0 scales as uint8 (2: float8_e8m0fnu; tef.upgrade_workspaces converts).
FORMAT_VERSION = 3
RECIPE_KEY = "te_func_recipe"

# A GEMM's three quantized tensors and the state names they are kept under.
ROLES_OF_GEMM = ("input", "weight", "grad")


# What an entry holds: a weight cast's tensor; a DelayedScaling amax history or scale; a
# batch-scope amax; a random stream (NVFP4's stochastic rounding); the recipe fingerprint.
KINDS = ("cast", "amax_history", "scale", "batch_amax", "rng", "recipe")


class Entry(NamedTuple):
    """What one workspace entry must be. `kind`: one of KINDS. `backward`: its new value is
    computed in backward and comes back as the "gradient" of the entry (see te_func.frame.grad)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    backward: bool = False

    @property
    def stream(self) -> bool:
        """A random stream that a call hands its backward as it is and moves on."""
        return self.kind == "rng"

    @property
    def records_amax(self) -> bool:
        """Whether the entry records amaxes (histories, batch amaxes): a call on one sample writes
        that sample's amax there, so per-sample copies made from one state combine by max into
        the whole batch's. Every other kind (casts, scales, the fingerprint) is computed from the
        shared state and parameters alone, so it is the same in every sample's copy."""
        return self.kind in ("amax_history", "batch_amax")


class WeightCast(NamedTuple):
    rowwise: Quantized      # cast of weight (out, in): forward GEMM
    columnwise: Quantized   # cast of weight.T (in, out): input-gradient GEMM


class GemmWorkspace(NamedTuple):
    """One GEMM's workspace as typed values; see the module docstring. A role's state is a
    DelayedState under DelayedScaling, a BatchAmax in batch scope, else None."""
    cast: WeightCast | None
    input: DelayedState | BatchAmax | None = None
    weight: DelayedState | None = None
    grad: DelayedState | BatchAmax | None = None
    rng: torch.Tensor | None = None


# --- the weight cast -------------------------------------------------------------------------

# every name a cast's entries can have
CAST_FIELDS = ("data", "scale_inv", "data_t", "scale_inv_t", "global_amax")


def _shared_scale(s: Scheme) -> bool:
    # A tensor-wise cast and the cast of its transpose decode with the same one number.
    return s.block is None


def is_cast_key(key: str) -> bool:
    """Whether `key` (op-local or prefixed with a module path) names a weight cast's entry."""
    head, _, field = key.rpartition(".")
    return head.endswith("_cast") and field in CAST_FIELDS


def cast_entries(shape: tuple[int, int], s: Scheme) -> dict[str, Entry]:
    """The entries of the cast of a weight of `shape` (out, in) by scheme `s`."""
    out_f, in_f = shape
    entries = {"data": Entry(s.data_shape((out_f, in_f)), s.dtype, "cast"),
               "scale_inv": Entry(s.scale_shape((out_f, in_f)), s.scale_dtype, "cast"),
               "data_t": Entry(s.data_shape((in_f, out_f)), s.dtype, "cast")}
    if not _shared_scale(s):
        entries["scale_inv_t"] = Entry(s.scale_shape((in_f, out_f)), s.scale_dtype, "cast")
    if s.nvfp4:    # weights take no Hadamard transform: amax(w) = amax(w.T), one entry
        entries["global_amax"] = Entry((), torch.float32, "cast")
    return entries


def cast_to_flat(cast: WeightCast, s: Scheme) -> dict[str, torch.Tensor]:
    flat = {"data": cast.rowwise.data, "scale_inv": cast.rowwise.scale_inv, "data_t": cast.columnwise.data}
    if not _shared_scale(s):
        flat["scale_inv_t"] = cast.columnwise.scale_inv
    if cast.rowwise.global_amax is not None:     # NVFP4
        flat["global_amax"] = cast.rowwise.global_amax
    return flat


def cast_from_flat(flat: dict, s: Scheme) -> WeightCast:
    scale_inv_t = flat["scale_inv"] if _shared_scale(s) else flat["scale_inv_t"]
    amax = flat["global_amax"] if s.nvfp4 else None
    return WeightCast(Quantized(flat["data"], flat["scale_inv"], s.block, amax, None),
                      Quantized(flat["data_t"], scale_inv_t, s.block, amax, None))


class CarriedCast(torch.Tensor):
    """A weight that arrives already cast, such as an FP8 all-gather's output (te_func.distributed):
    a tensor subclass whose `te_func_weight_cast` `make_cast` takes instead of casting. A base
    class rather than a duck-typed method, because torch.compile traces isinstance checks of
    tensor subclasses."""

    def te_func_weight_cast(self, s: Scheme, state: DelayedState | None) -> tuple[WeightCast, DelayedState | None]:
        """(the weight's cast in both layouts, `state` with the weight's amax recorded)."""
        raise NotImplementedError


def make_cast(weight: torch.Tensor, s: Scheme, state: DelayedState | None = None):
    """The cast of a 2-D weight, both layouts (or the one it carries, see CarriedCast).
    Returns (WeightCast, new_state)."""
    if isinstance(weight, CarriedCast):
        return weight.te_func_weight_cast(s, state)
    q, q_t, new_state = quantize_with_transpose(weight, s, state)
    return WeightCast(q, q_t), new_state


# --- one GEMM ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Gemm:
    """One FP8 GEMM of a layer, named by its weight parameter: "weight" (Linear, LayerNormLinear),
    "fc1_weight" and "fc2_weight" (LayerNormMLP), "weight{i}" (GroupedLinear). Every key of the
    GEMM derives from this one name, here: its cast's entries, its states' (under the prefix
    the names give, "", "fc1_", "gemm{i}_", kept as the workspace format has always spelled
    them), its random stream, and its tensors' names inside the op (`slot`). Which entries
    exist under a recipe is the recipe's Lowering's (te_func.quant.lowering)."""
    weight: str

    @property
    def prefix(self) -> str:
        """The prefix of the GEMM's activation states (the input's and the output gradient's)."""
        index = self.weight.removeprefix("weight")
        return f"gemm{index}_" if index.isdigit() else self.weight.removesuffix("weight")

    @property
    def cast(self) -> str:
        """The name of the weight cast; its entries are `{cast}.{field}` (CAST_FIELDS)."""
        return f"{self.weight}_cast"

    @property
    def slot(self) -> str:
        """The prefix of this GEMM's tensors inside its op (te_func.ops.GemmSlot)."""
        return f"{self.weight}."

    def state_names(self) -> dict[str, str]:
        """role -> the name its DelayedScaling state (or batch amax) is kept under."""
        return {"input": f"{self.prefix}input", "weight": self.weight, "grad": f"{self.prefix}grad"}

    @property
    def rng_name(self) -> str:
        """The name of the output gradient's RNG state (NVFP4 with stochastic rounding)."""
        return f"{self.prefix}grad_rng_state"


# --- recipe identity --------------------------------------------------------------------------

RECIPE_ENTRY = Entry((2,), torch.int64, "recipe")


def fingerprint_entry(recipe, device=None) -> torch.Tensor:
    """The value of the RECIPE_KEY entry: int64 (format version, te_func.recipe.fingerprint)."""
    return torch.tensor([FORMAT_VERSION, fingerprint(recipe)], dtype=torch.int64, device=device)
