"""The call context a te_func module reads when it runs: recipe and workspace entries.

`te_func.frame` pushes a `Frame` around a model call; each te_func module
finds its own entries by its path in the model. This is the only global
state in te_func, and it is only read below the frame: modules never keep
what they read, so a model stays a plain parameter holder.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from ..recipe import DelayedScaling

__all__ = ["Frame", "push", "bind"]

_STACK: list["Frame"] = []


@dataclass
class Frame:
    recipe: object
    # Flat workspace dict keyed by module path, or None under autocast (no caching).
    workspaces: dict | None = None
    # id(module) -> (its path in the model, the names of its own entries)
    owners: dict = field(default_factory=dict)
    is_first_microbatch: bool | None = None
    updates: dict = field(default_factory=dict)    # entries written during this call


@contextlib.contextmanager
def push(frame: Frame):
    _STACK.append(frame)
    try:
        yield frame
    finally:
        _STACK.pop()


def bind(module, layer: str, is_first_microbatch: bool | None):
    """What `module` runs with: (recipe, workspace, is_first_microbatch, commit).

    `commit(new_workspace)` hands the module's updated entries back to the frame.
    """
    if not _STACK:
        return None, None, None, _discard
    frame = _STACK[-1]
    if frame.workspaces is None:  # tef.autocast: quantize, cache nothing
        if isinstance(frame.recipe, DelayedScaling):
            raise RuntimeError(
                f"{layer}: DelayedScaling keeps amax histories and scales between steps, which "
                f"tef.autocast has nowhere to keep. Run the model through tef.functional_call(model, params, "
                f"ws, ...) or tef.Stateful(model, recipe), with ws = tef.init_workspaces(model, recipe)")
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
        frame.updates.update({prefix + k: v for k, v in new_workspace.items()})

    return frame.recipe, local, ifm, commit


def _discard(new_workspace):
    pass
