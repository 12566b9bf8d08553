"""`TEModule`: what every te_func layer shares: its workspace spec and its call context."""
from __future__ import annotations

import torch
from torch import nn

from . import context

__all__ = ["TEModule"]


class TEModule(nn.Module):
    """A parameter holder whose forward runs one `te_func.functional` op.

    Subclasses implement `workspace_spec(recipe)` (entry name -> (shape, dtype))
    and `init_workspace(recipe)` (entry name -> tensor).
    """

    def workspace_spec(self, recipe) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def init_workspace(self, recipe) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _bind(self, is_first_microbatch):
        return context.bind(self, type(self).__name__, is_first_microbatch)


def make_param(shape, dtype, device, init=None) -> nn.Parameter:
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"params_dtype must be float32, bfloat16 or float16 (float64 for high-precision "
                        f"references), got {dtype}")
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and not torch.cuda.is_available():
        # torch's own error here is a bare "Torch not compiled with CUDA enabled" assertion.
        raise RuntimeError(f"device={str(device)!r} was asked for, but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
                           f"use device='cpu' or install a CUDA build of torch on a machine with a GPU")
    t = torch.empty(shape, dtype=dtype, device=device)
    with torch.no_grad():
        init(t) if init is not None else t.zero_()
    return nn.Parameter(t)


def te_init(std: float = 0.023):
    """TE's default weight init: normal(0, 0.023)."""
    return lambda t: nn.init.normal_(t, 0.0, std)
