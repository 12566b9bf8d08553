"""`Stateful`: the one place te_func mutates anything.

It holds a model and its workspaces and threads them through
`functional_call` step after step, so a te_func model trains like any
PyTorch module (`shell(x)`, `loss.backward()`, `optimizer.step()`).
"""
from __future__ import annotations

import torch
from torch import nn

from . import distributed
from .frame import (backward_keys, functional_call, init_workspaces, mark_static, upgrade_workspaces,
                    validate_workspaces)

__all__ = ["Stateful"]

_WS = "workspaces."


class Stateful(nn.Module):
    """`shell = Stateful(model, recipe)`; `out = shell(x, is_first_microbatch=...)`.

    `shell.parameters()` are the model's; `shell.workspaces` is the current
    workspace dict; `state_dict()` holds both (workspace entries under
    `workspaces.`), and `load_state_dict` restores both.

    Under DelayedScaling, backward (`loss.backward()`) records the grad-output
    amaxes into `shell.workspaces`, merged by max across the microbatches of a step.

    amax_group: with DelayedScaling(reduce_amax=True) under torch.distributed, the ranks
    whose amaxes are all-reduced, after each forward and each backward (None: the default
    group; see te_func.distributed.amax_reduction_group).
    """

    def __init__(self, model: nn.Module, recipe, *, amax_group=None):
        super().__init__()
        self.model = model
        self.recipe = recipe
        self.amax_group = amax_group
        self._amax_reduction = distributed.amax_reduction_group(recipe, amax_group)
        self._pending = {}       # backward amaxes waiting for their all-reduce at the end of backward
        self.workspaces = init_workspaces(model, recipe)
        self._make_grad_sinks()

    def _make_grad_sinks(self):
        self._grad_sinks = self._new_grad_sinks()

    def _new_grad_sinks(self) -> dict:
        # One zero leaf per grad history, added to the entry a forward reads:
        # its value is unchanged, and the history's "gradient" (the history with
        # the backward amax recorded) lands in the leaf's .grad, which the hook
        # merges into self.workspaces by max. The leaves live in a plain dict,
        # not as parameters or buffers, so no optimizer or state_dict sees them.
        sinks = {}
        for key in backward_keys(self.model, self.recipe):
            sink = torch.zeros_like(self.workspaces[key]).requires_grad_()
            sink.register_post_accumulate_grad_hook(lambda t, key=key: self._absorb(key, t))
            sinks[key] = sink
        return sinks

    def _absorb(self, key: str, sink: torch.Tensor):
        amax, sink.grad = sink.grad, None
        if self._amax_reduction is None:
            self.workspaces = {**self.workspaces, key: torch.maximum(self.workspaces[key], amax)}
            return
        # All-reduced once this backward is over, all entries at once (as TE does after a backward).
        if not self._pending:
            torch.autograd.Variable._execution_engine.queue_callback(self._absorb_reduced)
        self._pending[key] = torch.maximum(self._pending[key], amax) if key in self._pending else amax

    def _absorb_reduced(self):
        # Every rank reduces every grad history (zeros where its backward recorded nothing),
        # so the collective is the same on all ranks.
        pending, self._pending = self._pending, {}
        amaxes = {k: pending.get(k, torch.zeros_like(self.workspaces[k])) for k in self._grad_sinks}
        reduced = distributed.reduce_amax_slots(amaxes, self._amax_reduction)
        self.workspaces = {**self.workspaces, **{k: torch.maximum(self.workspaces[k], reduced[k]) for k in reduced}}

    def forward(self, *args, is_first_microbatch: bool | None = None, **kwargs):
        params = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        ws = self.workspaces
        if torch.is_grad_enabled() and self._grad_sinks:
            # Eager: fresh leaves per call, so microbatches may run their backwards in any
            # order (autograd would sum two uses of one leaf). Compiled: the leaves made
            # outside the graph, so each microbatch's backward must precede the next forward.
            sinks = self._grad_sinks if torch.compiler.is_compiling() else self._new_grad_sinks()
            ws = {**ws, **{k: ws[k] + sink for k, sink in sinks.items()}}
        out, new_ws = functional_call(self.model, params, ws, args, kwargs, recipe=self.recipe,
                                      is_first_microbatch=is_first_microbatch, amax_group=self.amax_group)
        self.workspaces = {**new_ws, **{k: new_ws[k].detach() for k in self._grad_sinks}}
        return out

    def reset_workspaces(self):
        """Fresh workspaces from the current weights (e.g. after loading new weights)."""
        self.workspaces = init_workspaces(self.model, self.recipe)
        self._make_grad_sinks()

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        sd = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for k, v in self.workspaces.items():
            sd[prefix + _WS + k] = v if keep_vars else v.detach()
        return sd

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Parameters and workspaces. With strict=False a checkpoint without workspaces
        (model weights only, e.g. converted from TE) loads too; fresh workspaces are then
        made from the loaded weights."""
        device = next(self.model.parameters(), torch.empty(0)).device
        ws = {k[len(_WS):]: v.to(device) for k, v in state_dict.items() if k.startswith(_WS)}
        rest = {k: v for k, v in state_dict.items() if not k.startswith(_WS)}
        if any(k.startswith("te_func.recipe=") for k in ws):     # written by te_func 0.1
            ws = upgrade_workspaces(ws, self.model, self.recipe)
        if not ws:
            if strict:
                raise KeyError("Stateful.load_state_dict: the checkpoint has no workspace entries (workspaces.*): "
                               "it holds weights only. Load it with strict=False, which loads the weights and "
                               "makes fresh workspaces from them")
            result = super().load_state_dict(rest, strict=strict, assign=assign)
            self.reset_workspaces()
            return result
        try:   # a clear error naming the recipe, or the missing or misshapen entry
            validate_workspaces(self.model, ws, self.recipe)
        except (KeyError, ValueError) as e:
            raise type(e)(f"Stateful.load_state_dict: the checkpoint does not fit this shell "
                          f"(recipe={self.recipe!r}): {e.args[0]}") from None
        result = super().load_state_dict(rest, strict=strict, assign=assign)
        mark_static(ws.values())
        self.workspaces = ws
        self._make_grad_sinks()
        return result

    def extra_repr(self) -> str:
        return f"recipe={self.recipe!r}" + ("" if self.amax_group is None else f", amax_group={self.amax_group!r}")
