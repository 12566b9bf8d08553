"""`Stateful`: the one place te_func mutates anything.

It holds a model and its workspaces and threads them through
`functional_call` step after step, so a te_func model trains like any
PyTorch module (`shell(x)`, `loss.backward()`, `optimizer.step()`).
"""
from __future__ import annotations

import functools
import warnings
import weakref

import torch
from torch import nn

from . import distributed
from .frame import (backward_keys, backward_weights, functional_call, init_workspaces, mark_static,
                    upgrade_workspaces, validate_workspaces)
from .nn import TEModule
from .ops import on_backward
from .quant.workspace import RECIPE_KEY

__all__ = ["Stateful"]

_WS = "workspaces."


def _absorb(shell_ref, key: str, amax: torch.Tensor):
    """Merge a backward amax ((L,), zero but for slot 0) into the shell's history `key` by max.
    The shell is held weakly: a dropped shell is freed, however many graphs saw it."""
    shell = shell_ref()
    if shell is None or key not in shell.workspaces:
        return
    shell._recorded.add(key)
    amax = amax.detach().to(shell.workspaces[key].device)
    if shell._amax_reduction is None:
        ws = shell.workspaces
        shell.workspaces = {**ws, key: torch.maximum(ws[key], amax)}
        return
    # Under amax reduction: all-reduced once this backward is over, every entry in one
    # collective, as TE reduces after a backward.
    if not shell._pending_amaxes:
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_absorb_reduced, shell_ref))
    pending = shell._pending_amaxes
    pending[key] = torch.maximum(pending[key], amax) if key in pending else amax


def _absorb_reduced(shell_ref):
    shell = shell_ref()
    if shell is None:
        return
    pending, shell._pending_amaxes = shell._pending_amaxes, {}
    ws = shell.workspaces
    # Every rank reduces every grad history (zeros where its backward recorded nothing), so
    # the collective is the same on all ranks.
    amaxes = {k: pending.get(k, torch.zeros_like(ws[k])) for k in shell._backward_keys}
    reduced = distributed.reduce_amax_slots(amaxes, shell._amax_reduction)
    shell.workspaces = {**ws, **{k: torch.maximum(ws[k], v) for k, v in reduced.items()}}


def _weight_grad_seen(shell_ref, key: str, grad):
    # A tensor hook on a GEMM weight: a backward computes its gradient, so the GEMM's backward
    # ran and its amax should reach the shell before the backward ends (checked then).
    shell = shell_ref()
    if shell is None:
        return
    if not shell._expected:
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_check_recorded, shell_ref))
    shell._expected.add(key)


def _check_recorded(shell_ref):
    shell = shell_ref()
    if shell is None:
        return
    missing = sorted(shell._expected - shell._recorded)
    shell._expected, shell._recorded = set(), set()
    # Eager calls report their amaxes from the ops' own nodes, whatever the backward's inputs:
    # only a compiled call's can be lost.
    if missing and shell._compiled_call:
        warnings.warn(
            f"tef.Stateful: a backward computed the gradients of GEMM weights but DelayedScaling's backward "
            f"amaxes of {missing} did not reach the shell, so the next step's gradient scales come from older "
            f"history. torch.autograd.grad(loss, params) and loss.backward(inputs=...) over a compiled shell "
            f"skip the leaves that carry those amaxes out of the compiled graph. Call loss.backward() (over "
            f"all inputs) on a compiled shell, or run the shell uncompiled, or train through tef.grad / "
            f"tef.value_and_grad, which return the amaxes with the workspaces", RuntimeWarning, stacklevel=2)


def _remove_hooks(handles: list):
    for handle in handles:
        handle.remove()
    handles.clear()


def _absorb_sink(shell_ref, key: str, sink: torch.Tensor):
    if sink.grad is not None:
        _absorb(shell_ref, key, sink.grad)
        sink.grad = None


_WEIGHTS_ONLY = ("the checkpoint has no workspace entries (workspaces.*): it holds weights only. Load it with "
                 "strict=False, which loads the weights and makes fresh workspaces from them")


def _after_load(shell: "Stateful", incompatible_keys):
    # A load_state_dict post-hook: it runs once the model below has its weights, so fresh
    # workspaces (a weights-only checkpoint) are made from the loaded weights. A strict load
    # then fails on the workspace entries reported missing here.
    pending, shell._pending_load = shell._pending_load, None
    if pending is None:
        return
    ws, prefix = pending
    if ws:
        shell._set_workspaces(ws)
    else:
        shell.reset_workspaces()
        incompatible_keys.missing_keys.extend(prefix + _WS + k for k in shell.workspaces)


