"""The call context a te_func module reads when it runs: recipe and workspace entries.

`te_func.frame` pushes a `Frame` around a model call; each te_func module
finds its own entries by its path in the model. Frames live on a per-thread
stack (two threads may run one model at once, each in its own frame); this
is the only global state in te_func, it is only read below the frame, and
modules never keep what they read, so a model stays a plain parameter holder.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch._C import _functorch

from ..quant.workspace import keeps_rng
from ..recipe import DelayedScaling

__all__ = ["Frame", "GradScope", "push", "bind", "current_grad_scope", "transform_level"]

class _Stacks(threading.local):
    # Both stacks exist from a thread's first look: made lazily, the first compiled call would
    # guard on the attribute's absence and recompile once it exists, depending on what ran before.
    def __init__(self):
        self.frames: list = []
        self.grad_scopes: list = []


_local = _Stacks()


def _stack(name: str) -> list:
    return getattr(_local, name)


def transform_level() -> int | None:
    """The torch.func transform level code runs at now (None outside any), or None
    while torch.compile traces (dynamo tracks the transforms itself there)."""
    if torch.compiler.is_compiling():
        return None
    return _functorch.maybe_current_level()


@dataclass
class Frame:
    recipe: object
    # Flat workspace dict keyed by module path, or None under autocast (no caching).
    workspaces: dict | None = None
    # id(module) -> (its path in the model, the names of its own entries)
    owners: dict = field(default_factory=dict)
    is_first_microbatch: bool | None = None
    updates: dict = field(default_factory=dict)    # entries written during this call
    level: int | None = None                       # transform_level() when the frame was pushed


@dataclass
class GradScope:
    """Opened by tef.grad around its function: each functional_call inside adds the
    workspace entries its model updates in backward."""
    backward_keys: set = field(default_factory=set)


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


def push_grad_scope(scope: GradScope):
    return _pushed("grad_scopes", scope)


def current_grad_scope() -> GradScope | None:
    stack = _stack("grad_scopes")
    return stack[-1] if stack else None


def bind(module, layer: str, is_first_microbatch: bool | None):
    """What `module` runs with: (recipe, workspace, is_first_microbatch, commit).

    `commit(new_workspace)` hands the module's updated entries back to the frame.
    """
    stack = _stack("frames")
    if not stack:
        return None, None, None, _discard
    frame = stack[-1]
    if frame.workspaces is None:  # tef.autocast: quantize, cache nothing
        if isinstance(frame.recipe, DelayedScaling) and module.gemms():
            raise RuntimeError(
                f"{layer}: DelayedScaling keeps amax histories and scales between steps, which "
                f"tef.autocast has nowhere to keep. Run the model through tef.functional_call(model, params, "
                f"ws, ...) or tef.Stateful(model, recipe), with ws = tef.init_workspaces(model, recipe)")
        if keeps_rng(frame.recipe) and module.gemms():
            raise RuntimeError(
                f"{layer}: NVFP4BlockScaling rounds gradients stochastically, drawing from a random stream "
                f"per GEMM that tef.autocast has nowhere to keep. Run the model through "
                f"tef.functional_call(model, params, ws, ...) or tef.Stateful(model, recipe), with ws = "
                f"tef.init_workspaces(model, recipe), or use NVFP4BlockScaling(disable_stochastic_rounding=True) "
                f"under tef.autocast")
        return frame.recipe, None, None, _discard
    owner = frame.owners.get(id(module))
    if owner is None:
        raise RuntimeError(f"{layer}: this module is not a submodule of the model passed to "
                           f"tef.functional_call, so it has no workspace entries; register it as a "
                           f"submodule of that model")
    path, names = owner
    prefix = f"{path}." if path else ""
    # A module called again in the same frame (a shared layer) sees what its
    # first call wrote and runs as a later microbatch of the same step: its
    # weight cast is reused.
    again = any(prefix + n in frame.updates for n in names)
    local = {n: frame.updates.get(prefix + n, frame.workspaces[prefix + n]) for n in names}
    ifm = is_first_microbatch if is_first_microbatch is not None else frame.is_first_microbatch
    if again:
        if isinstance(frame.recipe, DelayedScaling):
            # Each use's backward would report its grad amax as the "gradient" of the
            # same entry, and autograd sums two gradients of one input: the amaxes
            # would add instead of taking the max.
            raise RuntimeError(
                f"{layer} at {path or '(root)'!r} was called twice in one call under DelayedScaling, "
                f"which te_func does not support: the two uses' gradient amaxes cannot be combined. "
                f"Use two layers, or a stateless recipe (Float8CurrentScaling, MXFP8BlockScaling, "
                f"Float8BlockScaling) for a model that reuses a layer")
        ifm = False

    def commit(new_workspace: dict):
        _check_level(frame, layer, path, new_workspace)
        frame.updates.update({prefix + k: v for k, v in new_workspace.items()})

    return frame.recipe, local, ifm, commit


def _check_level(frame: Frame, layer: str, path: str, entries: dict):
    # A torch.func transform opened inside the model's forward (vmap over part of
    # it, a grad inside it) wraps what the layer computed; stored in the workspaces
    # those wrappers would escape their transform.
    if frame.level is None and torch.compiler.is_compiling():
        return
    here = transform_level()
    if here == frame.level:
        return
    outer = -1 if frame.level is None else frame.level
    for name, t in entries.items():
        if isinstance(t, torch.Tensor) and _functorch.maybe_get_level(t) > outer:
            raise RuntimeError(
                f"{layer} at {path or '(root)'!r} ran inside a torch.func transform (vmap, grad, ...) "
                f"opened inside the model's forward, so its new workspace entry {name!r} belongs to that "
                f"transform and cannot leave it. Apply the transform around tef.functional_call (e.g. "
                f"torch.func.vmap(lambda x: tef.functional_call(model, params, ws, (x,), recipe=...))) "
                f"instead of inside the model")


def _discard(new_workspace):
    pass
