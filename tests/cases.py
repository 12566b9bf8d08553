"""The tables every cross-cutting test runs over: recipes and layers.

A new recipe or layer joins the transform matrix, the numerics checks and
the checkpoint tests by adding one row here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import te_func as tef
from te_func.recipe import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

# (id, recipe). None is high precision.
RECIPES = [
    ("bf16", None),
    ("current", Float8CurrentScaling()),
    ("mxfp8", MXFP8BlockScaling()),
    ("block", Float8BlockScaling()),
]


@dataclass(frozen=True)
class LayerCase:
    """One te_func layer as the shared tests drive it.

    make(dtype) builds the module; inputs(batch, dtype) draws fresh random
    positional arguments (the first is the token tensor, (batch, tokens, features));
    output(out) picks the tensor to differentiate from what forward returns.
    """
    name: str
    make: Callable[[torch.dtype], torch.nn.Module]
    inputs: Callable[[int, torch.dtype], tuple]
    output: Callable = lambda out: out
    kwargs: dict = field(default_factory=dict)


def _tokens(features):
    return lambda batch, dtype: (torch.randn(batch, 8, features, dtype=dtype),)


LAYERS = [
    LayerCase("Linear", lambda dt: tef.nn.Linear(64, 48, params_dtype=dt), _tokens(64)),
]
