"""The functional frame: workspaces in, workspaces out, routed by module path. Returning the
updated workspaces instead of mutating anything lets torch.func and torch.compile see pure functions."""
from __future__ import annotations

import contextlib
import difflib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import _compat, backward_state, distributed
from .errors import (EntryMismatchError, FrozenModelError, MissingEntryError, RecipeMismatchError, TransformError,
                     UnknownEntryError, UnknownParameterError, WorkspaceError)
from .functional._common import first_microbatch
from .nn import TEModule
from .nn.frozen import FrozenLayer
from .nn.context import NO_CACHE, CallScope, Frame, open_call_scopes, push, push_call_scope
from .quant import lower
from .quant.workspace import (FORMAT_VERSION, RECIPE_ENTRY, RECIPE_KEY, Entry, fingerprint_entry, is_cast_key,
                              may_carry_backward_state)
from .recipe import RECIPES, Recipe, describe, difference, fingerprint, recipe_of

__all__ = ["init_workspaces", "functional_call", "autocast", "grad", "value_and_grad", "workspace_spec",
           "batch_scope_spec", "validate_workspaces", "keeps_weight_casts", "backward_keys", "upgrade_workspaces"]

def _check_recipe(recipe):
    if recipe is not None and not isinstance(recipe, RECIPES):
        raise TypeError(f"recipe must be None or a te_func.recipe recipe ({', '.join(r.__name__ for r in RECIPES)}), "
                        f"got {recipe!r}")


def _te_modules(model: nn.Module):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return [(path, m) for path, m in model.named_modules() if isinstance(m, TEModule)]


def _prefix(path: str) -> str:
    return f"{path}." if path else ""


def workspace_spec(model: nn.Module, recipe: Recipe | None) -> dict[str, Entry]:
    """Every workspace entry `model` needs under `recipe`: key -> Entry(shape, dtype, kind, backward)."""
    _check_recipe(recipe)
    return _spec_of(_te_modules(model), recipe)


def _spec_of(layers: list, recipe) -> dict[str, Entry]:
    # Without the batch-scope entries (batch amaxes), with the weight casts.
    spec = {k: e for path, m in layers for k, e in m.entries_at(recipe, path, (True, False)).keyed}
    spec[RECIPE_KEY] = RECIPE_ENTRY
    return spec


def batch_scope_spec(model: nn.Module, recipe: Recipe | None) -> dict[str, Entry]:
    """The entries (the batch's amaxes) a call in batch scope adds to `model`'s workspaces."""
    _check_recipe(recipe)
    return _batch_spec_of(_te_modules(model), recipe)


def _batch_spec_of(layers: list, recipe) -> dict[str, Entry]:
    return {_prefix(path) + k: e for path, m in layers for k, e in m.batch_scope_spec(recipe).items()}


def backward_keys(model: nn.Module, recipe) -> list[str]:
    """The entries of `model`'s workspaces that backward updates (DelayedScaling's grad histories)."""
    return [k for k, e in workspace_spec(model, recipe).items() if e.backward]


def backward_weights(model: nn.Module, recipe) -> dict[str, torch.Tensor | None]:
    """Each of backward_keys -> the weight of the GEMM whose backward updates it (or None)."""
    _check_recipe(recipe)
    return {_prefix(path) + k: getattr(m, m.gemm_param(g.weight), None)
            for path, m in _te_modules(model) for g in m.gemms()
            for k, e in lower(recipe).entries(g, m.gemm_weight(g.weight).shape).items() if e.backward}


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def init_workspaces(model: nn.Module, recipe: Recipe | None, *,
                    weight_cache: bool = True) -> dict[str, torch.Tensor]:
    """Fresh workspaces for every te_func layer of `model` under `recipe`: a flat dict keyed by
    module path, every entry on its layer's device, the casts made from the current weights.

    weight_cache=False leaves the casts out: each call casts its weights (is_first_microbatch None)
    and frees them after its backward, one FP8 copy of every weight less resident memory.
    On CUDA the entries are marked static addresses, so CUDA graphs read them in place
    (docs/workspaces.md)."""
    _check_recipe(recipe)
    units = distributed.fsdp_units(model)
    distributed.check_layouts(model, recipe, units)
    ws = {}
    for path, m in _te_modules(model):
        # FSDP-sharded weights are cast whole, as one process casts them (collective: every rank calls this).
        weights = distributed.cast_sources(path, m, units) if weight_cache else None
        ws.update({_prefix(path) + k: v for k, v in m.init_workspace(recipe, weights, path, weight_cache).items()})
        m.view(recipe, path)    # what each call validates these against, made now: a trace then reads it
    _remember_names(model)
    ws[RECIPE_KEY] = fingerprint_entry(recipe, _device_of(model))
    ws = outside_inference_mode(ws)     # made in an evaluation block, used for training after it
    mark_static(ws.values())
    return ws


