"""Per-sample gradients and ensembles: torch.func.vmap over te_func models, workspaces included
(per_sample_grad, fold_workspaces, stack/unstack_workspaces, stack/unstack_module_state).

A per-sample vmap runs every sample alone on one shared state, so every entry comes back once per
sample. The entries that record amaxes hold each sample's own, and their max over the samples is
what one call on the batch records; every other entry is the same for every sample and is kept
once. The quantization scopes ("sample", "batch") per role and recipe: docs/functional.md."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils import _pytree as pytree

from . import _compat
from .frame import batch_scope_spec, init_workspaces, validate_workspaces, value_and_grad, workspace_spec
from .nn.context import CallScope, push_call_scope
from .quant.workspace import RECIPE_ENTRY, RECIPE_KEY

__all__ = ["SCOPES", "per_sample_grad", "per_sample_value_and_grad", "fold_workspaces", "stack_workspaces",
           "unstack_workspaces", "stack_module_state", "unstack_module_state"]

SCOPES = ("sample", "batch")

# A sample's amax may exceed the batch's by the last bits (a GPU GEMM picks its kernel by shape);
# a mean loss over the batch makes it larger by the batch size.
_ADDITIVE_SLACK = 2.0 ** -10


# --- per-sample gradients -------------------------------------------------------------------------

def per_sample_value_and_grad(fn, in_dims=0, *, scope: str = "sample", chunk_size: int | None = None,
                              argnums=0, keepdim: bool = False):
    """Per-sample `tef.value_and_grad` of `fn(params, ws, *args) -> (loss, new_ws)`.

    in_dims: for `args` only (params and ws are shared), as torch.func.vmap takes it. scope: "sample"
    or "batch" (docs/functional.md). chunk_size: samples per vmap call. keepdim: pass each sample as
    a batch of one, for models whose forward needs a batch dim (HuggingFace's).
    Returns a function of `(params, ws, *args)` giving `(losses, grads, new_ws)`: losses (batch,),
    grads with a leading batch dim, new_ws in the shapes of ws. In batch scope `fn` also runs once on
    the first sample without gradients and, under current scaling, on the whole batch, whose loss
    must then be the sum of the samples' losses."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}: 'sample' quantizes each sample "
                         f"on its own, 'batch' with the scales of the whole batch")
    step = value_and_grad(fn, argnums)

    def wrapped(params, ws, *args):
        dims = _arg_dims(in_dims, args)
        _check_one_set(ws)
        batch = _batch_amaxes(step, fn, params, ws, args, dims, keepdim) if scope == "batch" else {}
        call, keys = CallScope(batch_scales=scope == "batch"), []

        def one_sample(params, ws, *args):
            if keepdim:
                args = _unsqueezed(args, dims)
            loss, grads, new_ws = step(params, ws, *args)
            keys[:] = new_ws
            unknown = [k for k in new_ws if k not in call.spec]
            if unknown:
                raise KeyError(f"per_sample_grad: fn returned workspace entries {unknown[:3]} that no "
                               f"tef.functional_call inside it read: return the new_ws it gave")
            records = {k: v for k, v in new_ws.items() if call.spec[k].records_amax}
            shared = {k: v for k, v in new_ws.items() if k not in records}
            _check_shared(shared)
            return loss, grads, records, shared

        # Every output at dim 0: an unbatched one is an expanded view, which [0] takes back without a
        # copy (out_dims None would refuse what an outer vmap batched).
        vmapped = torch.func.vmap(one_sample, in_dims=(None, None, *dims))
        losses, grads, folded, shared = [], [], {}, {}
        with push_call_scope(call):
            # Chunked here: vmap's chunk_size would concatenate copies whose max alone is needed.
            for chunk in _chunks(args, dims, chunk_size):
                loss, grad, records, shared = vmapped(params, {**ws, **batch}, *chunk)
                losses.append(loss)
                grads.append(grad)
                folded = {k: torch.maximum(folded[k], v.amax(0)) if k in folded else v.amax(0)
                          for k, v in records.items()}
        _check_additive(batch, folded)
        losses, grads = _cat(losses), _cat(grads)
        return losses, grads, {k: shared[k][0] if k in shared else folded[k] for k in keys if k not in batch}
    return wrapped


