"""`te_func.nn.Linear`: TE's Linear as a parameter holder."""
from __future__ import annotations

import torch

from .. import functional as F
from ..functional._common import state_names
from ..quant import Quantizer, delayed_state_spec, init_delayed_state, quantize_weight, weight_cast_spec
from ..recipe import DelayedScaling
from .module import TEModule, make_param, te_init

__all__ = ["Linear", "weight_cast_entries", "delayed_state_entries"]


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
    state name in `names` (see te_func.functional._common.state_names): their
    (shape, dtype), or fresh ones (history of zeros, scale 1). Empty for other recipes."""
    if not isinstance(recipe, DelayedScaling):
        return {}
    out = {}
    for name in names:
        if spec:
            out.update({f"{name}_{k}": v for k, v in delayed_state_spec(recipe).items()})
        else:
            out[f"{name}_amax_history"], out[f"{name}_scale"] = init_delayed_state(recipe, device)
    return out


class Linear(TEModule):
    """y = x @ weight.T + bias, in FP8 under a recipe.

    Parameters as TE: `weight` (out_features, in_features), `bias` (out_features,).
    forward(inp (..., in_features), *, is_first_microbatch=None) -> (..., out_features),
    or `(out, bias)` with return_bias=True (the bias then not added, as in TE).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, params_dtype=None,
                 device=None, return_bias: bool = False):
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear: in_features and out_features must be positive, got "
                             f"{in_features}, {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.return_bias = return_bias
        self.weight = make_param((out_features, in_features), params_dtype, device, te_init())
        self.bias = make_param((out_features,), params_dtype, device) if bias else None

    def workspace_spec(self, recipe):
        return {**weight_cast_entries("weight", self.weight, recipe, spec=True),
                **delayed_state_entries(state_names(), recipe, spec=True)}

    def init_workspace(self, recipe):
        return {**weight_cast_entries("weight", self.weight, recipe, spec=False),
                **delayed_state_entries(state_names(), recipe, spec=False, device=self.weight.device)}

    def forward(self, inp: torch.Tensor, *, is_first_microbatch: bool | None = None):
        recipe, ws, ifm, commit = self._bind(is_first_microbatch)
        bias = None if self.return_bias else self.bias
        out, new_ws = F.linear(inp, self.weight, bias, recipe=recipe, workspace=ws, is_first_microbatch=ifm)
        commit(new_ws)
        if self.return_bias:
            return out, self.bias
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
