"""A vmap rule for `Tensor.view(dtype)` on torches that have none (2.11).

The scaling math reads fp32 bits (`round_down_pow2`, `e8m0_scale_inv`, `e8m0_to_float`) with
`x.view(torch.int32)` and back. torch 2.13 batches that view; torch 2.11, the GPU machine's, raises
"Batching rule not implemented for aten::view.dtype" under torch.func.vmap, so per-sample
gradients and vmapped ensembles failed there for MXFP8 and Float8BlockScaling (power-of-2 scales).
Where the rule is missing, te_func registers one for views between dtypes of one element size
(the only ones it makes): the same view of the unbatched tensor, the batch dim where it was.
Where torch has its own rule, nothing is registered.
"""
from __future__ import annotations

import torch

__all__ = ["ensure_view_dtype_batching", "registered"]

registered = False      # whether this process runs te_func's rule (tests read it)
_library = None         # kept alive: the registration lasts as long as this object


def _has_rule() -> bool:
    try:
        torch.vmap(lambda t: t.view(torch.int32))(torch.zeros(2, 1))
    except RuntimeError:
        return False
    return True


def _view_dtype(info, in_dims, x, dtype):
    if x.element_size() != torch.empty((), dtype=dtype).element_size():
        raise RuntimeError(f"te_func's vmap rule for Tensor.view(dtype) takes dtypes of one element size, "
                           f"not {x.dtype} -> {dtype}")
    return x.view(dtype), in_dims[0]


def ensure_view_dtype_batching(force: bool = False) -> bool:
    """Register the rule where this torch lacks one (or always with `force`, for tests in a
    process of their own: torch's own rule is then replaced). Returns whether te_func's rule is on."""
    global registered, _library
    if registered or (not force and _has_rule()):
        return registered
    try:    # functorch's helper behind torch.library.register_vmap
        from torch._functorch.autograd_function import custom_function_call_vmap_helper
        from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
    except ImportError:     # a torch without it: its own behaviour, the error above included
        return False
    op = torch.ops.aten.view.dtype

    def batched(keyset, x, dtype):
        return custom_function_call_vmap_helper(retrieve_current_functorch_interpreter(), _view_dtype, op, x, dtype)
    _library = torch.library.Library("aten", "IMPL")
    _library.impl("view.dtype", batched, "FuncTorchBatched", with_keyset=True)
    registered = True
    return registered