def per_sample_grad(fn, in_dims=0, *, scope: str = "sample", chunk_size: int | None = None, argnums=0,
                    keepdim: bool = False):
    """Like `per_sample_value_and_grad`, returning `(grads, new_ws)`."""
    inner = per_sample_value_and_grad(fn, in_dims, scope=scope, chunk_size=chunk_size, argnums=argnums,
                                      keepdim=keepdim)

    def wrapped(params, ws, *args):
        _, grads, new_ws = inner(params, ws, *args)
        return grads, new_ws
    return wrapped


def _arg_dims(in_dims, args: tuple) -> tuple:
    if in_dims is None or isinstance(in_dims, int):
        dims = (in_dims,) * len(args)
    elif isinstance(in_dims, (tuple, list)):
        if len(in_dims) != len(args):
            hint = (": params and ws take none, every sample shares them" if len(in_dims) == len(args) + 2
                    else "")
            raise ValueError(f"per_sample_grad: in_dims has {len(in_dims)} entries for the {len(args)} "
                             f"argument(s) after params and ws; give one per argument{hint}")
        dims = tuple(in_dims)
    else:
        raise TypeError(f"per_sample_grad: in_dims must be an int, None or a tuple with one entry per argument "
                        f"after params and ws, got {in_dims!r}")
    if all(d is None for d in pytree.tree_leaves(dims)) or not args:
        raise ValueError("per_sample_grad: no argument is batched (every in_dims entry is None); give the "
                         "dim of the samples in the arguments after params and ws")
    return dims


def _check_one_set(ws):
    if not isinstance(ws, dict):
        raise TypeError(f"per_sample_grad: ws must be the workspace dict of tef.init_workspaces, got "
                        f"{type(ws).__name__}")
    t = ws.get(RECIPE_KEY)
    if isinstance(t, torch.Tensor) and t.dim() == len(RECIPE_ENTRY.shape) + 1:
        raise ValueError(f"per_sample_grad: these workspaces are stacked ({t.shape[0]} sets, an ensemble's); "
                         f"per-sample gradients take one model's workspaces, which every sample shares. For "
                         f"an ensemble, torch.func.vmap the per-sample function over the members")


def _leaves_with_dims(args: tuple, dims: tuple):
    """(leaves of args, their in_dims, the tree spec), the dims checked as vmap checks them."""
    flat, spec = pytree.tree_flatten(args)
    flat_dims = pytree._broadcast_to_and_flatten(dims, spec)
    if flat_dims is None:
        raise ValueError(f"per_sample_grad: in_dims {dims!r} does not match the arguments' structure")
    for a, d in zip(flat, flat_dims):
        if d is not None and not isinstance(a, torch.Tensor):
            raise TypeError(f"per_sample_grad: in_dims gives dim {d} for an argument that is not a tensor "
                            f"({type(a).__name__}); give it None")
    return flat, flat_dims, spec


def _first_sample(args: tuple, dims: tuple, keepdim: bool) -> tuple:
    """`args` with every batched tensor at its first sample, as `fn` sees a sample."""
    flat, flat_dims, spec = _leaves_with_dims(args, dims)
    first = [a if d is None else a.narrow(d, 0, 1) if keepdim else a.select(d, 0) for a, d in zip(flat, flat_dims)]
    return pytree.tree_unflatten(first, spec)


def _unsqueezed(args: tuple, dims: tuple) -> tuple:
    """A sample's `args` (vmap took the batched dims away) with those dims back, of size 1."""
    flat, flat_dims, spec = _leaves_with_dims(args, dims)
    return pytree.tree_unflatten([a if d is None else a.unsqueeze(d) for a, d in zip(flat, flat_dims)], spec)


def _chunks(args: tuple, dims: tuple, chunk_size: int | None) -> list[tuple]:
    """`args` split into chunks of `chunk_size` samples (all of them in one for None)."""
    if chunk_size is None:
        return [args]
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"per_sample_grad: chunk_size must be None or a positive int, got {chunk_size!r}")
    flat, flat_dims, spec = _leaves_with_dims(args, dims)
    split = [None if d is None else torch.split(a, chunk_size, dim=d) for a, d in zip(flat, flat_dims)]
    n = len(next(s for s in split if s is not None))
    return [pytree.tree_unflatten([a if s is None else s[i] for a, s in zip(flat, split)], spec) for i in range(n)]


