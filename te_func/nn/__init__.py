"""Modules: parameter holders with TransformerEngine's parameter names."""
from .module import TEModule
from .linear import Linear
from .normalization import LayerNorm, RMSNorm
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .grouped_linear import GroupedLinear

__all__ = ["TEModule", "Linear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"]
