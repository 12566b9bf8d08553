"""The functional frame: workspaces in, workspaces out, routed by module path.

`functional_call` runs a model with given parameters and workspaces and
returns the updated workspaces instead of mutating anything, which is what
lets torch.func.grad, vmap and torch.compile see a pure function.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .nn import TEModule
from .nn.context import Frame, push
from .quant import GRAD_HISTORY
from .recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

__all__ = ["init_workspaces", "functional_call", "autocast", "grad", "value_and_grad", "recipe_key",
           "validate_workspaces", "backward_state_keys", "merge_backward_state"]

_RECIPES = (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling)
_RECIPE_PREFIX = "te_func.recipe="


def recipe_key(recipe) -> str:
    """The workspace entry whose name records the recipe the workspace was made for."""
    return _RECIPE_PREFIX + ("None" if recipe is None else recipe._name)


def _check_recipe(recipe):
    if recipe is not None and not isinstance(recipe, _RECIPES):
        raise TypeError(f"recipe must be None or a te_func.recipe recipe ({', '.join(r.__name__ for r in _RECIPES)}), "
                        f"got {recipe!r}")


def _te_modules(model: nn.Module):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return [(path, m) for path, m in model.named_modules() if isinstance(m, TEModule)]


def _prefix(path: str) -> str:
    return f"{path}." if path else ""


def init_workspaces(model: nn.Module, recipe) -> dict[str, torch.Tensor]:
    """Fresh workspaces for every te_func layer of `model` under `recipe`: a flat dict
    keyed by module path, like a state_dict. Weight casts are made from the model's
    current weights, so they are valid until the weights change."""
    _check_recipe(recipe)
    ws = {}
    for path, m in _te_modules(model):
        ws.update({_prefix(path) + k: v for k, v in m.init_workspace(recipe).items()})
    ws[recipe_key(recipe)] = torch.empty(0)
    return ws


def validate_workspaces(model, ws, recipe):
    """Check that `ws` holds every entry `model` needs under `recipe`, with the right
    shape and dtype, and no other; raise an error naming the first entry that does not.

    Returns {id(module): (its path, its entry names)} for the frame.
    """
    if not isinstance(ws, dict):
        raise TypeError(f"workspaces must be the dict from tef.init_workspaces(model, recipe), got {type(ws).__name__}")
    key = recipe_key(recipe)
    owners, expected, problems = {}, {key}, []
    for path, m in _te_modules(model):
        spec = m.workspace_spec(recipe)
        owners[id(m)] = (path, tuple(spec))
        # A model on "meta" (the usual base of a vmapped ensemble) says nothing about devices.
        device = next((p.device for p in m.parameters() if p.device.type != "meta"), None)
        for name, (shape, dtype) in spec.items():
            entry = _prefix(path) + name
            expected.add(entry)
            t = ws.get(entry)
            if t is None:
                problems.append((KeyError, f"workspace entry {entry!r} is missing: these workspaces were not "
                                           f"made for this model (tef.init_workspaces(model, recipe) makes the "
                                           f"right ones)"))
            elif tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                problems.append((ValueError, f"workspace entry {entry!r} has shape {tuple(t.shape)} and dtype "
                                             f"{t.dtype}, but {type(m).__name__} at {path or '(root)'!r} needs "
                                             f"{tuple(shape)} {dtype}: these workspaces belong to another model "
                                             f"or recipe"))
            elif device is not None and t.device != device:
                problems.append((ValueError, f"workspace entry {entry!r} is on {t.device} but {type(m).__name__} "
                                             f"at {path or '(root)'!r} is on {device}: move the workspaces "
                                             f"({{k: v.to(device) for k, v in ws.items()}}) or make them after "
                                             f"model.to(device)"))
    if key not in ws:
        made_for = [k[len(_RECIPE_PREFIX):] for k in ws if k.startswith(_RECIPE_PREFIX)]
        shapes = [msg for cls, msg in problems if cls is ValueError]
        raise ValueError(f"these workspaces were made for recipe {made_for[0] if made_for else '(unknown)'} "
                         f"but the call uses {key[len(_RECIPE_PREFIX):]}; make them with "
                         f"tef.init_workspaces(model, recipe) for the recipe you run with"
                         + (f" ({shapes[0]})" if shapes else ""))
    if problems:
        cls, msg = problems[0]
        raise cls(msg)
    extra = sorted(set(ws) - expected)
    if extra:
        raise KeyError(f"workspace entries {extra[:5]} belong to no te_func layer of this model: these "
                       f"workspaces were made for another model")
    return owners


def functional_call(model: nn.Module, params, ws: dict, args=(), kwargs=None, *, recipe,
                    is_first_microbatch: bool | None = None):
    """Run `model` with `params` (as torch.func.functional_call takes them) and
    workspaces `ws`. Returns `(out, new_ws)`; nothing passed in is mutated.

    is_first_microbatch: None and True quantize the weights and store the casts
    in new_ws (None never reads them); False reuses a valid stored cast, else
    quantizes and stores. A layer called again within the call runs as False.
    A layer's own `is_first_microbatch=` argument, when given, wins.
    """
    _check_recipe(recipe)
    owners = validate_workspaces(model, ws, recipe)
    args = args if isinstance(args, tuple) else (args,)
    frame = Frame(recipe, ws, owners, is_first_microbatch)
    with push(frame):
        out = torch.func.functional_call(model, params, args, kwargs or {})
    return out, {**ws, **frame.updates}


@contextlib.contextmanager
def autocast(recipe):
    """Run te_func modules called inside in FP8 per `recipe`, caching nothing.

    For stateless recipes only: DelayedScaling needs workspaces (functional_call / Stateful).
    """
    _check_recipe(recipe)
    with push(Frame(recipe)):
        yield


def _split_aux(out, fn_name):
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise TypeError(f"{fn_name}: the function must return (loss, new_ws), new_ws being the dict "
                        f"tef.functional_call returned")
    return out


def backward_state_keys(ws: dict) -> list[str]:
    """The entries backward updates: DelayedScaling's grad-role amax histories."""
    return [k for k in ws if k.endswith(GRAD_HISTORY)]


