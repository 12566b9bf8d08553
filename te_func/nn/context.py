"""The call context a te_func module reads when it runs: recipe and workspace entries.

`te_func.frame` pushes a `Frame` around a model call on a per-thread stack; each module finds its
own entries by its path. This is te_func's only global state, read only below the frame, and
modules never keep what they read."""
from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .. import _compat
from ..errors import HighPrecisionWarning, TransformError
from ..quant import lower

__all__ = ["Frame", "CallScope", "Binding", "push", "bind", "microbatch", "last_recipe", "push_call_scope",
           "open_call_scopes", "current_frame", "transform_level"]


class _Stacks(threading.local):
    # Made when a thread first touches them: a stack created during a trace would recompile later.
    def __init__(self):
        self.frames: list = []
        self.call_scopes: list = []


_local = _Stacks()


def _stack(name: str) -> list:
    return getattr(_local, name)


def transform_level() -> int | None:
    """The torch.func transform level code runs at now (None outside any, and while compiling)."""
    if torch.compiler.is_compiling():
        return None
    return _compat.current_level()


@dataclass
class Frame:
    recipe: object
    # Flat workspace dict keyed by module path, or None under autocast (no caching).
    workspaces: dict | None = None
    # id(module) -> (its path, its entry names, those its backward reads as given)
    owners: dict = field(default_factory=dict)
    is_first_microbatch: bool | None = None
    updates: dict = field(default_factory=dict)    # entries written during this call
    level: int | None = None                       # transform_level() when the frame was pushed
    # Whether a step start updates DelayedScaling's state (TE: while grad is enabled), decided when
    # the frame opens, so a checkpoint's no_grad forward still trains. None: each layer's grad mode.
    update_state: bool | None = None
    # A per-sample call in batch scope (te_func.vmapped): the batch amaxes give the scales.
    batch_scales: bool = False
    # Called with every layer's new entries (full keys) as it commits them (tef.Stateful's).
    watch: Callable[[dict], None] | None = None
    # False for workspaces without weight casts: casts are not committed.
    weight_cache: bool = True


@dataclass
class CallScope:
    """Opened by tef.grad and te_func.vmapped: each functional_call inside adds its model's entries."""
    spec: dict = field(default_factory=dict)          # key -> Entry of every entry the calls read
    batch_spec: dict = field(default_factory=dict)    # key -> Entry of the batch-scope entries they could read
    # backward entry -> the group its amaxes are all-reduced over (te_func.distributed)
    amax_groups: dict = field(default_factory=dict)
    # Opened around per-sample calls in batch scope (te_func.vmapped): see Frame.batch_scales.
    batch_scales: bool = False
    # tef.grad's: id(layer) -> path of each layer with backward entries a call inside bound, which a
    # second call may not differentiate again. None where a function runs several times (chunks).
    differentiated: dict | None = None

    @property
    def backward_keys(self) -> set:
        """The entries whose new value backward computes (Entry.backward)."""
        return {k for k, e in self.spec.items() if e.backward}


@contextlib.contextmanager
def _pushed(name: str, item):
    stack = _stack(name)
    stack.append(item)
    try:
        yield item
    finally:
        popped = stack.pop()
        if popped is not item:   # a frame left open by code that bypassed this context manager
            stack.clear()
            raise RuntimeError("te_func: the frame stack was corrupted (a frame was pushed without being "
                               "popped); all frames were dropped")


def push(frame: Frame):
    frame.level = transform_level()
    return _pushed("frames", frame)


def push_call_scope(scope: CallScope):
    return _pushed("call_scopes", scope)


def open_call_scopes() -> list[CallScope]:
    return list(_stack("call_scopes"))


def current_frame() -> Frame | None:
    """The innermost frame of this thread, or None outside any."""
    stack = _stack("frames")
    return stack[-1] if stack else None


NO_CACHE = ("{who}: is_first_microbatch={value!r} reads or stores cached weight casts, and these workspaces "
            "keep none (tef.init_workspaces(model, recipe, weight_cache=False)): pass is_first_microbatch=None, "
            "which casts the weights in every call, or make the workspaces with the cache for microbatches "
            "that reuse one cast")