class Stateful(nn.Module):
    """`shell = Stateful(model, recipe)`; `out = shell(x, is_first_microbatch=...)`.

    `shell.parameters()` are the model's; `shell.workspaces` is the current
    workspace dict (replaced, never modified, by each call); the state_dict
    holds both (workspace entries under `workspaces.`), also as a submodule of
    a larger model, and `.to(device)` moves both.

    Under DelayedScaling, backward records the grad-output amaxes into
    `shell.workspaces`, merged by max into the current step's slot: through
    `loss.backward()`, `backward(inputs=...)` and `torch.autograd.grad` alike; over
    a compiled shell through `loss.backward()` only (the others warn that the
    amaxes were lost: docs/stateful.md).

    amax_group: with DelayedScaling(reduce_amax=True) under torch.distributed, the ranks
    whose amaxes are all-reduced, after each forward and each backward (None: the default
    group; see te_func.distributed.amax_reduction_group).
    """

    def __init__(self, model: nn.Module, recipe, *, amax_group=None):
        super().__init__()
        if recipe is not None and not any(isinstance(m, TEModule) for m in model.modules()):
            raise ValueError(f"tef.Stateful: {type(model).__name__} has no te_func layers, so recipe="
                             f"{type(recipe).__name__} would change nothing; convert it first: "
                             f"tef.Stateful(tef.convert(model), recipe)")
        self.model = model
        self.recipe = recipe
        self.amax_group = amax_group
        self._amax_reduction = distributed.amax_reduction_group(recipe, amax_group)
        self._pending_amaxes = {}      # backward amaxes waiting for the all-reduce at the end of a backward
        self._pending_load = None
        self._set_workspaces(init_workspaces(model, recipe))
        self.register_load_state_dict_post_hook(_after_load)

    # --- workspaces and the grad sinks --------------------------------------------------------

    def _set_workspaces(self, ws: dict):
        mark_static(ws.values())
        self.workspaces = ws
        self._make_sinks()

    def _make_sinks(self):
        # Compiled calls: autograd's only way out of a compiled graph is a gradient, so each
        # grad history is read as `entry + sink`, a zero leaf made here (outside the graph),
        # whose gradient (the backward amax) a hook merges into self.workspaces. Eager calls
        # hear of it from the op itself (see forward). The leaves live in a plain dict, not as
        # parameters or buffers: no optimizer or state_dict sees them.
        self._backward_keys = backward_keys(self.model, self.recipe)
        self._sinks = {}
        me = weakref.ref(self)
        for key in self._backward_keys:
            sink = torch.zeros_like(self.workspaces[key]).requires_grad_()
            sink.register_post_accumulate_grad_hook(functools.partial(_absorb_sink, me, key))
            self._sinks[key] = sink
        self._watch_weights(me)

    def _watch_weights(self, me):
        # Each GEMM weight that trains tells the shell when a backward computes its gradient, so
        # a backward whose amax never arrived (autograd.grad over a compiled shell) is reported
        # (_check_recorded) rather than lost silently. Hooks are tensors' own: copies and
        # pickles of the parameters drop them, and the copy's shell registers its own.
        hooks = getattr(self, "_weight_hooks", None)
        if hooks is None:
            hooks = self._weight_hooks = []
            # A dropped shell takes its hooks off the weights: the model may outlive it.
            weakref.finalize(self, _remove_hooks, hooks)
        _remove_hooks(hooks)
        self._expected, self._recorded, self._compiled_call = set(), set(), False
        for key, w in backward_weights(self.model, self.recipe).items():
            if isinstance(w, torch.Tensor) and w.requires_grad and w.is_leaf:
                hooks.append(w.register_hook(functools.partial(_weight_grad_seen, me, key)))

    def _watcher(self):
        me, keys = weakref.ref(self), set(self._backward_keys)

        def watch(entries: dict):
            for key in keys.intersection(entries):
                on_backward(entries[key], functools.partial(_absorb, me, key))
        return watch

    def reset_workspaces(self):
        """Fresh workspaces from the current weights (e.g. after loading new weights)."""
        self._set_workspaces(init_workspaces(self.model, self.recipe))

    # --- the call -----------------------------------------------------------------------------

    def forward(self, *args, is_first_microbatch: bool | None = None, **kwargs):
        params = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        ws, watch = self.workspaces, None
        if torch.is_grad_enabled() and self._backward_keys:
            if torch.compiler.is_compiling():
                # The same leaves each call: run each microbatch's backward before the next forward.
                ws = {**ws, **{k: ws[k] + sink for k, sink in self._sinks.items()}}
                self._compiled_call = True      # its amaxes leave through the sinks only (_check_recorded)
            else:
                # A leaf per call and a hook on each op's node: backwards may come in any order,
                # and the op reports its amax even where autograd drops the leaf's gradient
                # (autograd.grad(loss, params), backward(inputs=...)).
                ws = {**ws, **{k: ws[k].detach().requires_grad_() for k in self._backward_keys}}
                watch = self._watcher()
                self._compiled_call = False
        out, new_ws = functional_call(self.model, params, ws, args, kwargs, recipe=self.recipe,
                                      is_first_microbatch=is_first_microbatch, amax_group=self.amax_group,
                                      _watch=watch)
        self.workspaces = {**new_ws, **{k: new_ws[k].detach() for k in self._backward_keys}}
        return out

    # --- modules around it: state_dict, copies, devices ---------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for k, v in self.workspaces.items():
            destination[prefix + _WS + k] = v if keep_vars else v.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        p = prefix + _WS
        ours = [k for k in state_dict if k.startswith(p)]
        unexpected_keys[:] = [k for k in unexpected_keys if not k.startswith(p)]
        device = next(self.model.parameters(), torch.empty(0)).device
        ws = {k[len(p):]: state_dict[k].to(device) for k in ours}
        if any(k.startswith("te_func.recipe=") for k in ws) or _format_of(ws) == 2:     # an earlier te_func's
            ws = upgrade_workspaces(ws, self.model, self.recipe)
        if ws:
            try:   # a clear error naming the recipe, or the missing or misshapen entry
                validate_workspaces(self.model, ws, self.recipe)
            except (KeyError, ValueError) as e:
                raise type(e)(f"Stateful.load_state_dict: the checkpoint does not fit this shell "
                              f"(recipe={self.recipe!r}): {e.args[0]}") from None
        self._pending_load = (ws, prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Parameters and workspaces. A checkpoint of weights only (no `workspaces.` entries)
        loads with strict=False, which makes fresh workspaces from the loaded weights; so does
        the model's own state_dict (keys without the `model.` prefix)."""
        own = self.model.state_dict().keys()
        if state_dict and not any(k.startswith(("model.", _WS)) for k in state_dict):
            if not set(state_dict) & set(own):
                raise KeyError(f"Stateful.load_state_dict: none of the checkpoint's keys (e.g. "
                               f"{next(iter(state_dict))!r}) is a parameter of the model or a workspace entry")
            if strict:
                raise KeyError("Stateful.load_state_dict: this is the model's own state_dict (no 'model.' "
                               "prefix, no workspaces): load it with shell.load_state_dict(sd, strict=False), "
                               "which loads the weights and makes fresh workspaces from them")
            state_dict = {f"model.{k}": v for k, v in state_dict.items()}
        elif not any(k.startswith(_WS) for k in state_dict):
            if strict:
                raise KeyError(f"Stateful.load_state_dict: {_WEIGHTS_ONLY}")
            if not {k.removeprefix("model.") for k in state_dict} & set(own):
                raise KeyError("Stateful.load_state_dict: nothing in the checkpoint fits this shell (no parameter "
                               "of the model, no workspace entry)")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _apply(self, fn, recurse=True):
        # .to(device) / .cuda() move the workspaces with the parameters; a dtype change (.half(),
        # .to(torch.bfloat16)) leaves them alone: casts and amax histories keep their own dtypes.
        super()._apply(fn, recurse)
        moved = {}
        for k, v in self.workspaces.items():
            device = fn(torch.zeros((), device=v.device)).device
            moved[k] = v if device == v.device else v.to(device)
        self._set_workspaces(moved)
        return self

    def __getstate__(self):
        # copy.deepcopy and pickle: the sinks' hooks cannot be copied; __setstate__ makes new ones.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state.pop("_sinks", None)
        state.pop("_weight_hooks", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._make_sinks()

    def extra_repr(self) -> str:
        return f"recipe={self.recipe!r}" + ("" if self.amax_group is None else f", amax_group={self.amax_group!r}")


def _format_of(ws: dict) -> int | None:
    """The workspace format a checkpoint's recipe entry names (None without one)."""
    t = ws.get(RECIPE_KEY)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.numel() != 2:
        return None
    return int(t[0])