def outside_inference_mode(ws: dict) -> dict:
    """`ws` with inference tensors as normal ones, usable outside inference_mode."""
    if torch.compiler.is_compiling() or not any(isinstance(v, torch.Tensor) and v.is_inference()
                                                for v in ws.values()):
        return ws
    with torch.inference_mode(False):
        return {k: v.clone() if isinstance(v, torch.Tensor) and v.is_inference() else v for k, v in ws.items()}


def mark_static(tensors) -> None:
    """Mark CUDA tensors as static inputs for CUDA graphs (see `init_workspaces`)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda and not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(t, guard=False)


# id -> (weak reference, version, value) of fingerprints read: reading one waits for the device.
_fingerprints_seen: dict[int, tuple] = {}


def _recipe_made_for(t: torch.Tensor) -> tuple[int, int] | None:
    """(format version, fingerprint) of a RECIPE_KEY entry, or None where a read would break a transform."""
    if torch.compiler.is_compiling() or _compat.is_wrapped(t):
        return None
    seen = _fingerprints_seen.get(id(t))
    if seen is not None and seen[0]() is t and seen[1] == t._version:
        return seen[2]
    value = tuple(t.tolist())
    key = id(t)
    _fingerprints_seen[key] = (weakref.ref(t, lambda _: _fingerprints_seen.pop(key, None)), t._version, value)
    return value


def _layout_problem(ws: dict) -> EntryMismatchError | None:
    """What is wrong with how `ws` is batched, read from its RECIPE_KEY entry, or None."""
    t = ws.get(RECIPE_KEY)
    if not isinstance(t, torch.Tensor):
        return None
    if t.dim() == 2 and tuple(t.shape[1:]) == RECIPE_ENTRY.shape:
        return EntryMismatchError(
            f"these workspaces are stacked ({t.shape[0]} sets along dim 0, as tef.stack_module_state "
            f"makes for an ensemble): call tef.functional_call on them under torch.func.vmap with in_dims "
            f"0 over the workspaces, take the sets apart with tef.unstack_workspaces, or, for per-sample "
            f"workspaces, fold them with tef.fold_workspaces", entry=RECIPE_KEY, expected=RECIPE_ENTRY.shape,
            got=tuple(t.shape))
    return None


def _made_for_problem(ws: dict, recipe) -> WorkspaceError | None:
    """What is wrong with the RECIPE_KEY entry of `ws` for `recipe`, or None."""
    t = ws.get(RECIPE_KEY)
    if t is None:
        old = [k for k in ws if k.startswith("te_func.recipe=")]
        if old:
            return RecipeMismatchError(f"these workspaces were written by te_func 0.1 (workspace format 1, made "
                                       f"for {old[0][len('te_func.recipe='):]}); convert them with "
                                       f"tef.upgrade_workspaces(old_ws, model, recipe) or make new ones with "
                                       f"tef.init_workspaces(model, recipe)", recipe=recipe)
        return MissingEntryError(f"workspace entry {RECIPE_KEY!r} is missing: these are not workspaces from "
                                 f"tef.init_workspaces(model, recipe)", entry=RECIPE_KEY)
    if tuple(t.shape) != RECIPE_ENTRY.shape or t.dtype != RECIPE_ENTRY.dtype:
        return EntryMismatchError(f"workspace entry {RECIPE_KEY!r} has shape {tuple(t.shape)} and dtype {t.dtype}, "
                                  f"not {RECIPE_ENTRY.shape} int64: not a te_func workspace", entry=RECIPE_KEY,
                                  expected=(RECIPE_ENTRY.shape, RECIPE_ENTRY.dtype), got=(tuple(t.shape), t.dtype))
    made_for = _recipe_made_for(t)
    if made_for is None:
        return None
    version, fp = made_for
    if version != FORMAT_VERSION:
        how = ("convert them with tef.upgrade_workspaces(ws, model, recipe)" if version in _UPGRADABLE
               else "make new ones with tef.init_workspaces(model, recipe)")
        return RecipeMismatchError(f"these workspaces are in te_func's workspace format {version}; this te_func "
                                   f"reads format {FORMAT_VERSION}: {how}", recipe=recipe)
    if fp != fingerprint(recipe):
        try:
            made = recipe_of(fp)
        except KeyError:        # a recipe this process has not made: its class, from the entries
            what = f"made for {_recipe_class_of(ws)}, run with {describe(recipe)}"
        else:
            what = difference(made, recipe)
        return RecipeMismatchError(f"these workspaces were made for another recipe: {what}. Make them with "
                                   f"tef.init_workspaces(model, recipe) for the recipe you run with",
                                   recipe=recipe)
    return None


def _recipe_class_of(ws: dict) -> str:
    """The recipe class workspaces' entries show (each keeps its own kind of entry)."""
    keys = [k for k in ws if k != RECIPE_KEY]
    if any(k.endswith("amax_history") for k in keys):
        return "DelayedScaling"
    if any(k.endswith("global_amax") for k in keys):
        return "NVFP4BlockScaling"
    if any(k.endswith("scale_inv_t") for k in keys):
        return "MXFP8BlockScaling or Float8BlockScaling"
    if keys:
        return "Float8CurrentScaling"
    return "another recipe (or None)"


