"""`linear`: TE's Linear as a function of tensors and one op-local workspace."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import GemmConfig, linear_fp8
from ._common import cast_weight, check_input, needs_weight_grad, schemes

__all__ = ["linear"]


def linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, recipe=None,
           workspace: dict | None = None, is_first_microbatch: bool | None = None):
    """y = inp @ weight.T + bias, in FP8 per `recipe` (None: exactly `F.linear`).

    inp: (..., in_features); weight: (out_features, in_features); bias: (out_features,).
    workspace: this op's entries (`weight_cast.*`), or None to cache nothing.
    Returns `(out, new_workspace)`, out of shape (..., out_features) in inp's dtype.
    """
    out_features, in_features = weight.shape
    check_input("Linear", inp, in_features, {"weight": weight, "bias": bias}, recipe)
    workspace = {} if workspace is None else workspace
    if recipe is None:
        return F.linear(inp, weight.to(inp.dtype), None if bias is None else bias.to(inp.dtype)), workspace
    cast, entries = cast_weight("weight", weight, recipe, workspace, is_first_microbatch)
    s_in, s_w, s_g = schemes(recipe)
    cfg = GemmConfig(s_in, s_w, s_g, save_input=needs_weight_grad(weight))
    x = inp.reshape(-1, in_features)                                   # (tokens, in)
    out = linear_fp8(x, weight, bias, cast, cfg)                       # (tokens, out)
    return out.reshape(*inp.shape[:-1], out_features), {**workspace, **entries}