def _cat(chunks: list):
    """Per-chunk outputs (pytrees of tensors with a leading sample dim) as one."""
    if len(chunks) == 1:
        return chunks[0]
    flat = [pytree.tree_flatten(c)[0] for c in chunks]
    return pytree.tree_unflatten([torch.cat(ts) for ts in zip(*flat)], pytree.tree_structure(chunks[0]))


def _batch_amaxes(step, fn, params, ws, args, dims, keepdim: bool) -> dict:
    """The batch-scope entries filled with the whole batch's amaxes (empty without a tensor-wise current
    scale): a gradient-free forward of the first sample names them, then tef.grad of the whole batch
    records them (the output gradients' in backward, merged by max)."""
    names = CallScope()
    with push_call_scope(names), torch.no_grad():
        fn(params, ws, *_first_sample(args, dims, keepdim))
    spec = names.batch_spec
    if not spec:
        return {}
    device = ws[RECIPE_KEY].device
    zeros = {k: torch.zeros(e.shape, dtype=e.dtype, device=device) for k, e in spec.items()}
    _, _, batch_ws = step(params, {**ws, **zeros}, *args)
    return {k: batch_ws[k] for k in spec}


def _check_shared(shared: dict):
    # Casts and scales come from shared state alone: one that differs is an error (eager only).
    if torch.compiler.is_compiling():
        return
    level = _compat.current_level()
    for k, v in shared.items():
        if _compat.is_batched(v) and _compat.tensor_level(v) == level:
            raise ValueError(f"per_sample_grad: workspace entry {k!r} differs between samples, though it is "
                             f"computed from what every sample shares (parameters and workspaces): params "
                             f"and ws must be the same for every sample")


def _check_additive(batch: dict, folded: dict):
    # Reading the amaxes waits for the device: checked in eager mode only.
    if not batch or torch.compiler.is_compiling() or any(
            _compat.is_wrapped(v) for v in folded.values()):
        return
    above = torch.stack([folded[k] > given * (1 + _ADDITIVE_SLACK) for k, given in batch.items()])
    if not bool(above.any()):       # one wait for the device
        return
    for k, given in batch.items():
        got = folded[k]
        if bool(got > given * (1 + _ADDITIVE_SLACK)):
            raise ValueError(f"per_sample_grad(scope='batch'): a sample's amax for {k!r} ({got.item():.6g}) is "
                             f"larger than the whole batch's ({given.item():.6g}), so the pass over the batch "
                             f"did not compute what the samples do. fn(params, ws, *batch) must be the sum of fn "
                             f"over the samples: sum the samples' losses, not a mean over the batch")


# --- workspaces of a vmap -------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    # torch.equal has no CPU kernel for the 1-byte float types: compare their bytes.
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def fold_workspaces(model: torch.nn.Module, ws: dict, recipe) -> dict:
    """Per-sample workspaces (a leading sample dim, as vmap over tef.grad returns them) as one set:
    the amax records by max over the samples, every other entry once; batch-scope entries dropped."""
    spec = {**workspace_spec(model, recipe), **batch_scope_spec(model, recipe)}
    t = ws.get(RECIPE_KEY)
    if not isinstance(t, torch.Tensor) or t.dim() != len(RECIPE_ENTRY.shape) + 1:
        raise ValueError("fold_workspaces: these workspaces have no leading sample dim (their "
                         f"{RECIPE_KEY!r} entry is not stacked): they are one set already")
    n = t.shape[0]
    out = {}
    for k, v in ws.items():
        e = spec.get(k)
        if e is None:
            raise KeyError(f"fold_workspaces: entry {k!r} belongs to no te_func layer of this model")
        if tuple(v.shape) != (n, *e.shape):
            raise ValueError(f"fold_workspaces: entry {k!r} has shape {tuple(v.shape)}, not ({n}, "
                             f"{', '.join(map(str, e.shape))}): per-sample and single entries are mixed")
        if e.kind == "batch_amax":
            continue
        if e.records_amax:
            out[k] = v.amax(0)
            continue
        if not torch.compiler.is_compiling() and not torch.equal(_bits(v), _bits(v[:1]).expand_as(_bits(v))):
            raise ValueError(f"fold_workspaces: entry {k!r} ({e.kind}) differs between samples, so these are "
                             f"not per-sample copies of one state; an ensemble's stacked workspaces come apart "
                             f"with tef.unstack_workspaces")
        out[k] = v[0]
    return out


