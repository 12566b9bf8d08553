"""`Stateful`: the one place te_func mutates anything. It threads a model's workspaces through
`functional_call` step after step, so the model trains like any PyTorch module."""
from __future__ import annotations

import functools
import inspect
import os
import weakref
from typing import cast

import torch
from torch import nn

from . import _compat, backward_state, distributed
from .errors import FrozenModelError, MissingEntryError, TransformError, UnknownEntryError
from .frame import (backward_keys, backward_weights, call_watched, init_workspaces, keeps_weight_casts,
                    mark_static, outside_inference_mode, upgrade_workspaces, workspace_spec)
from .nn import TEModule
from .nn.frozen import FrozenLayer
from .ops import on_backward
from .quant.workspace import RECIPE_KEY
from .recipe import Recipe, describe

__all__ = ["Stateful"]

_WS = "workspaces."


WORKSPACES_FILE = "te_func_workspaces.safetensors"


def _call_saying_what_changed(model, *args, **kwargs):
    """functional_call for an eager shell call, saying that a misfit means the layers changed."""
    try:
        return call_watched(model, *args, **kwargs)
    except (MissingEntryError, UnknownEntryError) as e:
        raise type(e)(f"tef.Stateful: the shell's workspaces no longer fit its model, whose te_func layers changed "
                      f"since they were made (a layer replaced, added or removed: peft's merge_and_unload, an "
                      f"adapter added, a module swapped): make fresh ones from the current weights with "
                      f"shell.reset_workspaces(), or wrap the model in a new tef.Stateful. The first misfit: {e}",
                      **vars(e)) from None


_WEIGHTS_ONLY = ("the checkpoint has no workspace entries (workspaces.*): it holds weights only. Load it with "
                 "strict=False, which loads the weights and makes fresh workspaces from them")


def _after_load(shell: Stateful, incompatible_keys):
    # A load_state_dict post-hook: a weights-only checkpoint gets workspaces from the loaded weights.
    pending, shell._pending_load = shell._pending_load, None
    if pending is None:
        return
    ws, prefix = pending
    if ws:
        device = next(shell.model.parameters(), torch.empty(0)).device
        shell._set_workspaces({k: v.to(device) for k, v in ws.items()})
    else:
        shell.reset_workspaces()
        incompatible_keys.missing_keys.extend(prefix + _WS + k for k in shell.workspaces)


def _merge_before_saving(shell: Stateful, prefix, keep_vars):
    shell.workspaces        # noqa: B018  # the read merges what a compiled backward left pending


def _take_tensordict_entries(shell: Stateful, state_dict, prefix, *_):
    # tensordict's to_module(use_state_dict=True) hands its flattened state to the load pre-hooks,
    # then sets what it holds by module path, splitting keys at their dots: a workspace key has
    # dots of its own and names no module. The shell takes its entries here, as load_state_dict.
    if not hasattr(state_dict, "unflatten_keys"):       # a plain state_dict: _load_from_state_dict
        return
    p = prefix + _WS
    ours = [k for k in state_dict.keys() if isinstance(k, str) and k.startswith(p)]
    if not ours:
        return
    device = next(shell.model.parameters(), torch.empty(0)).device
    shell.workspaces = {k[len(p):]: state_dict[k].to(device) for k in ours}
    for k in ours:
        del state_dict[k]


