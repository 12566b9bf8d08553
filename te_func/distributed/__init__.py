"""te_func on torch.distributed: FSDP2, FP8 all-gather, amax reduction, DTensor tensor parallelism.

What each promises is in docs/distributed.md. Nothing below te_func.frame imports this package;
it uses three hooks of the lower floors: `TEModule.init_workspace(recipe, weights=)`, a weight
that carries its cast (te_func.quant.workspace.CarriedCast), and the global value of a DTensor's
amax (te_func.quant.tensor.record_amax)."""
from ._amax import amax_reduction_group
from ._amax import reduce_amax_slots as reduce_amax_slots
from ._checkpoint import load_state_dict, state_dict
from ._float8_all_gather import Float8AllGatherWeight, Float8GatheredWeight, enable_fsdp_float8_all_gather
# What te_func.frame calls (not public): re-exported by name, outside __all__
from ._fsdp import cast_sources as cast_sources
from ._fsdp import fsdp_units as fsdp_units
from ._fsdp import gathered_for_grad as gathered_for_grad
from ._fsdp import gathered_params as gathered_params
from ._fsdp import scattered_grads as scattered_grads
from ._tensor_parallel import check_layouts as check_layouts

__all__ = ["enable_fsdp_float8_all_gather", "Float8AllGatherWeight", "Float8GatheredWeight", "amax_reduction_group",
           "ColwiseParallel", "RowwiseParallel", "LayerNormMLPParallel", "state_dict", "load_state_dict"]

_STYLES = ("ColwiseParallel", "RowwiseParallel", "LayerNormMLPParallel")


def __getattr__(name):
    # The parallel styles subclass torch's, whose import takes seconds: made on first use.
    if name in _STYLES:
        from ._tensor_parallel import style
        return style(name)
    raise AttributeError(f"module 'te_func.distributed' has no attribute {name!r}")
