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
from .recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

__all__ = ["init_workspaces", "functional_call", "autocast", "grad", "value_and_grad", "recipe_key"]

_RECIPES = (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling)
_RECIPE_PREFIX = "te_func.recipe="


@torch.compiler.assume_constant_result
def recipe_key(recipe) -> str:
    """The workspace entry whose name records the recipe the workspace was made for."""
    # A constant for torch.compile: dataclass repr is not traceable.
    return _RECIPE_PREFIX + repr(recipe)


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


def _validate(model, ws, recipe):
    """Every entry this model and recipe need, with the right shape and dtype, and no other."""
    if not isinstance(ws, dict):
        raise TypeError(f"workspaces must be the dict from tef.init_workspaces(model, recipe), got {type(ws).__name__}")
    key = recipe_key(recipe)
    if key not in ws:
        made_for = [k[len(_RECIPE_PREFIX):] for k in ws if k.startswith(_RECIPE_PREFIX)]
        raise ValueError(f"these workspaces were made for recipe {made_for[0] if made_for else '(unknown)'} "
                         f"but the call uses {key[len(_RECIPE_PREFIX):]}; make them with "
                         f"tef.init_workspaces(model, recipe) for the recipe you run with")
    owners, expected = {}, {key}
    for path, m in _te_modules(model):
        spec = m.workspace_spec(recipe)
        owners[id(m)] = (path, tuple(spec))
        for name, (shape, dtype) in spec.items():
            key = _prefix(path) + name
            expected.add(key)
            t = ws.get(key)
            if t is None:
                raise KeyError(f"workspace entry {key!r} is missing: these workspaces were not made for this "
                               f"model (tef.init_workspaces(model, recipe) makes the right ones)")
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"workspace entry {key!r} has shape {tuple(t.shape)} and dtype {t.dtype}, but "
                                 f"{type(m).__name__} at {path or '(root)'!r} needs {tuple(shape)} {dtype}: these "
                                 f"workspaces belong to another model or recipe")
    extra = sorted(set(ws) - expected)
    if extra:
        raise KeyError(f"workspace entries {extra[:5]} belong to no te_func layer of this model: these "
                       f"workspaces were made for another model")
    return owners


def functional_call(model: nn.Module, params, ws: dict, args=(), kwargs=None, *, recipe,
                    is_first_microbatch: bool | None = None):
    """Run `model` with `params` (as torch.func.functional_call takes them) and
    workspaces `ws`. Returns `(out, new_ws)`; nothing passed in is mutated.

    is_first_microbatch: None quantizes weights and caches nothing; True
    quantizes and caches; False reuses a valid cache, else quantizes and caches.
    A layer's own `is_first_microbatch=` argument, when given, wins.
    """
    _check_recipe(recipe)
    owners = _validate(model, ws, recipe)
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


def grad(fn, argnums=0):
    """`torch.func.grad` for a `fn(params, ws, ...) -> (loss, new_ws)`.

    Returns a function giving `(grads, new_ws)`.
    """
    def wrapped(*args, **kwargs):
        return torch.func.grad(lambda *a, **k: _split_aux(fn(*a, **k), "tef.grad"),
                               argnums=argnums, has_aux=True)(*args, **kwargs)
    return wrapped


def value_and_grad(fn, argnums=0):
    """Like `grad`, returning `(loss, grads, new_ws)`."""
    def wrapped(*args, **kwargs):
        grads, (loss, new_ws) = torch.func.grad_and_value(
            lambda *a, **k: _split_aux(fn(*a, **k), "tef.value_and_grad"),
            argnums=argnums, has_aux=True)(*args, **kwargs)
        return loss, grads, new_ws
    return wrapped