def stack_workspaces(workspaces: Sequence[dict]) -> dict:
    """One workspace dict per ensemble member (the same entries and recipe) -> one, stacked on dim 0."""
    workspaces = list(workspaces)
    if not workspaces:
        raise ValueError("stack_workspaces: got no workspaces")
    first = workspaces[0]
    for i, w in enumerate(workspaces):
        if not isinstance(w, dict) or RECIPE_KEY not in w:
            raise TypeError(f"stack_workspaces: set {i} is not a workspace dict of tef.init_workspaces")
        if w[RECIPE_KEY].dim() != len(RECIPE_ENTRY.shape):
            raise ValueError(f"stack_workspaces: set {i} is stacked already; stack one set per member")
        if w.keys() != first.keys():
            odd = sorted(w.keys() ^ first.keys())
            raise KeyError(f"stack_workspaces: sets 0 and {i} differ in entries {odd[:3]}: the members must be "
                           f"the same model made for the same recipe")
        for k, v in w.items():
            if v.shape != first[k].shape or v.dtype != first[k].dtype:
                raise ValueError(f"stack_workspaces: entry {k!r} is {tuple(v.shape)} {v.dtype} in set {i} but "
                                 f"{tuple(first[k].shape)} {first[k].dtype} in set 0")
        if not torch.compiler.is_compiling() and not torch.equal(w[RECIPE_KEY], first[RECIPE_KEY]):
            raise ValueError(f"stack_workspaces: set {i} was made for another recipe than set 0")
    return {k: torch.stack([w[k] for w in workspaces]) for k in first}


def unstack_workspaces(ws: dict) -> list[dict]:
    """The inverse of `stack_workspaces`: one dict per member (views into the stacked entries)."""
    t = ws.get(RECIPE_KEY) if isinstance(ws, dict) else None
    if not isinstance(t, torch.Tensor) or t.dim() != len(RECIPE_ENTRY.shape) + 1:
        raise ValueError("unstack_workspaces: these workspaces are not stacked (their "
                         f"{RECIPE_KEY!r} entry has no leading member dim)")
    n = t.shape[0]
    for k, v in ws.items():
        if v.dim() == 0 or v.shape[0] != n:
            raise ValueError(f"unstack_workspaces: entry {k!r} has shape {tuple(v.shape)}, without the leading "
                             f"member dim of size {n}: stacked and single entries are mixed")
    return [{k: v[i] for k, v in ws.items()} for i in range(n)]


def stack_module_state(models: Sequence[torch.nn.Module], recipe, workspaces: Sequence[dict] | None = None):
    """torch.func.stack_module_state with the workspaces: `(params, buffers, ws)` stacked along a
    new dim 0. `workspaces`: one set per model (default: fresh ones). vmap tef.functional_call over
    all three with `models[0]` (or a copy on "meta") as the model."""
    models = list(models)
    if workspaces is None:
        workspaces = [init_workspaces(m, recipe) for m in models]
    workspaces = list(workspaces)
    if len(workspaces) != len(models):
        raise ValueError(f"stack_module_state: {len(models)} models but {len(workspaces)} workspace sets")
    for m, w in zip(models, workspaces):
        validate_workspaces(m, w, recipe)
    params, buffers = torch.func.stack_module_state(models)
    return params, buffers, stack_workspaces(workspaces)


def unstack_module_state(params: dict, buffers: dict, ws: dict) -> list[tuple[dict, dict, dict]]:
    """The inverse of `stack_module_state`: `(params, buffers, ws)` of each member."""
    sets = unstack_workspaces(ws)
    for k, v in {**params, **buffers}.items():
        if v.dim() == 0 or v.shape[0] != len(sets):
            raise ValueError(f"unstack_module_state: {k!r} has shape {tuple(v.shape)}, without the leading "
                             f"member dim of size {len(sets)} that the workspaces have")
    return [({k: v[i] for k, v in params.items()}, {k: v[i] for k, v in buffers.items()}, w)
            for i, w in enumerate(sets)]