def _entry_problems(layers: list, ws, recipe, owners: dict, dropped: set):
    """Yields a WorkspaceError for each entry of `ws` that does not fit the te_func `layers` of a
    model ((path, module) pairs) under `recipe`; fills `owners` (as validate_workspaces returns it)
    and `dropped` (the kinds `ws` holds none of)."""
    expected = {RECIPE_KEY}
    # Batch-scope entries come all or none; so do weight casts (none: weight_cache=False).
    views = [m.view(recipe, path) for path, m in layers]
    for kind in ("batch_amax", "cast"):
        keys = [k for v in views for k in v.kinds[kind]]
        if keys and not any(k in ws for k in keys):
            dropped.add(kind)
    if "cast" in dropped and any(is_cast_key(k) for k in ws):    # casts, of another model's layers
        dropped.remove("cast")
    without = ("batch_amax" in dropped, "cast" in dropped)
    for (path, m), view in zip(layers, views):
        # What a call's backward reads as the call was given it: grad histories, random streams.
        entries = view.at[without]
        owners[id(m)] = (path, entries.names, entries.reads)
        device = _layer_device(m)
        for entry, e in entries.keyed:
            expected.add(entry)
            t = ws.get(entry)
            if t is None and e.kind == "batch_amax":
                yield MissingEntryError(f"workspace entry {entry!r} is missing: batch-scope entries come all "
                                        f"together (tef.per_sample_grad(..., scope='batch') adds them for one call)",
                                        entry=entry, layer=path)
            elif t is None:
                yield MissingEntryError(f"workspace entry {entry!r} is missing: these workspaces were not made for "
                                        f"this model (tef.init_workspaces(model, recipe) makes the right ones)"
                                        + ("; weight casts come all together, or none at all (weight_cache=False)"
                                           if e.kind == "cast" else ""), entry=entry, layer=path)
            elif tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                yield EntryMismatchError(f"workspace entry {entry!r} has shape {tuple(t.shape)} and dtype {t.dtype}, "
                                         f"but {type(m).__name__} at {path or '(root)'!r} needs {tuple(e.shape)} "
                                         f"{e.dtype}: {_shape_hint(tuple(t.shape), e)}", entry=entry, layer=path,
                                         expected=(tuple(e.shape), e.dtype), got=(tuple(t.shape), t.dtype))
            elif device is not None and t.device != device:
                yield EntryMismatchError(f"workspace entry {entry!r} is on {t.device} but {type(m).__name__} at "
                                         f"{path or '(root)'!r} is on {device}: move the workspaces "
                                         f"({{k: v.to(device) for k, v in ws.items()}}) or make them after "
                                         f"model.to(device)", entry=entry, layer=path, expected=device, got=t.device)
    extra = sorted(set(ws) - expected)
    if extra:
        yield UnknownEntryError(f"workspace entries {extra[:5]} belong to no te_func layer of this model: these "
                                f"workspaces were made for another model", entries=extra)


