"""Checks and workspace plumbing shared by the per-op functions."""
from __future__ import annotations

import torch

from ..quant import Quantizer, quantize_weight, scheme_for

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_input(layer: str, inp: torch.Tensor, features: int, params: dict[str, torch.Tensor | None],
                recipe=None):
    """Clear errors for the misuses a layer can see from its arguments' metadata.

    High precision (recipe None) also takes float64, as the plain torch layer does.
    """
    dtypes = FLOAT_DTYPES if recipe is not None else FLOAT_DTYPES + (torch.float64,)
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{layer}: input must be a torch.Tensor, got {type(inp).__name__}")
    if inp.dim() < 1 or inp.shape[-1] != features:
        raise ValueError(f"{layer}: input's last dim must be in_features={features}, got input of shape "
                         f"{tuple(inp.shape)}; reshape the input or build the layer with "
                         f"in_features={inp.shape[-1] if inp.dim() else '?'}")
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


def sub(workspace: dict | None, prefix: str) -> dict | None:
    """The entries of `workspace` under `prefix.`, with the prefix stripped."""
    if workspace is None:
        return None
    p = prefix + "."
    return {k[len(p):]: v for k, v in workspace.items() if k.startswith(p)}


def prefixed(workspace: dict, prefix: str) -> dict:
    return {f"{prefix}.{k}": v for k, v in workspace.items()}


def cast_weight(name: str, weight, recipe, workspace, is_first_microbatch):
    """Quantize (or fetch from cache) the layer parameter `name`; returns (WeightCast, entries)."""
    cast, entries = quantize_weight(weight, Quantizer(recipe, "weight"), sub(workspace, f"{name}_cast"),
                                    is_first_microbatch)
    return cast, prefixed(entries, f"{name}_cast")


def schemes(recipe):
    return scheme_for(recipe, "input"), scheme_for(recipe, "weight"), scheme_for(recipe, "grad")


def needs_weight_grad(weight: torch.Tensor) -> bool:
    """Whether forward must keep what the weight-gradient GEMM reads.

    While dynamo traces torch.func.grad, requires_grad of the differentiated
    tensors reads False, so under compile any grad-enabled call keeps it.
    """
    return torch.is_grad_enabled() and (weight.requires_grad or torch.compiler.is_compiling())
