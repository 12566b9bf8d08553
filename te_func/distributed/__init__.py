"""te_func on torch.distributed: FSDP2, FP8 all-gather, amax reduction, DTensor tensor parallelism.

What it promises (docs/distributed.md has the how-to):

- FSDP2 (`fully_shard`): te_func layers cast the whole (gathered) weight, as one
  process would, once per step; the workspaces are plain tensors, the same on
  every rank. Data-parallel training over N ranks computes what one process
  computes with the N ranks' batches as N microbatches of a step.
- FP8 all-gather (`enable_fsdp_float8_all_gather`, tensor-wise recipes): the
  shards travel in FP8 with a scale common to all ranks; the gathered cast is
  bit for bit the one a single process makes from the whole weight.
- Amax reduction (DelayedScaling's `reduce_amax`, over the group chosen by
  `amax_group=`): after every call and every backward all ranks hold the same
  histories and scales.
- Tensor parallelism (`ColwiseParallel`, `RowwiseParallel`, `LayerNormMLPParallel`
  with `parallelize_module`): outputs equal a single process's up to fp32
  rounding of the row-wise partial sums.
- Checkpoints (`state_dict` / `load_state_dict` with torch.distributed.checkpoint):
  parameters, optimizer state and workspaces; a resumed run is bit-identical; a
  checkpoint saved on N ranks loads on M.

Nothing below te_func.frame imports this package; the lower layers offer three
documented hooks it uses: `TEModule.init_workspace(recipe, weights=)`, a
weight that carries its cast (te_func.quant.workspace.CarriedCast), and the
global value of a DTensor's amax (te_func.quant.tensor.record_amax).
"""
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