def _layer_device(m: nn.Module) -> torch.device | None:
    """The device of a layer's parameters; None on "meta" (a vmapped ensemble's base says nothing
    about devices). Its own first: a trace interprets every walk of parameters() anew."""
    for p in m._parameters.values():
        if p is not None and p.device.type != "meta":
            return p.device
    return next((p.device for p in m.parameters() if p.device.type != "meta"), None)


def _shape_hint(got: tuple, e) -> str:
    if got == tuple(e.shape):
        return (f"te_func keeps this entry in {e.dtype}; convert it (.to({e.dtype})) or make the workspaces with "
                f"tef.init_workspaces(model, recipe)")
    if len(got) == len(e.shape) + 1 and got[1:] == tuple(e.shape):
        return ("it is stacked (one per ensemble member or sample) among entries that are not: stack every "
                "entry (tef.stack_workspaces) or none")
    return "these workspaces belong to another model or recipe"


def validate_workspaces(model: nn.Module, ws: dict[str, torch.Tensor], recipe: Recipe | None) -> dict:
    """Check that `ws` holds every entry `model` needs under `recipe` and no other, made for `recipe`;
    raise an error naming what does not fit. Returns {id(module): (path, entry names, those backward
    reads as given)}."""
    return _validate(model, ws, recipe)[0]


def keeps_weight_casts(model, ws, recipe) -> bool:
    """validate_workspaces, then whether `ws` keeps the weight casts (not: weight_cache=False)."""
    return _validate(model, ws, recipe)[1]


def _validate(model, ws, recipe, layers: list | None = None) -> tuple[dict, bool]:
    """validate_workspaces' owners, and keeps_weight_casts' answer; `layers`: the model's
    _te_modules where the caller has them (a traced call walks the module tree once)."""
    if not isinstance(ws, dict):
        raise TypeError(f"workspaces must be the dict from tef.init_workspaces(model, recipe), got {type(ws).__name__}")
    _check_recipe(recipe)
    layout = _layout_problem(ws)
    if layout is not None:
        raise layout
    owners: dict = {}
    dropped: set[str] = set()
    layers = _te_modules(model) if layers is None else layers
    first_entry = next(_entry_problems(layers, ws, recipe, owners, dropped), None)
    made_for = _made_for_problem(ws, recipe)
    if made_for is not None:        # the recipe first: the entries' misfit follows from it
        raise made_for
    if first_entry is not None:
        raise first_entry
    return owners, "cast" not in dropped


# torch.func.functional_call swaps tensors into the module while it runs: eager calls take turns.
_locks: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_locks_lock = threading.Lock()


def _model_lock(model: nn.Module):
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    with _locks_lock:
        lock = _locks.get(model)
        if lock is None:
            lock = _locks[model] = threading.RLock()
    return lock