class Binding(NamedTuple):
    """What a module runs with, and where its new entries go."""
    recipe: object
    workspace: dict | None
    is_first_microbatch: bool | None
    update_state: bool | None       # whether a step start updates DelayedScaling's state (None: grad mode)
    commit: Callable[[dict], None]
    batch_scales: bool = False      # Frame.batch_scales


def microbatch(frame: Frame, owner: tuple, is_first_microbatch: bool | None = None) -> tuple[bool | None, bool]:
    """(the is_first_microbatch a layer runs with in `frame`, whether it ran in this frame before).
    The layer's own argument wins; a layer called again in the frame runs as a later microbatch."""
    path, names, _ = owner
    prefix = f"{path}." if path else ""
    again = any(prefix + n in frame.updates for n in names)
    if again:
        return False, True
    return (is_first_microbatch if is_first_microbatch is not None else frame.is_first_microbatch), False


def bind(module, layer: str, is_first_microbatch: bool | None) -> Binding:
    """What `module` runs with, read from the innermost frame of this thread. Without a frame it
    computes in high precision (`_outside_frames`), except during a backward: an activation
    checkpoint's recompute, which replays its last call (`_replay`)."""
    stack = _stack("frames")
    if not stack:
        replay = _replay(module)
        if replay is not None:
            return replay
        # Only a layer with GEMMs loses its FP8 outside a frame (a frozen model's norms run so).
        return _outside_frames(layer) if module.gemms() else _NO_FRAME
    frame = stack[-1]
    if frame.workspaces is None:  # tef.autocast: quantize, cache nothing
        lowering = lower(frame.recipe)
        if lowering.keeps_history and module.gemms():
            raise TransformError(
                f"{layer}: DelayedScaling keeps amax histories and scales between steps, which "
                f"tef.autocast has nowhere to keep. Run the model through tef.functional_call(model, params, "
                f"ws, ...) or tef.Stateful(model, recipe), with ws = tef.init_workspaces(model, recipe)")
        if lowering.keeps_rng and module.gemms():
            raise TransformError(
                f"{layer}: NVFP4BlockScaling rounds gradients stochastically, drawing from a random stream "
                f"per GEMM that tef.autocast has nowhere to keep. Run the model through "
                f"tef.functional_call(model, params, ws, ...) or tef.Stateful(model, recipe), with ws = "
                f"tef.init_workspaces(model, recipe), or use NVFP4BlockScaling(disable_stochastic_rounding=True) "
                f"under tef.autocast")
        return Binding(frame.recipe, None, None, None, _discard)
    owner = frame.owners.get(id(module))
    if owner is None:
        raise RuntimeError(f"{layer}: this module is not a submodule of the model passed to "
                           f"tef.functional_call, so it has no workspace entries; register it as a "
                           f"submodule of that model")
    path, names, as_given = owner
    prefix = f"{path}." if path else ""
    local = {n: frame.updates.get(prefix + n, frame.workspaces[prefix + n]) for n in names}
    if is_first_microbatch is not None and not frame.weight_cache and module.gemms():
        raise ValueError(NO_CACHE.format(who=f"{layer} at {path or '(root)'!r}", value=is_first_microbatch))
    ifm, again = microbatch(frame, owner, is_first_microbatch)
    if again:
        if lower(frame.recipe).keeps_history:
            # Autograd would sum the two uses' backward amaxes, not take their max.
            raise TransformError(
                f"{layer} at {path or '(root)'!r} was called twice in one call under DelayedScaling, "
                f"which te_func does not support: the two uses' gradient amaxes cannot be combined. "
                f"Use two layers, or a stateless recipe (Float8CurrentScaling, MXFP8BlockScaling, "
                f"Float8BlockScaling) for a model that reuses a layer", layer=path)

    def commit(new_workspace: dict):
        _check_level(frame, layer, path, new_workspace)
        if not frame.weight_cache:      # the call's casts die with it (nothing else holds them)
            new_workspace = {k: v for k, v in new_workspace.items() if k in names}
        frame.updates.update({prefix + k: v for k, v in new_workspace.items()})
        if frame.watch is not None:
            frame.watch({prefix + k: v for k, v in new_workspace.items()})
        _remember(module, frame, {**new_workspace, **{n: local[n] for n in as_given}}, prefix)

    return Binding(frame.recipe, local, ifm, frame.update_state, commit, frame.batch_scales)


