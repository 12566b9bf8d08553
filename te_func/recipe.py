"""Quantization recipes with TransformerEngine 2.20's names, fields and defaults.

Every recipe is a frozen, hashable dataclass: a constant to torch.compile, and remembered by value
by the workspaces it makes (`fingerprint`). Every TE field is accepted with TE's default (and
its `NVTE_*` variable, read when the recipe is made); a field te_func cannot honour is refused
by name. docs/recipes.md has the table of every field."""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["Format", "QParams", "MMParams", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
           "Float8BlockScaling", "NVFP4BlockScaling", "Recipe", "ROLES", "fingerprint"]

# The tensors a GEMM layer quantizes: its input, its weight, and its output's gradient.
ROLES = ("input", "weight", "grad")
BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


def _env_flag(name: str):
    """A default read from the environment when the recipe is made: TE's `NAME=1` switches."""
    return field(default_factory=lambda: os.environ.get(name, "0") == "1", metadata={"env": name, "static": False})


def _env_str(name: str, default, upper: bool = False):
    def read():
        v = os.environ.get(name, default)
        return v.upper() if upper and isinstance(v, str) else v
    return field(default_factory=read, metadata={"env": name, "static": default})


def _backward_override():
    return _env_str("NVTE_BACKWARD_OVERRIDE", None)


# --- recipe identity -----------------------------------------------------------------------------

def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2   # 62 bits


def _static_default(f: dataclasses.Field):
    # The default a field has with no environment variable set.
    if "static" in f.metadata:
        return f.metadata["static"]
    return f.default_factory() if callable(f.default_factory) else f.default


def _changed_fields(recipe) -> dict:
    return {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)
            if getattr(recipe, f.name) != _static_default(f)}


def describe(recipe) -> str:
    """`recipe` by its class and the fields that differ from their defaults: DelayedScaling(margin=1)."""
    if recipe is None:
        return "None (high precision)"
    return f"{type(recipe).__name__}({', '.join(f'{k}={v!r}' for k, v in _changed_fields(recipe).items())})"


# fingerprint -> a recipe of it: the recipes made in this process (and each class's defaults), so
# that a mismatch can name the recipe workspaces were made for.
_seen: dict[int, object] = {}


def _remember_fingerprint(recipe) -> None:
    # Workspaces record their recipe by this number: of the class and the fields that differ from
    # their defaults, so a field added later leaves fingerprints alone. Computed once here, as
    # torch.compile reads a constant's attribute but would not trace sha256.
    changed = [f"{k}={v!r}" for k, v in _changed_fields(recipe).items()]
    object.__setattr__(recipe, "_fingerprint", _digest(f"{type(recipe).__name__}({', '.join(changed)})"))
    object.__setattr__(recipe, "_derived", {})
    _seen.setdefault(recipe._fingerprint, recipe)


# key -> function of a recipe: what the floors above derive from every recipe (te_func.quant's
# schemes and lowering, te_func.ops' GEMM configs), registered as they are imported.
_DERIVATIONS: dict = {}


def derivation(key, make) -> None:
    """Register `make(recipe)` as what `derived(recipe, key)` returns."""
    _DERIVATIONS[key] = make


def derived(recipe, key):
    """What the derivation `key` makes of `recipe`, made once per recipe: a recipe is frozen, and a
    torch.compile trace then reads the value where it would interpret its making (hashing a recipe
    alone traces its enums). The first eager call makes every derivation at once, so a trace finds
    every key or none and an eager call after it adds none (a key added would fail its guards)."""
    memo = getattr(recipe, "_derived", None)
    if memo is not None and key in memo:
        return memo[key]
    if memo is None or torch.compiler.is_compiling():     # not a recipe; or a trace, which only reads
        return _DERIVATIONS[key](recipe)
    for k, make in list(_DERIVATIONS.items()):
        if k not in memo:
            memo[k] = make(recipe)
    return memo[key]


def fingerprint(recipe) -> int:
    """A 62-bit number that names `recipe` (None: high precision) by value."""
    return _digest("None") if recipe is None else recipe._fingerprint


