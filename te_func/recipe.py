"""FP8 recipes with TransformerEngine's names and defaults.

Every recipe is a frozen, hashable dataclass: torch.compile treats it as a
constant, and a workspace remembers which recipe made it by value.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["Format", "QParams", "DelayedScaling", "Float8CurrentScaling",
           "MXFP8BlockScaling", "Float8BlockScaling", "Recipe", "ROLES", "fingerprint"]

# The tensors a GEMM layer quantizes: its input (activations), its weight,
# and the gradient of its output in backward.
ROLES = ("input", "weight", "grad")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2   # 62 bits


def _remember_fingerprint(recipe) -> None:
    # Workspaces record which recipe made them by this number (te_func.quant.workspace).
    # Its text is the class and the fields that differ from their defaults, so a field
    # added later (with its default) leaves the fingerprints of existing recipes alone.
    # Computed once here: torch.compile reads an attribute of a constant recipe as a
    # constant, but would not trace sha256.
    changed = [f"{f.name}={getattr(recipe, f.name)!r}" for f in dataclasses.fields(recipe)
               if getattr(recipe, f.name) != _default(f)]
    object.__setattr__(recipe, "_fingerprint", _digest(f"{type(recipe).__name__}({', '.join(changed)})"))


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def fingerprint(recipe) -> int:
    """A 62-bit number that names `recipe` (None: high precision) by value."""
    return _digest("None") if recipe is None else recipe._fingerprint


class Format(enum.Enum):
    """Which FP8 type each pass uses. HYBRID: E4M3 forward, E5M2 for gradients."""
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    def __repr__(self) -> str:
        return f"Format.{self.name}"

    def dtype(self, role: str) -> torch.dtype:
        """The FP8 dtype of tensors of `role` ("input", "weight" or "grad")."""
        if self is Format.E5M2 or (self is Format.HYBRID and role == "grad"):
            return torch.float8_e5m2
        return torch.float8_e4m3fn

    def max(self, role: str) -> float:
        """The largest finite value of `dtype(role)`."""
        return torch.finfo(self.dtype(role)).max  # 448 for E4M3, 57344 for E5M2


@dataclass(frozen=True)
class QParams:
    """Per-role options of the current-scaling recipes (TE's `QParams`)."""
    power_2_scale: bool = False
    amax_epsilon: float = 0.0


@dataclass(frozen=True)
class DelayedScaling:
    """Tensor-wise scales computed from a history of past amaxes.

    scale = (fp8_max / amax) / 2**margin, amax = max over the history
    ("max") or its newest entry ("most_recent"). The state lives in
    workspaces; see `te_func.quant.DelayedState`.
    """
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    # Accepted for TE compatibility; single-process amax needs no reduction.
    reduce_amax: bool = True

    def __post_init__(self):
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be 'max' or 'most_recent', "
                f"got {self.amax_compute_algo!r} (callables are not supported: a recipe "
                f"must be hashable so torch.compile can treat it as a constant)")
        if self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling.amax_history_len must be >= 1, got {self.amax_history_len}")
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a te_func.recipe.Format, got {self.fp8_format!r}")
        _remember_fingerprint(self)


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Tensor-wise scale from the tensor's own amax: scale = fp8_max / max(amax, eps)."""
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = field(default_factory=QParams)
    fp8_quant_fwd_weight: QParams = field(default_factory=QParams)
    fp8_quant_bwd_grad: QParams = field(default_factory=QParams)

    def __post_init__(self):
        _remember_fingerprint(self)

    def qparams(self, role: str) -> QParams:
        return {"input": self.fp8_quant_fwd_inp, "weight": self.fp8_quant_fwd_weight,
                "grad": self.fp8_quant_bwd_grad}[role]


@dataclass(frozen=True)
class MXFP8BlockScaling:
    """Blocks of 32 along the reduction dimension, each with a power-of-2 E8M0 scale."""
    fp8_format: Format = Format.E4M3

    def __post_init__(self):
        _remember_fingerprint(self)


@dataclass(frozen=True)
class Float8BlockScaling:
    """DeepSeek-style blocks: 1x128 for inputs and gradients, 128x128 for weights.

    Scales are fp32, by default rounded down to powers of 2.
    """
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_fwd_weight: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_bwd_grad: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self):
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"Float8BlockScaling.{name} must be 1 (1x128) or 2 (128x128)")
        _remember_fingerprint(self)

    def qparams(self, role: str) -> QParams:
        return {"input": self.fp8_quant_fwd_inp, "weight": self.fp8_quant_fwd_weight,
                "grad": self.fp8_quant_bwd_grad}[role]

    def block_dim(self, role: str) -> int:
        return {"input": self.x_block_scaling_dim, "weight": self.w_block_scaling_dim,
                "grad": self.grad_block_scaling_dim}[role]


Recipe = DelayedScaling | Float8CurrentScaling | MXFP8BlockScaling | Float8BlockScaling
