"""The tables every cross-cutting test runs over: recipes and layers.

A new recipe or layer joins the transform matrix, the numerics checks and
the checkpoint tests by adding one row here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import te_func as tef
from te_func.quant.workspace import keeps_rng
from te_func.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                            NVFP4BlockScaling)

# (id, recipe). None is high precision.
RECIPES = [
    ("bf16", None),
    ("current", Float8CurrentScaling()),
    ("mxfp8", MXFP8BlockScaling()),
    ("block", Float8BlockScaling()),
    ("delayed", DelayedScaling(amax_history_len=4)),
    # TE's backward_override: the backward reads the forward's casts dequantized, or the original tensors
    ("current-bwd-dequantized", Float8CurrentScaling(backward_override="dequantized")),
    ("block-bwd-high-precision", Float8BlockScaling(backward_override="high_precision")),
    # TE's default NVFP4: 16x16 weight blocks, stochastically rounded gradients, Hadamard-transformed wgrad
    ("nvfp4", NVFP4BlockScaling()),
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
    # Whether the per-sample vmap column applies: vmap over dim 0 of the first
    # input, the other inputs shared (False for inputs like GroupedLinear's m_splits).
    per_sample: bool = True


def _tokens(features):
    return lambda batch, dtype: (torch.randn(batch, 8, features, dtype=dtype),)


def _grouped_inputs(batch, dtype):
    # Tokens of the whole batch split over 3 GEMMs, one of them empty; a list for
    # torch.compile, which cannot trace FP8 over a tensor's data-dependent sizes.
    return (torch.randn(batch, 8, 64, dtype=dtype), [3 * batch, 0, 5 * batch])


LAYERS = [
    LayerCase("Linear", lambda dt: tef.nn.Linear(64, 48, params_dtype=dt), _tokens(64)),
    LayerCase("LayerNorm", lambda dt: tef.nn.LayerNorm(64, params_dtype=dt), _tokens(64)),
    LayerCase("RMSNorm", lambda dt: tef.nn.RMSNorm(64, zero_centered_gamma=True, params_dtype=dt), _tokens(64)),
    LayerCase("LayerNormLinear", lambda dt: tef.nn.LayerNormLinear(64, 48, params_dtype=dt), _tokens(64)),
    LayerCase("LayerNormMLP-gelu", lambda dt: tef.nn.LayerNormMLP(64, 96, params_dtype=dt), _tokens(64)),
    LayerCase("LayerNormMLP-swiglu", lambda dt: tef.nn.LayerNormMLP(64, 96, normalization="RMSNorm",
                                                                    activation="swiglu", params_dtype=dt),
              _tokens(64)),
    LayerCase("GroupedLinear", lambda dt: tef.nn.GroupedLinear(3, 64, 48, params_dtype=dt), _grouped_inputs,
              per_sample=False),
]


def needs_state(recipe) -> bool:
    """Whether `recipe` keeps state between steps, so it cannot run under tef.autocast: DelayedScaling's
    amax histories, the random streams of NVFP4's stochastic rounding."""
    return isinstance(recipe, DelayedScaling) or keeps_rng(recipe)


def is_fp4(recipe) -> bool:
    return isinstance(recipe, NVFP4BlockScaling)


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||out - ref||), in float64."""
    ref, out = ref.double(), out.double()
    if torch.equal(ref, out):
        return float("inf")     # also an all-zero gradient (an empty group) computed exactly
    return (20 * torch.log10(ref.norm() / (out - ref).norm())).item()


def detached_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What tef.functional_call / tef.grad take as `params`."""
    return {k: v.detach() for k, v in model.named_parameters()}
