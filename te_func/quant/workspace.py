"""The workspace format: what te_func keeps between calls, and the flat names users see.

Every FP8 GEMM of a layer keeps one `GemmWorkspace`: its weight's cast (`WeightCast`), and
per role (input, weight, output gradient) a DelayedScaling state, plus NVFP4's stochastic
rounding stream. `Gemm(weight)` names the GEMM, and every flat entry derives from that name.
docs/workspaces.md is the table of entries; tests/golden_workspaces.json pins them."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..recipe import fingerprint
from .scheme import Scheme
from .tensor import BatchAmax, DelayedState, Quantized, quantize_with_transpose

__all__ = ["FORMAT_VERSION", "RECIPE_KEY", "RECIPE_ENTRY", "CAST_FIELDS", "CarriedCast", "KINDS", "Entry", "Gemm",
           "GemmWorkspace", "WeightCast", "cast_entries", "cast_fields", "cast_layout", "is_cast_key",
           "cast_from_flat", "cast_to_flat", "make_cast", "fingerprint_entry", "ROLES_OF_GEMM"]

# 1: te_func 0.1; 2: this module; 3: MXFP8's E8M0 scales as uint8 (tef.upgrade_workspaces converts).
FORMAT_VERSION = 3
RECIPE_KEY = "te_func_recipe"

# A GEMM's three quantized tensors and the state names they are kept under.
ROLES_OF_GEMM = ("input", "weight", "grad")


# what an entry holds (docs/workspaces.md)
KINDS = ("cast", "amax_history", "scale", "batch_amax", "rng", "recipe")


class Entry(NamedTuple):
    """What one workspace entry must be. `backward`: its new value comes back as its "gradient"."""
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
        """Whether a call on one sample writes its amax here, so per-sample copies combine by max
        into the batch's; every other kind is the same in every sample's copy."""
        return self.kind in ("amax_history", "batch_amax")


class WeightCast(NamedTuple):
    rowwise: Quantized      # cast of weight (out, in): forward GEMM
    columnwise: Quantized   # cast of weight.T (in, out): input-gradient GEMM


class GemmWorkspace(NamedTuple):
    """One GEMM's workspace as typed values; a role's state is a DelayedState, a BatchAmax or None."""
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


def may_carry_backward_state(key: str) -> bool:
    """Whether `key` (op-local or prefixed) can name an entry a backward writes (Entry.backward):
    an output gradient's amax history (DelayedScaling) or its batch amax (batch scope). Read from
    the name, as Gemm.state_names makes it: tef.grad picks what to differentiate before the calls
    inside it declare their entries."""
    return key.endswith(("grad_amax_history", "grad_batch_amax"))


def cast_fields(s: Scheme) -> tuple[str, ...]:
    """The fields (CAST_FIELDS) a cast by scheme `s` keeps."""
    return ("data", "scale_inv", "data_t", *(() if _shared_scale(s) else ("scale_inv_t",)),
            *(("global_amax",) if s.nvfp4 else ()))


def cast_layout(shape: tuple[int, int], s: Scheme) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Field -> (shape, dtype) of the cast of a weight of `shape` (out, in) by scheme `s`, for the
    fields `cast_fields` names. Plain tuples: a call checks a cached cast against it, and a
    torch.compile trace reads it per GEMM."""
    out_f, in_f = shape
    layout = {"data": (s.data_shape((out_f, in_f)), s.dtype), "scale_inv": (s.scale_shape((out_f, in_f)),
                                                                            s.scale_dtype),
              "data_t": (s.data_shape((in_f, out_f)), s.dtype),
              "scale_inv_t": (s.scale_shape((in_f, out_f)), s.scale_dtype),
              # weights take no Hadamard transform: amax(w) = amax(w.T), one entry
              "global_amax": ((), torch.float32)}
    return {k: layout[k] for k in cast_fields(s)}


def cast_entries(shape: tuple[int, int], s: Scheme) -> dict[str, Entry]:
    """The entries of the cast of a weight of `shape` (out, in) by scheme `s`."""
    return {k: Entry(shape_, dtype, "cast") for k, (shape_, dtype) in cast_layout(shape, s).items()}


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
    """A weight that arrives already cast (an FP8 all-gather's output): `make_cast` takes its
    `te_func_weight_cast`. A base class, as torch.compile traces isinstance checks of subclasses."""

    def te_func_weight_cast(self, s: Scheme, state: DelayedState | None) -> tuple[WeightCast, DelayedState | None]:
        """(the weight's cast in both layouts, `state` with the weight's amax recorded)."""
        raise NotImplementedError


def make_cast(weight: torch.Tensor, s: Scheme, state: DelayedState | None = None):
    """(WeightCast, new_state): the cast of a 2-D weight, both layouts (or the one it carries)."""
    if isinstance(weight, CarriedCast):
        return weight.te_func_weight_cast(s, state)
    q, q_t, new_state = quantize_with_transpose(weight, s, state)
    return WeightCast(q, q_t), new_state


# --- one GEMM ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Gemm:
    """One FP8 GEMM of a layer, named by its weight parameter ("weight", "fc1_weight", "weight{i}"), or
    by a 3-D parameter and the index of its slice ("gate_up_proj{i}": expert i's, te_func.nn.Experts).
    Every key of the GEMM derives from this name, here; which entries exist under a recipe is
    its Lowering's (te_func.quant.lowering)."""
    weight: str

    def __post_init__(self):
        # Formed once, not at each of the ~30 reads a call makes per GEMM (a torch.compile trace
        # interprets every one). Not a field: torch.compile rebuilds a constant Gemm from its fields.
        index = self.weight.removeprefix("weight")
        if index.isdigit():                     # GroupedLinear's weight{i}
            prefix = f"gemm{index}_"
        elif self.weight.endswith("weight"):    # "weight", "fc1_weight"
            prefix = self.weight.removesuffix("weight")
        else:                                   # an expert's slice, "down_proj3"
            prefix = f"{self.weight}_"
        object.__setattr__(self, "_prefix", prefix)

    @property
    def prefix(self) -> str:
        """The prefix of the GEMM's activation states (the input's and the output gradient's)."""
        return self._prefix     # type: ignore[attr-defined]  # set in __post_init__

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
