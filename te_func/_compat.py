"""The private torch internals te_func reads about torch.func's transform levels.

Checked on torch 2.11 (the GPU machine) and 2.13 (CPU). A torch upgrade that moves
them breaks here first: tests/test_higher_order.py runs every path through them.
"""
from __future__ import annotations

import torch
from torch._C import _functorch
from torch._functorch import pyfunctorch

__all__ = ["transform_levels", "base_tensor", "requires_grad", "forward_ad_active"]


def transform_levels() -> list[str]:
    """The torch.func transforms active now, outermost first: "grad", "jvp", "vmap" or
    "functionalize" each (torch.func.vjp and jacrev are "grad" levels, jacfwd a "jvp" one)."""
    kinds = {pyfunctorch.GradInterpreter: "grad", pyfunctorch.JvpInterpreter: "jvp",
             pyfunctorch.VmapInterpreter: "vmap", pyfunctorch.FunctionalizeInterpreter: "functionalize"}
    return [kinds.get(type(i), type(i).__name__) for i in pyfunctorch.retrieve_all_functorch_interpreters()]


def base_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` with every torch.func wrapper taken off: the tensor plain autograd sees."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


def requires_grad(t: torch.Tensor) -> bool:
    """Whether any autograd level tracks `t`: its own, or one under a torch.func wrapper (a
    vmap-batched tensor reads requires_grad False although plain autograd below tracks it)."""
    while True:
        if t.requires_grad:
            return True
        if not _functorch.is_functorch_wrapped_tensor(t):
            return False
        t = _functorch.get_unwrapped(t)


def forward_ad_active() -> bool:
    """Whether plain autograd's forward mode (torch.autograd.forward_ad.dual_level) is on."""
    return torch.autograd.forward_ad._current_level >= 0