def recipe_of(fp: int):
    """The recipe whose fingerprint is `fp`, where this process has seen it (None: high precision);
    raises KeyError where it has not."""
    if fp == fingerprint(None):
        return None
    if fp not in _seen:
        for cls in RECIPES:     # each class's defaults
            cls()
    return _seen[fp]


def difference(made_for, given) -> str:
    """What differs between two recipes, briefly: their classes, or the fields whose values differ."""
    fields = [] if type(made_for) is not type(given) else \
        [f.name for f in dataclasses.fields(given) if getattr(made_for, f.name) != getattr(given, f.name)]
    if not fields:      # other classes (or defaults an environment variable changed)
        return f"made for {describe(made_for)}, run with {describe(given)}"
    return f"{type(given).__name__} with " + ", ".join(
        f"{k}={getattr(made_for, k)!r} (made for) vs {getattr(given, k)!r} (given)" for k in fields)


# --- the parts -----------------------------------------------------------------------------------

class Format(enum.Enum):
    """Each pass's low-precision type. HYBRID: E4M3 forward, E5M2 gradients; E2M1: NVFP4's."""
    E2M1 = "E2M1"
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    def __repr__(self) -> str:
        return f"Format.{self.name}"

    def dtype(self, role: str) -> torch.dtype:
        """The FP8 dtype of tensors of `role` ("input", "weight" or "grad")."""
        if self is Format.E2M1:
            raise ValueError("Format.E2M1 has no torch dtype: NVFP4 values are packed two per byte "
                             "(te_func.quant's NVFP4 scheme)")
        if self is Format.E5M2 or (self is Format.HYBRID and role == "grad"):
            return torch.float8_e5m2
        return torch.float8_e4m3fn

    def max(self, role: str) -> float:
        """The largest finite value: 448 for E4M3, 57344 for E5M2, 6 for E2M1."""
        if self is Format.E2M1:
            return 6.0
        return torch.finfo(self.dtype(role)).max


@dataclass(frozen=True)
class QParams:
    """Per-role quantization options (TE's `QParams`)."""
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    # NVFP4's options; the FP8 recipes take none of them.
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def fp4_options(self) -> list[str]:
        return [n for n in ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization")
                if getattr(self, n)]


@dataclass(frozen=True)
class MMParams:
    """GEMM options (TE's `MMParams`): use_split_accumulator=False is cuBLAS's FP8 fast accumulation
    (the exact emulation accumulates in fp32 either way)."""
    use_split_accumulator: bool = True


def _check_common(recipe, name: str, *, e5m2_ok: bool = False):
    if not isinstance(recipe.fp8_format, Format) or recipe.fp8_format is Format.E2M1:
        raise TypeError(f"{name}.fp8_format must be Format.E4M3 or Format.HYBRID, got {recipe.fp8_format!r}")
    if recipe.fp8_format is Format.E5M2 and not e5m2_ok:
        raise ValueError(f"{name}.fp8_format=Format.E5M2: pure E5M2 training is not supported (as in TE); "
                         f"use Format.HYBRID (E4M3 forward, E5M2 gradients) or Format.E4M3")
    for attention in ("fp8_dpa", "fp8_mha"):
        if getattr(recipe, attention):
            raise ValueError(f"{name}.{attention}=True asks for FP8 attention, and te_func has no attention "
                             f"layer; leave it False (attention stays in high precision)")
    if recipe.backward_override not in BACKWARD_OVERRIDES:
        raise ValueError(f"{name}.backward_override must be None, 'high_precision' or 'dequantized' "
                         f"(NVTE_BACKWARD_OVERRIDE), got {recipe.backward_override!r}")


def _check_qparams(recipe, name: str, fields=("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")):
    for f in fields:
        qp = getattr(recipe, f)
        if not isinstance(qp, QParams):
            raise TypeError(f"{name}.{f} must be a te_func.recipe.QParams, got {qp!r}")
        if qp.fp4_options():
            raise ValueError(f"{name}.{f}: {', '.join(qp.fp4_options())} are NVFP4 options "
                             f"(NVFP4BlockScaling); an FP8 recipe takes none of them")
        if qp.amax_epsilon < 0:
            raise ValueError(f"{name}.{f}.amax_epsilon must be >= 0, got {qp.amax_epsilon}")


