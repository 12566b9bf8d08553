"""Checks and workspace plumbing shared by the per-op functions."""
from __future__ import annotations

import numbers

import torch

from .. import _compat

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_input(layer: str, inp: torch.Tensor, features: int, params: dict[str, torch.Tensor | None],
                recipe=None):
    """Clear errors for the misuses a layer can see from its arguments' metadata."""
    dtypes = FLOAT_DTYPES if recipe is not None else FLOAT_DTYPES + (torch.float64,)
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{layer}: input must be a torch.Tensor, got {type(inp).__name__}")
    if inp.dim() < 1:
        raise ValueError(f"{layer}: the input is a 0-d tensor; the layer takes (..., {features}) inputs, "
                         f"features last (x.reshape(-1, {features}))")
    if inp.shape[-1] != features:
        raise ValueError(f"{layer}: input's last dim must be in_features={features}, got input of shape "
                         f"{tuple(inp.shape)}; reshape the input or build the layer with "
                         f"in_features={inp.shape[-1]}")
    if inp.dtype not in dtypes:
        raise TypeError(f"{layer}: input dtype {inp.dtype} is not supported; use float32, bfloat16 or "
                        f"float16 (cast with inp.to(torch.bfloat16))")
    for name, p in params.items():
        if p is None:
            continue
        if p.dtype not in dtypes:
            raise TypeError(f"{layer}: parameter {name} has dtype {p.dtype}; use float32, bfloat16 or "
                            f"float16 (params_dtype=...)")
        if p.device != inp.device:
            raise ValueError(f"{layer}: input is on {inp.device} but parameter {name} is on {p.device}; "
                             f"move one of them (model.to(device) or inp.to(device))")
    if _check_finite:
        _assert_finite(layer, {"input": inp, **params})


# Off by default (it waits for the device); without it an inf saturates in the FP8 casts, as TE's.
_check_finite = False


def set_check_finite(enabled: bool) -> bool:
    """Make te_func layers raise on a NaN or inf in inputs or parameters (eager); returns the old setting."""
    global _check_finite
    previous, _check_finite = _check_finite, bool(enabled)
    return previous


def _assert_finite(layer: str, tensors: dict):
    if torch.compiler.is_compiling():
        return
    for name, t in tensors.items():
        if t is None:
            continue
        try:
            finite = bool(torch.isfinite(t).all())
        except RuntimeError:   # under vmap a batched tensor has no single truth value
            continue
        if not finite:
            bad = (~torch.isfinite(t)).sum().item()
            raise ValueError(f"{layer}: {name} holds {bad} non-finite value(s) (NaN or inf) out of "
                             f"{t.numel()}; find where they come from (te_func.set_check_finite(False) "
                             f"turns this check off)")


def autocast_input(inp: torch.Tensor) -> torch.Tensor:
    """The input in torch.autocast's dtype where autocast is on, as TE casts a layer's input."""
    device = inp.device.type
    if torch.is_autocast_enabled(device):
        return inp.to(torch.get_autocast_dtype(device))
    return inp


def first_microbatch(value, layer: str = "te_func") -> bool | None:
    """`is_first_microbatch` as None, True or False: any truth value (np.bool_, 0 / 1, a 0-d bool
    tensor) means what it says, where TE's identity test would start a new step on every call."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point:
            raise TypeError(f"{layer}: is_first_microbatch must be None, True or False, got a tensor of shape "
                            f"{tuple(value.shape)} and dtype {value.dtype}")
        if torch.compiler.is_compiling():
            raise TypeError(f"{layer}: under torch.compile is_first_microbatch must be a Python bool (it "
                            f"decides which entries the graph reads), got a tensor; pass bool(flag)")
        return bool(value.item())
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if isinstance(value, numbers.Integral) or numpy_bool:
        return bool(value)
    raise TypeError(f"{layer}: is_first_microbatch must be None, True or False, got {value!r}")


def needs_weight_grad(weight: torch.Tensor) -> bool:
    """Whether forward must keep what the weight-gradient GEMM reads. Under compile any grad-enabled
    call does: requires_grad reads False while dynamo traces torch.func.grad, as it does for a
    vmap-batched weight that autograd outside tracks (ensembles, MAML)."""
    if not torch.is_grad_enabled():
        return False
    return torch.compiler.is_compiling() or _compat.requires_grad(weight)
