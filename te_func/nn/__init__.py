"""Modules: parameter holders with TransformerEngine's parameter names."""
from .module import TEModule
from .linear import Linear

__all__ = ["TEModule", "Linear"]