def functional_call(model: nn.Module, params: dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], ...],
                    ws: dict[str, torch.Tensor], args: tuple | Any = (), kwargs: dict[str, Any] | None = None, *,
                    recipe: Recipe | None, is_first_microbatch: bool | None = None,
                    amax_group: Any = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """Run `model` with `params` (as torch.func.functional_call takes them) and workspaces `ws`
    (from `init_workspaces(model, recipe)`). Returns `(out, new_ws)`: the model's output, and every
    entry of `ws`, updated. Nothing passed in is mutated.

    is_first_microbatch: None and True cast the weights and store the casts (None never reads
    them); False reuses a stored cast. A layer called again within the call runs as False; a layer's
    own argument wins. amax_group: the ranks DelayedScaling(reduce_amax=True) reduces over.
    Under FSDP, `params` may be the sharded parameters (docs/distributed.md)."""
    return call_watched(model, params, ws, args, kwargs, recipe=recipe, is_first_microbatch=is_first_microbatch,
                        amax_group=amax_group)


def call_watched(model: nn.Module, params, ws: dict, args=(), kwargs=None, *, recipe,
                 is_first_microbatch: bool | None = None, amax_group=None, watch=None):
    """`functional_call`, with `watch` (tef.Stateful's) handed to every layer's frame; params None:
    the model runs with its own tensors (tef.Stateful's call), so nothing is swapped in."""
    # The module tree walked once a call: under torch.compile every walk is traced anew.
    layers = _te_modules(model)
    if recipe is not None and not layers:
        if any(isinstance(m, FrozenLayer) for m in model.modules()):
            raise FrozenModelError(f"tef.functional_call: {type(model).__name__} is frozen (tef.freeze): it holds "
                                   f"FP8 weight casts for inference only, with no workspaces to thread; call it "
                                   f"directly (frozen(x)), or train the model it was frozen from")
        raise ValueError(f"tef.functional_call: the model ({type(model).__name__}) has no te_func layers, so "
                         f"recipe={type(recipe).__name__} would change nothing; convert it first: tef.convert(model)")
    if params is not None:
        _check_param_names(model, params)
    if isinstance(ws, dict) and not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled():
        ws = outside_inference_mode(ws)     # workspaces an inference_mode call returned
    owners, weight_cache = _validate(model, ws, recipe, layers)
    if not weight_cache and is_first_microbatch is not None:
        raise ValueError(NO_CACHE.format(who="tef.functional_call", value=is_first_microbatch))
    group = distributed.amax_reduction_group(recipe, amax_group)
    scopes = open_call_scopes()
    spec = _spec_of(layers, recipe) if scopes or group is not None else {}
    if scopes:   # what tef.grad merges (and all-reduces over `group`) and te_func.vmapped folds
        batch_spec = _batch_spec_of(layers, recipe)
        spec = {**spec, **{k: e for k, e in batch_spec.items() if k in ws}}
        backward = [k for k, e in spec.items() if e.backward]
        _refuse_second_differentiated_call(model, ws, owners, scopes, backward)
        for scope in scopes:
            scope.spec.update(spec)
            scope.batch_spec.update(batch_spec)
            scope.amax_groups.update(dict.fromkeys(backward, group))
    args = args if isinstance(args, tuple) else (args,)
    frame = Frame(recipe, ws, owners, first_microbatch(is_first_microbatch, "tef.functional_call"),
                  update_state=torch.is_grad_enabled(), batch_scales=any(s.batch_scales for s in scopes),
                  watch=watch, weight_cache=weight_cache)
    if params is None:      # FSDP's own hooks gather a sharded model's weights here
        with push(frame):
            out = model(*args, **(kwargs or {}))
    else:
        with _model_lock(model), push(frame), distributed.gathered_params(model, params) as params:
            out = torch.func.functional_call(model, params, args, kwargs or {})
    # Plain state: an entry made under autograd would carry the step's graph into the next step.
    new_ws = {k: v.detach() if isinstance(v, torch.Tensor) and v.requires_grad else v
              for k, v in {**ws, **frame.updates}.items()}
    if group is not None:   # the forward's amaxes (input and weight roles), as TE reduces them after a forward
        forward = {k: new_ws[k] for k, e in spec.items() if e.kind == "amax_history" and not e.backward}
        new_ws.update(distributed.reduce_amax_slots(forward, group))
    return out, new_ws


