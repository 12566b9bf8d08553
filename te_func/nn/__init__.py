"""Modules: parameter holders with TransformerEngine's parameter names."""
from .module import TEModule
from .linear import Linear, TransposedLinear
from .normalization import LayerNorm, RMSNorm
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .grouped_linear import GroupedLinear
from .experts import Experts

__all__ = ["TEModule", "Linear", "TransposedLinear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP",
           "GroupedLinear", "Experts"]
