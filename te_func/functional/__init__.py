"""Per-op functions: tensors and one op-local workspace dict in, `(out, new_workspace)` out."""
from .linear import linear
from .normalization import layer_norm, rms_norm
from .layernorm_linear import layernorm_linear
from .layernorm_mlp import layernorm_mlp
from .grouped_linear import grouped_linear
from .experts import experts

__all__ = ["linear", "layer_norm", "rms_norm", "layernorm_linear", "layernorm_mlp", "grouped_linear", "experts"]