def _check_param_names(model: nn.Module, params) -> None:
    """Refuses keys of `params` (a dict, or a tuple of dicts as torch.func.functional_call takes) that
    name no parameter or buffer of `model`: torch would run with the model's own tensor instead."""
    dicts = params if isinstance(params, (tuple, list)) else (params,)
    keys = [k for d in dicts if isinstance(d, dict) for k in d]
    # The names walk costs ~0.1 ms a call on a 2-layer Llama, and a trace interprets it: kept on the
    # model, walked again only when a key is not among them (a layer added since, or a misspelt key).
    names = getattr(model, _NAMES, None)
    if names is None or any(k not in names for k in keys):
        names = _remember_names(model)
    unknown = [k for k in keys if k not in names]
    if unknown:
        near = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise UnknownParameterError(f"tef.functional_call: {unknown[0]!r} names no parameter or buffer of "
                                    f"{type(model).__name__}{hint} (model.named_parameters() and named_buffers() "
                                    f"list the names)", keys=unknown, nearest=near[0] if near else None)


_NAMES = "_te_func_tensor_names"


def _remember_names(model: nn.Module) -> frozenset[str]:
    """The names of `model`'s tensors, kept on it by an eager call (a trace only reads them: a
    store would be a side effect, and the attribute appearing after a trace would fail its guards,
    so init_workspaces keeps them before any trace)."""
    names = frozenset(k for k, _ in (*model.named_parameters(remove_duplicate=False),
                                    *model.named_buffers(remove_duplicate=False)))
    if not torch.compiler.is_compiling():
        model.__dict__[_NAMES] = names
    return names


def _refuse_second_differentiated_call(model, ws: dict, owners: dict, scopes: list, backward: list) -> None:
    """Refuses a layer with grad histories run twice inside one tef.grad on the same history tensors:
    autograd would add the two backward amaxes. Workspaces threaded from one call to the next are
    taken: the later call records its amax into the history it returns (ops/boundary.py), tef.grad
    merges the earlier one's into it by max, TE's rule for a GEMM run twice in a step."""
    keys = set(backward)
    layers = {i: (path, tuple(ws.get(_prefix(path) + n) for n in names if _prefix(path) + n in keys))
              for i, (path, names, _) in owners.items() if any(_prefix(path) + n in keys for n in names)}
    for scope in scopes:
        if scope.differentiated is None:
            continue
        again = sorted(path for i, (path, read) in layers.items() if i in scope.differentiated
                       and any(a is b for a, b in zip(read, scope.differentiated[i][1])))
        if again:
            layer = type(model.get_submodule(again[0])).__name__
            raise TransformError(
                f"{layer} at {again[0] or '(root)'!r} ran twice inside one tef.grad under DelayedScaling on the "
                f"same workspaces: autograd would add the two backward amaxes, where TE keeps their max. Pass the "
                f"new_ws the first call returned to the second, take tef.grad of one call per microbatch, or use "
                f"tef.Stateful", layer=again[0])
        scope.differentiated.update(layers)


@contextlib.contextmanager
def autocast(recipe: Recipe | None):
    """Run te_func modules called inside in FP8 per `recipe`, caching nothing (stateless recipes)."""
    _check_recipe(recipe)
    with push(Frame(recipe)):
        yield


def _is_workspaces(x) -> bool:
    return isinstance(x, dict) and RECIPE_KEY in x


