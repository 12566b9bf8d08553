"""`Stateful`: the one place te_func mutates anything.

It holds a model and its workspaces and threads them through
`functional_call` step after step, so a te_func model trains like any
PyTorch module (`shell(x)`, `loss.backward()`, `optimizer.step()`).
"""
from __future__ import annotations

import torch
from torch import nn

from .frame import functional_call, init_workspaces, recipe_key

__all__ = ["Stateful"]

_WS = "workspaces."


class Stateful(nn.Module):
    """`shell = Stateful(model, recipe)`; `out = shell(x, is_first_microbatch=...)`.

    `shell.parameters()` are the model's; `shell.workspaces` is the current
    workspace dict; `state_dict()` holds both (workspace entries under
    `workspaces.`), and `load_state_dict` restores both.
    """

    def __init__(self, model: nn.Module, recipe):
        super().__init__()
        self.model = model
        self.recipe = recipe
        self.workspaces = init_workspaces(model, recipe)

    def forward(self, *args, is_first_microbatch: bool | None = None, **kwargs):
        params = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        out, self.workspaces = functional_call(self.model, params, self.workspaces, args, kwargs,
                                               recipe=self.recipe, is_first_microbatch=is_first_microbatch)
        return out

    def reset_workspaces(self):
        """Fresh workspaces from the current weights (e.g. after loading new weights)."""
        self.workspaces = init_workspaces(self.model, self.recipe)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        sd = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for k, v in self.workspaces.items():
            sd[prefix + _WS + k] = v if keep_vars else v.detach()
        return sd

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        ws = {k[len(_WS):]: v for k, v in state_dict.items() if k.startswith(_WS)}
        rest = {k: v for k, v in state_dict.items() if not k.startswith(_WS)}
        if recipe_key(self.recipe) not in ws:
            made_for = [k for k in ws if k.startswith("te_func.recipe=")]
            raise ValueError(f"Stateful.load_state_dict: the checkpoint's workspaces were made for "
                             f"{made_for[0][len('te_func.recipe='):] if made_for else '(none saved)'}, this "
                             f"shell runs recipe={self.recipe!r}")
        result = super().load_state_dict(rest, strict=strict, assign=assign)
        device = next(self.model.parameters(), torch.empty(0)).device
        self.workspaces = {k: v.to(device) for k, v in ws.items()}
        return result

    def extra_repr(self) -> str:
        return f"recipe={self.recipe!r}"
