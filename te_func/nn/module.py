"""`TEModule`: what every te_func layer shares: its workspace spec and its call context."""
from __future__ import annotations

import torch
from torch import nn

from ..quant import Quantizer, delayed_state_spec, init_delayed_state, quantize_weight, weight_cast_spec
from ..recipe import DelayedScaling
from . import context

__all__ = ["TEModule", "weight_cast_entries", "delayed_state_entries"]


class TEModule(nn.Module):
    """A parameter holder whose forward runs one `te_func.functional` op.

    Subclasses list their FP8 GEMMs in `gemms()`; the layer's workspace (a
    cast per weight, DelayedScaling states per GEMM) follows from that list.
    """

    def gemms(self) -> list[tuple[str, dict[str, str]]]:
        """(weight parameter name, the GEMM's state names -> roles) of each FP8 GEMM;
        state names as `te_func.functional._common.state_names` makes them."""
        return []

    def workspace_spec(self, recipe) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Entry name -> (shape, dtype) of every entry this layer needs under `recipe`."""
        return self._entries(recipe, spec=True)

    def init_workspace(self, recipe) -> dict[str, torch.Tensor]:
        """Fresh entries: casts of the current weights, initial DelayedScaling states."""
        return self._entries(recipe, spec=False)

    def _entries(self, recipe, spec: bool) -> dict:
        entries = {}
        for name, states in self.gemms():
            weight = getattr(self, name)
            entries.update(weight_cast_entries(name, weight, recipe, spec))
            entries.update(delayed_state_entries(states, recipe, spec, device=weight.device))
        return entries

    def _bind(self, is_first_microbatch):
        return context.bind(self, type(self).__name__, is_first_microbatch)


def weight_cast_entries(name: str, weight: torch.Tensor, recipe, spec: bool):
    """The `{name}_cast.*` entries of one weight: their (shape, dtype), or a fresh cast."""
    if recipe is None:
        return {}
    if spec:
        return {f"{name}_cast.{k}": v for k, v in weight_cast_spec(weight.shape, Quantizer(recipe)).items()}
    # The initial cast is a placeholder (a step's first call quantizes anew); under
    # DelayedScaling it is made with the initial scale, 1.
    state = init_delayed_state(recipe, weight.device) if isinstance(recipe, DelayedScaling) else None
    _, entries = quantize_weight(weight.detach(), Quantizer(recipe), None, True, state)
    return {f"{name}_cast.{k}": v for k, v in entries.items() if k not in ("amax_history", "scale")}


def delayed_state_entries(names, recipe, spec: bool, device=None):
    """The DelayedScaling state entries `{name}_amax_history`, `{name}_scale` of each
    state name in `names`: their (shape, dtype), or fresh ones (history of zeros,
    scale 1). Empty for other recipes."""
    if not isinstance(recipe, DelayedScaling):
        return {}
    out = {}
    for name in names:
        if spec:
            out.update({f"{name}_{k}": v for k, v in delayed_state_spec(recipe).items()})
        else:
            out[f"{name}_amax_history"], out[f"{name}_scale"] = init_delayed_state(recipe, device)
    return out


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