# --- the recipes ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DelayedScaling:
    """Tensor-wise scales from a history of past amaxes: scale = (fp8_max / amax) / 2**margin,
    amax the history's max or newest entry (docs/delayed.md)."""
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    scaling_factor_compute_algo: None = None
    # Under torch.distributed, amaxes are all-reduced by max over the amax group.
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = _backward_override()

    def __post_init__(self):
        name = "DelayedScaling"
        if callable(self.amax_compute_algo) or self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"{name}.amax_compute_algo must be 'max' or 'most_recent', got "
                             f"{self.amax_compute_algo!r} (a callable is not supported: a recipe must be "
                             f"hashable so torch.compile can treat it as a constant)")
        if self.scaling_factor_compute_algo is not None:
            raise ValueError(f"{name}.scaling_factor_compute_algo: a callable is not supported (a recipe "
                             f"must be hashable so torch.compile can treat it as a constant); te_func "
                             f"computes TE's default, (fp8_max / amax) / 2**margin")
        if self.amax_history_len < 1:
            raise ValueError(f"{name}.amax_history_len must be >= 1, got {self.amax_history_len}")
        _check_common(self, name)
        if self.backward_override is not None:
            raise ValueError(f"{name}.backward_override={self.backward_override!r}: delayed scaling only "
                             f"supports None (as in TE); unset NVTE_BACKWARD_OVERRIDE")
        _remember_fingerprint(self)


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Tensor-wise scale from the tensor's own amax: scale = fp8_max / max(amax, eps)."""
    use_power_2_scales: bool = _env_flag("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES")
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = field(default_factory=QParams)
    fp8_quant_fwd_weight: QParams = field(default_factory=QParams)
    fp8_quant_bwd_grad: QParams = field(default_factory=QParams)
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = _backward_override()

    def __post_init__(self):
        _check_common(self, "Float8CurrentScaling")
        _check_qparams(self, "Float8CurrentScaling")
        _remember_fingerprint(self)

    def qparams(self, role: str) -> QParams:
        """The role's options; use_power_2_scales turns power-of-2 scales on for every role."""
        qp = {"input": self.fp8_quant_fwd_inp, "weight": self.fp8_quant_fwd_weight,
              "grad": self.fp8_quant_bwd_grad}[role]
        return dataclasses.replace(qp, power_2_scale=True) if self.use_power_2_scales else qp


@dataclass(frozen=True)
class MXFP8BlockScaling:
    """Blocks of 32 along the reduction dim with E8M0 scales (enable_2d_quantization: 32x32 weights)."""
    margin: int = 0       # accepted as TE does; TE's MXFP8 quantizers do not read it either
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = _backward_override()
    enable_2d_quantization: bool = False

    def __post_init__(self):
        _check_common(self, "MXFP8BlockScaling")
        _remember_fingerprint(self)


@dataclass(frozen=True)
class Float8BlockScaling:
    """DeepSeek-style blocks: 1x128 for inputs and gradients, 128x128 for weights. Scales are fp32,
    powers of 2 unless use_f32_scales (NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1) or QParams say otherwise."""
    use_f32_scales: bool = _env_flag("NVTE_FP8_BLOCK_SCALING_FP32_SCALES")
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_fwd_weight: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_bwd_grad: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = _backward_override()

    def __post_init__(self):
        name = "Float8BlockScaling"
        dims = {"x": self.x_block_scaling_dim, "w": self.w_block_scaling_dim, "grad": self.grad_block_scaling_dim}
        for k, v in dims.items():
            if v not in (1, 2):
                raise ValueError(f"{name}.{k}_block_scaling_dim must be 1 (1x128) or 2 (128x128), got {v}")
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if dims[a] == 2 and dims[b] == 2:
                raise ValueError(f"{name}: {a}_block_scaling_dim and {b}_block_scaling_dim are both 2; a GEMM of "
                                 f"two 128x128-block operands is not supported (as in TE)")
        for gemm in ("fprop", "dgrad", "wgrad"):
            if not getattr(self, f"fp8_gemm_{gemm}").use_split_accumulator:
                raise ValueError(f"{name}.fp8_gemm_{gemm}.use_split_accumulator must be True: block scaling "
                                 f"needs split accumulation (as in TE)")
        _check_common(self, name)
        _check_qparams(self, name)
        _remember_fingerprint(self)

    def qparams(self, role: str) -> QParams:
        """The role's options; use_f32_scales turns power-of-2 rounding off for every role."""
        qp = {"input": self.fp8_quant_fwd_inp, "weight": self.fp8_quant_fwd_weight,
              "grad": self.fp8_quant_bwd_grad}[role]
        return dataclasses.replace(qp, power_2_scale=False) if self.use_f32_scales else qp

    def block_dim(self, role: str) -> int:
        return {"input": self.x_block_scaling_dim, "weight": self.w_block_scaling_dim,
                "grad": self.grad_block_scaling_dim}[role]