def _split_aux(out, fn_name: str, has_aux: bool):
    """(loss, new_ws, aux) from what `fn` returned: (loss, new_ws), or with has_aux (loss, new_ws, aux)
    or ((loss, aux), new_ws)."""
    if has_aux and isinstance(out, tuple) and len(out) == 3 and _is_workspaces(out[1]):
        return out
    if has_aux and isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], tuple) and len(out[0]) == 2 \
            and _is_workspaces(out[1]):
        return out[0][0], out[1], out[0][1]
    if not has_aux and isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return out[0], out[1], None
    shape = "(loss, new_ws, aux) or ((loss, aux), new_ws)" if has_aux else "(loss, new_ws)"
    hint = ("" if has_aux or not (isinstance(out, tuple) and len(out) == 3)
            else "; to return more, pass has_aux=True and return (loss, new_ws, aux)")
    raise TypeError(f"{fn_name}: the function must return {shape}, new_ws being the dict tef.functional_call "
                    f"returned{hint}")


def _carries_state(key: str, t) -> bool:
    # The entries a backward can write to (gradient amaxes, float32); the frame says which did.
    # Each one differentiated is wrapped and unwrapped by torch.func, traced by torch.compile.
    return may_carry_backward_state(key) and isinstance(t, torch.Tensor) and t.dtype == torch.float32


def _grad_and_value(fn, argnums, has_aux, fn_name, args, kwargs):
    """torch.func.grad_and_value of fn(params, ws, ...) -> (loss, new_ws[, aux]) w.r.t. `argnums` and
    the entries backward updates, which are merged into new_ws: (grads, loss, new_ws, aux)."""
    if len(args) < 2 or not isinstance(args[1], dict):
        raise TypeError(f"{fn_name}: call it as f(params, ws, ...), ws being the workspace dict from "
                        f"tef.init_workspaces; got {len(args)} positional argument(s)")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if 1 in nums:
        raise ValueError(f"{fn_name}: argnums must not include 1 (the workspaces): they are state, not "
                         f"parameters; their backward-time updates come back in new_ws")
    # Only the functional_calls inside fn know which entries backward updates: differentiate every
    # entry that can carry such state, and merge those the calls declare (Entry.backward).
    state = {k: v for k, v in args[1].items() if _carries_state(k, v)}
    scope = CallScope(differentiated={})
    # FSDP-sharded parameters: gathered before, gradients reduce-scattered after.
    args, shard_specs = distributed.gathered_for_grad(args, nums)

    def with_state(*a, **k):
        # Not `*user, st = a`: torch 2.11's dynamo makes that a tuple and breaks at the assignment.
        user, st = list(a[:-1]), a[-1]
        user[1] = {**user[1], **st}   # the entries as separate inputs, so that they get gradients
        loss, new_ws, aux = _split_aux(fn(*user, **k), fn_name, has_aux)
        return loss, (new_ws, aux) if has_aux else (new_ws,)

    with push_call_scope(scope):
        grads, (loss, (new_ws, *aux)) = torch.func.grad_and_value(
            with_state, argnums=nums + (len(args),), has_aux=True)(*args, state, **kwargs)
    aux = aux[0] if has_aux else None
    *grads, state_grads = grads
    grads = grads[0] if isinstance(argnums, int) else tuple(grads)
    grads = distributed.scattered_grads(grads, argnums, shard_specs)
    backward = {k: state_grads[k] for k in scope.backward_keys if k in state_grads}
    new_ws = backward_state.merge(new_ws, backward_state.reduce_amaxes(backward, scope.amax_groups))
    return grads, loss, new_ws, aux


