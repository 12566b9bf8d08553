"""Weight casts cached across microbatches, as explicit workspace entries.

A weight's workspace is a small dict holding both copies of its FP8 cast:
`data`/`scale_inv` (blocks along in_features, for the forward GEMM) and
`data_t`/`scale_inv_t` (the cast of weight.T, for the input-gradient GEMM).
Nothing here mutates the dict: a new one is returned.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .scheme import Scheme, scheme_for
from .tensor import DelayedState, Quantized, quantize_with_transpose

__all__ = ["Quantizer", "WeightCast", "quantize_weight", "weight_cast_spec", "made_by", "CAST_FIELDS"]

CAST_FIELDS = ("data", "scale_inv", "data_t", "scale_inv_t")


@dataclass(frozen=True)
class Quantizer:
    """What to quantize a tensor to: a recipe and the tensor's role in the GEMM."""
    recipe: object
    role: str = "weight"

    @property
    def scheme(self) -> Scheme:
        return scheme_for(self.recipe, self.role)


class WeightCast(NamedTuple):
    rowwise: Quantized      # cast of weight (out, in): forward GEMM
    columnwise: Quantized   # cast of weight.T (in, out): input-gradient GEMM


def made_by(scheme: Scheme) -> str:
    """The name of the (empty) entry that records which scheme made a cast.

    Casts of two recipes can share every shape and dtype (exact vs power-of-2
    scales, current vs delayed); the name tells them apart without reading
    data, so the check costs nothing and compiles to nothing.
    """
    return "made_by=" + scheme._name


def weight_cast_spec(shape, quantizer: Quantizer) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The entries a valid cache of a weight of `shape` holds: name -> (shape, dtype)."""
    s = quantizer.scheme
    out_f, in_f = shape
    return {"data": ((out_f, in_f), s.dtype), "scale_inv": (s.scale_shape((out_f, in_f)), s.scale_dtype),
            "data_t": ((in_f, out_f), s.dtype), "scale_inv_t": (s.scale_shape((in_f, out_f)), s.scale_dtype),
            made_by(s): ((0,), torch.float32)}


def _valid(weight: torch.Tensor, quantizer: Quantizer, workspace) -> bool:
    # Unlike TE, validity covers shape, dtype, format and scaling layout: a cast
    # made for another weight or recipe is never reused.
    if workspace is None:
        return False
    for name, (shape, dtype) in weight_cast_spec(weight.shape, quantizer).items():
        t = workspace.get(name)  # a cast made by another scheme lacks this scheme's made_by entry
        if t is None or tuple(t.shape) != shape or t.dtype != dtype or t.device != weight.device:
            return False
    return True


def quantize_weight(weight: torch.Tensor, quantizer: Quantizer, workspace: dict | None,
                    cache: bool | None, state: DelayedState | None = None):
    """Return `(WeightCast, new_workspace)` for a 2-D weight.

    cache (TE's `is_first_microbatch`): True and None quantize and store the
    cast; False reuses the stored cast when it is valid for this weight and
    quantizer (same shape, dtype, device and scheme: see `made_by`), else
    quantizes and stores. `state` is the
    weight's DelayedState; it is returned updated inside the workspace only on
    a fresh cast (a cache hit records no amax).
    """
    workspace = {} if workspace is None else workspace
    if cache is False and _valid(weight, quantizer, workspace):
        w = workspace
        return WeightCast(Quantized(w["data"], w["scale_inv"], quantizer.scheme.block),
                          Quantized(w["data_t"], w["scale_inv_t"], quantizer.scheme.block)), workspace
    # The cast is a constant of the step: no gradient flows through it (the
    # GEMM layer returns the weight gradient to the weight itself).
    q, q_t, new_state = quantize_with_transpose(weight.detach(), quantizer.scheme, state)
    new_workspace = {k: v for k, v in workspace.items() if not k.startswith("made_by=")}
    if new_state is not None:
        new_workspace["amax_history"], new_workspace["scale"] = new_state
    # cache=None stores the fresh cast as well (TE would leave the old one in
    # place): then no later cache=False call can pick up the cast of older weights.
    new_workspace.update(data=q.data, scale_inv=q.scale_inv, data_t=q_t.data, scale_inv_t=q_t.scale_inv)
    new_workspace[made_by(quantizer.scheme)] = torch.empty(0, device=weight.device)
    return WeightCast(q, q_t), new_workspace