_NVFP4_SCOPES = ("none", "weights", "activations", "all")


@dataclass(frozen=True)
class NVFP4BlockScaling:
    """NVFP4: E2M1 values in 1x16 blocks with E4M3 scales under one fp32 scale per tensor; 16x16
    weight blocks, stochastic rounding of gradients, a Hadamard transform for the weight gradient."""
    disable_rht: bool = _env_flag("NVTE_NVFP4_DISABLE_RHT")
    disable_stochastic_rounding: bool = _env_flag("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING")
    disable_2d_quantization: bool = _env_flag("NVTE_NVFP4_DISABLE_2D_QUANTIZATION")
    row_scaled_activation: bool = _env_flag("NVTE_NVFP4_ROW_SCALED_ACTIVATION")
    nvfp4_4over6: str = _env_str("NVTE_NVFP4_4OVER6", "none")
    nvfp4_4over6_e4m3_use_256: str = _env_str("NVTE_NVFP4_4OVER6_E4M3_USE_256", "all")
    nvfp4_4over6_err_mode: str = _env_str("NVTE_NVFP4_4OVER6_ERR_MODE", "MAE", upper=True)
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = _backward_override()

    def __post_init__(self):
        name = "NVFP4BlockScaling"
        if self.fp4_format is not Format.E2M1:
            raise ValueError(f"{name}.fp4_format must be Format.E2M1, got {self.fp4_format!r}")
        if self.fp8_format is not Format.E4M3:
            raise ValueError(f"{name}.fp8_format (the block scales' format) must be Format.E4M3, got "
                             f"{self.fp8_format!r}")
        for f, allowed in (("nvfp4_4over6", _NVFP4_SCOPES), ("nvfp4_4over6_e4m3_use_256", _NVFP4_SCOPES),
                           ("nvfp4_4over6_err_mode", ("MAE", "MSE"))):
            if getattr(self, f) not in allowed:
                raise ValueError(f"{name}.{f} must be one of {allowed}, got {getattr(self, f)!r}")
        if self.nvfp4_4over6 != "none":
            raise ValueError(f"{name}.nvfp4_4over6={self.nvfp4_4over6!r}: te_func does not implement 4over6 "
                             f"block scaling; leave it 'none' (NVTE_NVFP4_4OVER6 unset)")
        if self.row_scaled_activation:
            raise ValueError(f"{name}.row_scaled_activation=True: te_func does not implement row-scaled NVFP4 "
                             f"activations; leave it False (NVTE_NVFP4_ROW_SCALED_ACTIVATION unset)")
        _check_common(self, name)
        _remember_fingerprint(self)

    def qparams(self, role: str) -> QParams:
        """TE's derived per-role options (RHT, 2-D weight blocks, stochastic rounding of gradients)."""
        rht = not self.disable_rht
        # (random_hadamard_transform, stochastic_rounding, fp4_2d_quantization), every field given.
        options = {"input": (rht, False, False), "weight": (False, False, not self.disable_2d_quantization),
                   "grad": (rht, not self.disable_stochastic_rounding, False)}[role]
        return QParams(False, 0.0, *options)

    @property
    def fp4_quant_fwd_inp(self) -> QParams:
        return self.qparams("input")

    @property
    def fp4_quant_fwd_weight(self) -> QParams:
        return self.qparams("weight")

    @property
    def fp4_quant_bwd_grad(self) -> QParams:
        return self.qparams("grad")


Recipe = DelayedScaling | Float8CurrentScaling | MXFP8BlockScaling | Float8BlockScaling | NVFP4BlockScaling
RECIPES = (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling)