class _WorkspaceBuffers(nn.Module):
    """The shell's workspaces as buffers, where tools look (named_buffers, tensordict): its buffer
    dict is the shell's workspace dict. It saves them (under `workspaces.`, where tensordict's
    from_module(use_state_dict=True) reads them too); the shell loads and moves them."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The shell's state_dict pre-hook has merged any pending amaxes into them.
        for k, v in self._buffers.items():
            destination[prefix + k] = v if keep_vars else v.detach()

    def _load_from_state_dict(self, *args, **kwargs):
        pass

    def _apply(self, fn, recurse=True):
        return self


class Stateful(nn.Module):
    """`shell = Stateful(model, recipe)`; `out = shell(x, is_first_microbatch=...)`.

    `shell.parameters()` are the model's; `shell.workspaces` is the current workspace dict (each
    call replaces it), also the buffers of the submodule `workspaces`. The state_dict holds both
    (entries under `workspaces.`) and `.to(device)` moves both. Under DelayedScaling, backward
    records the grad-output amaxes into the current step's slot whatever the backward is asked for,
    eager or compiled (docs/stateful.md).

    amax_group: the ranks DelayedScaling(reduce_amax=True) all-reduces over (None: the default group).
    weight_cache=False keeps no weight casts between calls (is_first_microbatch=None only)."""

    def __init__(self, model: nn.Module, recipe: Recipe | None, *, amax_group=None, weight_cache: bool = True):
        super().__init__()
        if any(isinstance(m, FrozenLayer) for m in model.modules()):
            raise FrozenModelError(f"tef.Stateful: {type(model).__name__} is frozen (tef.freeze): it holds FP8 "
                                   f"weight casts for inference and nothing to train or keep state for; call it "
                                   f"directly (frozen(x)), or wrap the trained model it was frozen from")
        if recipe is not None and not any(isinstance(m, TEModule) for m in model.modules()):
            raise ValueError(f"tef.Stateful: {type(model).__name__} has no te_func layers, so recipe="
                             f"{type(recipe).__name__} would change nothing; convert it first: "
                             f"tef.Stateful(tef.convert(model), recipe)")
        self.model = model
        self.recipe = recipe
        self.amax_group = amax_group
        self.weight_cache = weight_cache
        self._amax_reduction = distributed.amax_reduction_group(recipe, amax_group)
        self._pending_load = None
        self._modules["workspaces"] = _WorkspaceBuffers()
        self._set_workspaces(init_workspaces(model, recipe, weight_cache=weight_cache))
        self.register_load_state_dict_post_hook(_after_load)
        self._install_state_dict_hooks()
        self._show_model_signature()

    def _install_state_dict_hooks(self):
        # Also on a shell unpickled from a te_func whose shell had neither hook.
        pre_load = self._load_state_dict_pre_hooks.values()
        if not any(getattr(h, "hook", None) is _take_tensordict_entries for h in pre_load):
            self._register_load_state_dict_pre_hook(_take_tensordict_entries, with_module=True)
        if _merge_before_saving not in self._state_dict_pre_hooks.values():
            self.register_state_dict_pre_hook(_merge_before_saving)

    # --- workspaces, sinks and inboxes --------------------------------------------------------

    @property
    def workspaces(self) -> dict:
        """The current workspace dict: keyed by module path, as tef.init_workspaces makes it."""
        # A compiled backward that computed no watched weight's gradient (autograd.grad(loss, [x]);
        # any under FSDP) tells nobody of its amaxes: merged here. Not under amax reduction, where
        # a merge is a collective a read on one rank would hang: the next call merges them.
        if self._amax_reduction is None and not torch.compiler.is_compiling():
            self._merge_pending()
        return self._workspaces

    @workspaces.setter
    def workspaces(self, ws: dict):
        self._check_fits(ws, "Stateful.workspaces")
        self._set_workspaces(ws)

    def _check_fits(self, ws: dict, who: str):
        # Checked before anything is replaced: a misfit leaves the shell as it was.
        try:
            holds_casts = keeps_weight_casts(self.model, ws, self.recipe)
        except (KeyError, ValueError, TypeError) as e:
            raise type(e)(f"{who}: the workspaces do not fit this shell's model "
                          f"({type(self.model).__name__}, recipe={type(self.recipe).__name__}), which is left as "
                          f"it was: {e.args[0]}. Make them with tef.init_workspaces(shell.model, shell.recipe), or "
                          f"take them from this shell") from None
        if self.weight_cache and not holds_casts:
            raise ValueError(f"{who}: the workspaces keep no weight casts (weight_cache=False) and this shell keeps "
                             f"them; the shell is left as it was")

    # The current dict is the `workspaces` submodule's buffer dict, which each call replaces.
    @property
    def _workspaces(self) -> dict:
        return cast(nn.Module, self._modules["workspaces"])._buffers

    @_workspaces.setter
    def _workspaces(self, ws: dict):
        cast(nn.Module, self._modules["workspaces"])._buffers = ws

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        # DDP broadcasts buffers from rank 0, in place, before each forward: not the workspaces,
        # which the shell replaces and keeps in step across ranks itself (amax_group).
        return [f"workspaces.{k}" for k in self._workspaces]

    def __setattr__(self, name, value):
        if name == "workspaces":     # the property's setter: nn.Module would take it for the submodule
            return object.__setattr__(self, name, value)
        super().__setattr__(name, value)

    def _set_workspaces(self, ws: dict):
        ws = outside_inference_mode(ws)
        mark_static(ws.values())
        self._workspaces = ws
        self._make_sinks_and_inboxes()

    def _make_sinks_and_inboxes(self):
        # An op computes its backward amax only where its grad history requires grad. Compiled
        # calls read each history as `entry + sink` through DeliverToInboxes, the sink a zero leaf
        # made here, outside the graph. Plain dicts: no optimizer or state_dict sees them.
        self._backward_keys = backward_keys(self.model, self.recipe)
        with torch.inference_mode(False):       # a shell made under inference_mode: normal tensors
            self._sinks = {k: torch.zeros_like(self._workspaces[k]).requires_grad_() for k in self._backward_keys}
            self._inboxes = {k: torch.zeros_like(self._workspaces[k]) for k in self._backward_keys}
        mark_static(self._inboxes.values())
        # Whether a compiled call ran since: its backward may fill the inboxes at any time.
        self._compiled = False
        self._merge_queued_for = None       # the backward (graph task id) whose end merges the inboxes
        self._watch_weights(weakref.ref(self))

    # --- what backward_state's hooks deliver to (its AmaxInboxes protocol) ---------------------

    def _amax_inbox(self, key: str) -> torch.Tensor | None:
        return self._inboxes.get(key)

    def _claim_backward_end(self, task) -> bool:
        if self._merge_queued_for == task:
            return False
        self._merge_queued_for = task
        return True

    def _absorb_inboxes(self) -> None:
        self._merge_queued_for = None
        self._workspaces = self._merged(self._workspaces)

    def _merge_pending(self):
        """Merge the inboxes into the workspaces (a collective under amax reduction)."""
        if self._compiled:
            self._workspaces = self._merged(self._workspaces)

    def _merged(self, ws: dict) -> dict:
        """`ws` with each inbox merged into its history by max, the inboxes left empty."""
        keys = self._backward_keys
        merged = dict(zip(keys, backward_state.merge_inboxes([ws[k] for k in keys], [self._inboxes[k] for k in keys])))
        # Slot 0 all-reduced by max over the ranks, as TE reduces after a backward.
        return {**ws, **distributed.reduce_amax_slots(merged, self._amax_reduction)}

    def _watch_weights(self, me):
        # Each trained GEMM weight tells the shell when a backward computes its gradient, so that
        # a compiled call's amaxes join the histories as it ends (copies register their own).
        hooks = getattr(self, "_weight_hooks", None)
        if hooks is None:
            hooks = self._weight_hooks = []
            # A dropped shell takes its hooks off the weights: the model may outlive it.
            weakref.finalize(self, backward_state.remove_hooks, hooks)
        backward_state.remove_hooks(hooks)
        for w in backward_weights(self.model, self.recipe).values():
            if isinstance(w, torch.Tensor) and w.requires_grad and w.is_leaf:
                hooks.append(w.register_hook(functools.partial(backward_state.merge_when_backward_ends, me)))

    def _watcher(self):
        me, keys = weakref.ref(self), set(self._backward_keys)

        def watch(entries: dict):
            for key in keys.intersection(entries):
                on_backward(entries[key], functools.partial(backward_state.deliver, me, key))
        return watch

    def reset_workspaces(self):
        """Fresh workspaces from the current weights (e.g. after loading new weights)."""
        self._set_workspaces(init_workspaces(self.model, self.recipe, weight_cache=self.weight_cache))

    # --- the call -----------------------------------------------------------------------------

    def forward(self, *args, is_first_microbatch: bool | None = None, **kwargs):
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            first = next(self.model.parameters(), None)
            if first is not None and first.is_inference():
                raise TransformError("tef.Stateful: the model's parameters were made under torch.inference_mode() "
                                     "(inference tensors), which autograd cannot train: build the model outside "
                                     "inference_mode to train it, or call the shell under inference_mode only")
        ws, watch = self._workspaces, None
        compiling = torch.compiler.is_compiling()
        if self._backward_keys and torch.is_grad_enabled() and not compiling and _compat.current_level() is not None:
            raise TransformError(
                f"tef.Stateful under {type(self.recipe).__name__} records backward amaxes through autograd hooks, "
                f"which torch.func transforms ({', '.join(_compat.transform_levels())}) do not run: call the model "
                f"with tef.functional_call there and thread its workspaces (docs/functional.md), or evaluate "
                f"under torch.no_grad()")
        if self._backward_keys and (compiling or self._compiled):
            # Earlier backwards' amaxes join their step before this call rolls the histories
            # (compiled: always, as a flag read here would be one more guard).
            ws = self._merged(ws)
        if torch.is_grad_enabled() and self._backward_keys:
            if compiling:
                # The op's amax leaves the graph through the inbox, whatever the backward's inputs.
                keys = self._backward_keys
                read = backward_state.DeliverToInboxes.apply(*(ws[k] + self._sinks[k] for k in keys),
                                                             *(self._inboxes[k] for k in keys))
                ws = {**ws, **dict(zip(keys, read))}
                self._compiled = True
            else:
                # A leaf per call and a hook on each op's node: backwards come in any order, and
                # the op reports its amax even where autograd drops the leaf's gradient.
                ws = {**ws, **{k: ws[k].detach().requires_grad_() for k in self._backward_keys}}
                watch = self._watcher()
        run = call_watched if compiling else _call_saying_what_changed
        out, new_ws = run(self.model, None, ws, args, kwargs, recipe=self.recipe,
                          is_first_microbatch=is_first_microbatch, amax_group=self.amax_group, watch=watch)
        new_ws = {**new_ws, **{k: new_ws[k].detach() for k in self._backward_keys}}
        # dynamo cannot trace the inference_mode check: compiled calls skip it
        inference = not compiling and torch.is_inference_mode_enabled()
        self._workspaces = outside_inference_mode(new_ws) if inference else new_ws
        return out

    # --- modules around it: state_dict, copies, devices ---------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        p = prefix + _WS
        ours = [k for k in state_dict if k.startswith(p)]
        unexpected_keys[:] = [k for k in unexpected_keys if not k.startswith(p)]
        device = next(self.model.parameters(), torch.empty(0)).device
        # A model on meta gets its weights after this (assign=True): the entries wait (_after_load).
        ws = {k[len(p):]: state_dict[k] if device.type == "meta" else state_dict[k].to(device) for k in ours}
        if any(k.startswith("te_func.recipe=") for k in ws) or _format_of(ws) == 2:     # an earlier te_func's
            ws = upgrade_workspaces(ws, self.model, self.recipe)
        if ws:
            try:   # a clear error naming the recipe, or the missing or misshapen entry
                holds_casts = keeps_weight_casts(self.model, ws, self.recipe)
            except (KeyError, ValueError) as e:
                raise type(e)(f"Stateful.load_state_dict: the checkpoint does not fit this shell "
                              f"(recipe={describe(self.recipe)}): {e.args[0]}") from None
            if self.weight_cache and not holds_casts:
                raise ValueError("Stateful.load_state_dict: the checkpoint's workspaces keep no weight casts (saved "
                                 "by a shell made with weight_cache=False) and this shell keeps them: load it into "
                                 "tef.Stateful(model, recipe, weight_cache=False)")
            if not self.weight_cache:    # casts are made from the weights: nothing is lost
                spec = workspace_spec(self.model, self.recipe)
                ws = {k: v for k, v in ws.items() if spec[k].kind != "cast"}
        self._pending_load = (ws, prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Parameters and workspaces; weights alone load with strict=False (fresh workspaces)."""
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
        # A device move takes the workspaces along; a dtype change (.half()) leaves them alone.
        super()._apply(fn, recurse)
        moved = {}
        for k, v in self.workspaces.items():
            device = fn(torch.zeros((), device=v.device)).device
            moved[k] = v if device == v.device else v.to(device)
        self._set_workspaces(moved)
        return self

    def __getstate__(self):
        # deepcopy and pickle: the workspaces as a read gives them; __setstate__ makes the copy's
        # own sinks, inboxes, weight hooks and signed forward.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_workspaces"] = self.workspaces
        for name in ("_sinks", "_inboxes", "_weight_hooks", "forward"):
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        if "workspaces" in state:        # pickled by a te_func whose shell kept them under that name
            state["_workspaces"] = state.pop("workspaces")
        state.setdefault("weight_cache", True)      # pickled before the option existed: the cache
        ws = state.pop("_workspaces")
        super().__setstate__(state)
        self._modules.setdefault("workspaces", _WorkspaceBuffers())
        self._workspaces = ws
        self._make_sinks_and_inboxes()
        self._install_state_dict_hooks()
        self._show_model_signature()

    # --- what libraries read of the model it wraps --------------------------------------------

    def _show_model_signature(self):
        """`shell.forward` with the wrapped model's signature (and is_first_microbatch): HF Trainer
        keeps only the batch keys a forward names, which `*args, **kwargs` would hide."""
        try:
            params = list(inspect.signature(self.model.forward).parameters.values())
        except (TypeError, ValueError):         # a forward without a signature: the shell's own
            return
        if not any(p.name == "is_first_microbatch" for p in params):
            flag = inspect.Parameter("is_first_microbatch", inspect.Parameter.KEYWORD_ONLY, default=None)
            at = next((i for i, p in enumerate(params) if p.kind == inspect.Parameter.VAR_KEYWORD), len(params))
            params.insert(at, flag)
        shell = self

        def forward(*args, **kwargs):
            return Stateful.forward(shell, *args, **kwargs)
        forward.__signature__ = inspect.Signature(params)      # type: ignore[attr-defined]
        forward.__doc__ = self.model.forward.__doc__
        self.__dict__["forward"] = forward

    def __getattr__(self, name: str):
        # The wrapped model's public attributes, for libraries that read them (HF Trainer: config).
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if name.startswith("_") or model is None:
                raise
            return getattr(model, name)

    def save_pretrained(self, save_directory, **kwargs):
        """The wrapped model's own folder (`model.save_pretrained`, which `from_pretrained` loads)
        and the workspaces beside it; `load_pretrained` takes both back."""
        if not hasattr(self.model, "save_pretrained"):
            raise TypeError(f"Stateful.save_pretrained: {type(self.model).__name__} has no save_pretrained (not a "
                            f"HuggingFace model); save the shell's state_dict instead")
        self.model.save_pretrained(save_directory, **kwargs)
        self.save_workspaces(save_directory)

    def save_workspaces(self, directory):
        """The workspaces, as WORKSPACES_FILE (safetensors) in `directory`."""
        import safetensors.torch
        ws = {k: v.detach().contiguous() for k, v in self.workspaces.items()}
        safetensors.torch.save_file(ws, os.path.join(directory, WORKSPACES_FILE), metadata={"format": "pt"})

    def load_workspaces(self, directory):
        """The workspaces `save_workspaces` wrote into `directory`, checked as the setter checks."""
        ws = self._read_workspaces(directory, "Stateful.load_workspaces")
        self._check_fits(ws, "Stateful.load_workspaces")
        self._set_workspaces(ws)

    def _read_workspaces(self, directory, who: str) -> dict:
        import safetensors.torch
        path = os.path.join(directory, WORKSPACES_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{who}: {directory} holds no {WORKSPACES_FILE}: it was not written by "
                                    f"shell.save_pretrained (or save_workspaces). For a model's own folder, load "
                                    f"it with from_pretrained and make fresh workspaces (shell.reset_workspaces())")
        device = next(self.model.parameters(), torch.empty(0)).device
        return safetensors.torch.load_file(path, device=str(device))

    def load_pretrained(self, directory):
        """The weights and workspaces `save_pretrained` wrote, in place; a misfit leaves the shell as
        it was. The model class's `from_pretrained` reads the weights (shards, tied weights)."""
        if not hasattr(self.model, "save_pretrained"):
            raise TypeError(f"Stateful.load_pretrained: {type(self.model).__name__} has no save_pretrained (not a "
                            f"HuggingFace model); load the shell's state_dict instead")
        ws = self._read_workspaces(directory, "Stateful.load_pretrained")
        self._check_fits(ws, "Stateful.load_pretrained")
        # Built with this model's config: a folder of another model cannot make a model of its size.
        loaded, info = type(self.model).from_pretrained(directory, config=self.model.config,
                                                        output_loading_info=True)
        misfit = [k for key in ("missing_keys", "unexpected_keys", "mismatched_keys") for k in info.get(key, ())]
        if misfit:
            raise KeyError(f"Stateful.load_pretrained: {directory} does not hold this shell's model "
                           f"({type(self.model).__name__}): {sorted(map(str, misfit))[:3]} do not fit")
        self.model.load_state_dict(loaded.state_dict())
        self._set_workspaces(ws)

    def extra_repr(self) -> str:
        return (f"recipe={self.recipe!r}" + ("" if self.amax_group is None else f", amax_group={self.amax_group!r}")
                + ("" if self.weight_cache else ", weight_cache=False"))


def _format_of(ws: dict) -> int | None:
    """The workspace format a checkpoint's recipe entry names (None without one)."""
    t = ws.get(RECIPE_KEY)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.numel() != 2:
        return None
    return int(t[0])