def merge_backward_state(new_ws: dict, state_grads: dict) -> dict:
    """new_ws with each grad history combined with its "gradient" by elementwise max.

    That gradient is the history with the backward amax recorded in slot 0,
    so max merges it, also across microbatches; a sum would add amaxes.
    """
    return {**new_ws, **{k: torch.maximum(new_ws[k], g) for k, g in state_grads.items()}}


def _grad_and_value(fn, argnums, fn_name, args, kwargs):
    """torch.func.grad_and_value of fn(params, ws, ...) -> (loss, new_ws) w.r.t. `argnums`
    and the grad histories in ws. Returns (grads, loss, new_ws), the backward-time
    state merged into new_ws."""
    if len(args) < 2 or not isinstance(args[1], dict):
        raise TypeError(f"{fn_name}: call it as f(params, ws, ...), ws being the workspace dict from "
                        f"tef.init_workspaces; got {len(args)} positional argument(s)")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if 1 in nums:
        raise ValueError(f"{fn_name}: argnums must not include 1 (the workspaces): they are state, not "
                         f"parameters; their backward-time updates come back in new_ws")
    state = {k: args[1][k] for k in backward_state_keys(args[1])}

    def with_state(*a, **k):
        # Not `*user, st = a`: dynamo in torch 2.11 traces that starred target as a tuple and
        # then breaks the graph at the item assignment below.
        user, st = list(a[:-1]), a[-1]
        user[1] = {**user[1], **st}   # the histories as separate inputs, so that they get gradients
        return _split_aux(fn(*user, **k), fn_name)

    grads, (loss, new_ws) = torch.func.grad_and_value(with_state, argnums=nums + (len(args),), has_aux=True)(
        *args, state, **kwargs)
    *grads, state_grads = grads
    grads = grads[0] if isinstance(argnums, int) else tuple(grads)
    return grads, loss, merge_backward_state(new_ws, state_grads)


def grad(fn, argnums=0):
    """`torch.func.grad` for a `fn(params, ws, ...) -> (loss, new_ws)`.

    Returns a function giving `(grads, new_ws)`; under DelayedScaling new_ws
    also holds the grad-role amax histories recorded in backward.
    """
    def wrapped(*args, **kwargs):
        grads, _, new_ws = _grad_and_value(fn, argnums, "tef.grad", args, kwargs)
        return grads, new_ws
    return wrapped


def value_and_grad(fn, argnums=0):
    """Like `grad`, returning `(loss, grads, new_ws)`."""
    def wrapped(*args, **kwargs):
        grads, loss, new_ws = _grad_and_value(fn, argnums, "tef.value_and_grad", args, kwargs)
        return loss, grads, new_ws
    return wrapped
