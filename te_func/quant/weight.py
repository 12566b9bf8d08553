"""Weight casts cached across microbatches (TE's `is_first_microbatch`), without mutation:
`quantize_weight` reads and returns the cast as the flat dict `cast_entries` (`cast_layout`) defines."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .scheme import Scheme, scheme_for
from .tensor import DelayedState
from .workspace import CAST_FIELDS, WeightCast, cast_from_flat, cast_layout, cast_to_flat, make_cast

__all__ = ["Quantizer", "WeightCast", "quantize_weight", "cast_weight", "CAST_FIELDS"]


@dataclass(frozen=True)
class Quantizer:
    """What to quantize a tensor to: a recipe and the tensor's role in the GEMM."""
    recipe: object
    role: str = "weight"

    @property
    def scheme(self) -> Scheme:
        return scheme_for(self.recipe, self.role)


def _fits(weight: torch.Tensor, s: Scheme, flat: dict) -> bool:
    # Metadata only: shape, dtype and device of every entry (the frame checks the recipe).
    out_f, in_f = weight.shape
    for name, (shape, dtype) in cast_layout((out_f, in_f), s).items():
        t = flat.get(name)
        if t is None or tuple(t.shape) != shape or t.dtype != dtype or t.device != weight.device:
            return False
    return True


def cast_weight(weight: torch.Tensor, s: Scheme, cached: WeightCast | None, cache: bool | None,
                state: DelayedState | None = None):
    """The typed core of `quantize_weight`: (WeightCast, new_state, fresh). A fresh cast records the
    weight's amax into `state`; a cache hit records nothing, as in TE."""
    if cache is False and cached is not None and _fits(weight, s, cast_to_flat(cached, s)):
        return cached, state, False
    # A constant of the step: the GEMM layer returns the weight gradient to the weight itself.
    cast, new_state = make_cast(weight.detach(), s, state)
    return cast, new_state, True


def quantize_weight(weight: torch.Tensor, quantizer: Quantizer, workspace: dict | None,
                    cache: bool | None, state: DelayedState | None = None):
    """`(WeightCast, new_workspace)` for a 2-D weight. cache (TE's `is_first_microbatch`): True and
    None quantize and store; False reuses the stored cast where its entries fit the weight, else
    quantizes and stores. The weight's DelayedState is the GEMM's to keep, not stored here; other
    entries of `workspace` pass through."""
    workspace = {} if workspace is None else workspace
    s = quantizer.scheme
    cached = cast_from_flat(workspace, s) if _fits(weight, s, workspace) else None
    cast, _, fresh = cast_weight(weight, s, cached, cache, state)
    if not fresh:
        return cast, workspace
    # cache=None stores the fresh cast too: no later cache=False call reads an older weight's cast.
    kept = {k: v for k, v in workspace.items() if k not in CAST_FIELDS}   # no field of an older layout survives
    return cast, {**kept, **cast_to_flat(cast, s)}
