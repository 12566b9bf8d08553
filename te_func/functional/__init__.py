"""Per-op functions: tensors and one op-local workspace dict in, `(out, new_workspace)` out."""
from .linear import linear

__all__ = ["linear"]