def grad(fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """`torch.func.grad` for te_func: `fn(params, ws, *args, **kwargs)` returns `(loss, new_ws)`, new_ws
    being what `tef.functional_call` returned (with has_aux: `(loss, new_ws, aux)`, or
    `((loss, aux), new_ws)`). The returned function takes fn's arguments and returns
    `(grads, new_ws)` (with has_aux: `(grads, new_ws, aux)`): grads of the arguments `argnums` names
    (an int: that argument's; a tuple: a tuple, as torch.func.grad), never of `ws` (argument 1), and
    new_ws with what backward computed merged in (DelayedScaling's output-gradient amaxes)."""
    def wrapped(*args, **kwargs):
        grads, _, new_ws, aux = _grad_and_value(fn, argnums, has_aux, "tef.grad", args, kwargs)
        return (grads, new_ws, aux) if has_aux else (grads, new_ws)
    return wrapped


def value_and_grad(fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0,
                   has_aux: bool = False) -> Callable[..., Any]:
    """Like `grad`, returning `(loss, grads, new_ws)` (with has_aux: `(loss, grads, new_ws, aux)`)."""
    def wrapped(*args, **kwargs):
        grads, loss, new_ws, aux = _grad_and_value(fn, argnums, has_aux, "tef.value_and_grad", args, kwargs)
        return (loss, grads, new_ws, aux) if has_aux else (loss, grads, new_ws)
    return wrapped


# --- workspaces written by te_func 0.1 ----------------------------------------------------------

# The fields recipes had in workspace format 1, whose repr named the workspace's recipe.
_FORMAT1_FIELDS = {
    "DelayedScaling": ("margin", "fp8_format", "amax_history_len", "amax_compute_algo", "reduce_amax"),
    "Float8CurrentScaling": ("fp8_format", "fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"),
    "MXFP8BlockScaling": ("fp8_format",),
    "Float8BlockScaling": ("fp8_format", "fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad",
                           "x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"),
}


def _format1_repr(recipe) -> str:
    if recipe is None:
        return "None"

    def value(v):
        if type(v).__name__ == "QParams":   # its format-1 fields
            return f"QParams(power_2_scale={v.power_2_scale!r}, amax_epsilon={v.amax_epsilon!r})"
        return repr(v)

    name = type(recipe).__name__
    return f"{name}({', '.join(f'{f}={value(getattr(recipe, f))}' for f in _FORMAT1_FIELDS[name])})"


_UPGRADABLE = (1, 2)


def upgrade_workspaces(old: dict, model: nn.Module, recipe: Recipe | None) -> dict:
    """Workspaces of an earlier format, as this version keeps them. Format 1 (te_func 0.1: the
    recipe's repr and `made_by=` entries in key names); format 2 (MXFP8 scales as
    float8_e8m0fnu, now their bytes as uint8). Refused unless `old` was made for `recipe`."""
    _check_recipe(recipe)
    t = old.get(RECIPE_KEY)
    if isinstance(t, torch.Tensor) and tuple(t.shape) == RECIPE_ENTRY.shape and t.dtype == RECIPE_ENTRY.dtype:
        version, fp = (int(v) for v in t.tolist())
        if version != 2:
            raise ValueError(f"upgrade_workspaces: these workspaces are in format {version}, not 1 or 2")
        if fp != fingerprint(recipe):
            raise RecipeMismatchError(f"upgrade_workspaces: these workspaces were made for another recipe than "
                                      f"{recipe!r}", recipe=recipe)
        new = {k: v.view(torch.uint8).clone() if v.dtype == torch.float8_e8m0fnu else v.clone()
               for k, v in old.items() if k != RECIPE_KEY}
        new[RECIPE_KEY] = fingerprint_entry(recipe, t.device)
        validate_workspaces(model, new, recipe)
        return new
    made_for = [k[len("te_func.recipe="):] for k in old if k.startswith("te_func.recipe=")]
    if not made_for:
        raise ValueError("upgrade_workspaces: these are not te_func workspaces of an earlier format (neither a "
                         f"{RECIPE_KEY!r} entry nor format 1's 'te_func.recipe=...' entry)")
    if made_for[0] != _format1_repr(recipe):
        raise RecipeMismatchError(f"upgrade_workspaces: these workspaces were made for {made_for[0]}, not "
                                  f"{_format1_repr(recipe)}", recipe=recipe)
    spec = workspace_spec(model, recipe)
    device = _device_of(model)
    # Casts and states kept; the markers and a tensor-wise scale_inv's second copy dropped.
    new = {k: v.clone() for k, v in old.items() if k in spec and k != RECIPE_KEY}
    new[RECIPE_KEY] = fingerprint_entry(recipe, device)
    validate_workspaces(model, new, recipe)
    return new