# --- activation checkpointing -----------------------------------------------------------------
# torch.utils.checkpoint recomputes a forward during backward, outside any frame. Each eager call
# in a frame leaves its new entries, with the grad histories and random streams as it was given
# them; the recompute runs as a later microbatch of that step (nothing rolled or updated) and
# commits nothing but to the frame's watcher, so each backward amax is recorded once, as TE's
# te.checkpoint keeps the forward's FP8 state.

class _Replay(NamedTuple):
    recipe: object
    workspace: dict
    watch: Callable | None
    prefix: str


_last_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_last_calls_lock = threading.Lock()


def _remember(module, frame: Frame, entries: dict, prefix: str):
    # Only plain eager calls: compiled recomputes are traced, a transform's entries are its own.
    if torch.compiler.is_compiling() or frame.level is not None:
        return
    with _last_calls_lock:
        _last_calls[module] = _Replay(frame.recipe, entries, frame.watch, prefix)


def last_recipe(module):
    """The recipe of `module`'s last plain eager call in a frame, or None (for opacus's gradients)."""
    with _last_calls_lock:
        last = _last_calls.get(module)
    return None if last is None else last.recipe


def _replay(module) -> Binding | None:
    # Traced, nothing was remembered, and torch 2.11's dynamo cannot trace the task id.
    if torch.compiler.is_compiling() or _compat.backward_task_id() == -1:    # or not in a backward
        return None
    with _last_calls_lock:
        last = _last_calls.get(module)
    if last is None:
        return None

    def commit(new_workspace: dict):
        if last.watch is not None:
            last.watch({last.prefix + k: v for k, v in new_workspace.items()})

    return Binding(last.recipe, last.workspace, False, False, commit)


def _check_level(frame: Frame, layer: str, path: str, entries: dict):
    # A transform opened inside the forward wraps what the layer computed: stored, it would escape.
    if frame.level is None and torch.compiler.is_compiling():
        return
    here = transform_level()
    if here == frame.level:
        return
    outer = -1 if frame.level is None else frame.level
    for name, t in entries.items():
        if isinstance(t, torch.Tensor) and _compat.tensor_level(t) > outer:
            raise TransformError(
                f"{layer} at {path or '(root)'!r} ran inside a torch.func transform (vmap, grad, ...) "
                f"opened inside the model's forward, so its new workspace entry {name!r} belongs to that "
                f"transform and cannot leave it. Apply the transform around tef.functional_call (e.g. "
                f"torch.func.vmap(lambda x: tef.functional_call(model, params, ws, (x,), recipe=...))) "
                f"instead of inside the model", layer=path, entry=name)


def _discard(new_workspace):
    pass


_NO_FRAME = Binding(None, None, None, None, _discard)
_told_outside_frames = False


def _outside_frames(layer: str) -> Binding:
    """A call outside every frame: high precision, as the torch layer; the first such call warns."""
    global _told_outside_frames
    if torch.compiler.is_compiling() or _told_outside_frames:
        return _NO_FRAME
    _told_outside_frames = True
    if _compat.current_level() is None:
        fix = "To train in FP8 wrap the model, shell = tef.Stateful(model, recipe), and train the shell."
    else:   # a torch.func transform of the layer itself: torch.func.functional_call, opacus's per-sample grads
        fix = ("It ran inside a torch.func transform (vmap, grad) applied to the layer or model itself: call the "
               "model through tef.functional_call there (docs/functional.md); for opacus's per-sample gradients, "
               "call tef.integrations.register_opacus() before wrapping the model.")
    warnings.warn(f"{layer} ran outside tef.functional_call, tef.Stateful and tef.autocast, so no recipe ran: te_func "
                  f"layers called on their own compute in high precision, as the torch layers they replace. {fix} "
                  f"(Shown once per process; te_func.errors.HighPrecisionWarning.)", HighPrecisionWarning,
                  stacklevel=_caller_outside_torch())
    return _NO_FRAME


def _caller_outside_torch() -> int:
    # The warning's stacklevel: the first caller that is neither te_func's nor torch's.
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("te_func", "torch"):
        frame, level = frame.f_back, level + 1
    return level
