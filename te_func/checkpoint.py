"""Activation checkpointing that torch.func transforms accept: `tef.checkpoint(block, *args)`.

torch.func refuses torch.utils.checkpoint. `tef.checkpoint` is one Function in the form it takes,
whose inputs are everything the block's gradient depends on: tensor arguments, parameters and
the workspace entries of its layers. Forward runs the block without keeping activations, in a
frame of its own, and hands the entries it wrote to the enclosing call. Backward runs the block
again as a later microbatch of the same step (as TE's te.checkpoint), over the forward's new
entries, with the grad histories and random streams as the forward was given them, and
differentiates it with torch.func.vjp. Outside torch.func it is torch.utils.checkpoint
(use_reentrant=False); under torch.compile the block runs as is (docs/functional.md)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from . import _compat
from .errors import DerivativeError
from .nn import TEModule
from .ops import backward_differentiable, first_order_only
from .nn.context import Frame, current_frame, push, transform_level

__all__ = ["checkpoint"]


def checkpoint(function, *args, **kwargs):
    """`function(*args, **kwargs)` with its activations recomputed in backward (module docstring).

    function: an nn.Module, a bound method of one, or a functools.partial of either (HuggingFace's
    gradient checkpointing passes `partial(layer.__call__, **kwargs)`). Tensors among the arguments
    are inputs (differentiated where wanted); other values are constants. Gradients and workspaces
    are those of the un-checkpointed call."""
    call, module, base = _callable(function)
    frame = current_frame()
    if frame is None or _outside_transforms():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    if torch.compiler.is_dynamo_compiling():
        # Dynamo cannot carry the block into the graph; its partitioner picks what to recompute.
        return function(*args, **kwargs)
    leaves, spec = pytree.tree_flatten((args, {**base, **kwargs}))
    tensors = tuple(i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor))
    named = list(module.named_parameters())
    names, params = tuple(n for n, _ in named), tuple(p for _, p in named)
    owners = _owners(frame, module)
    keys = tuple(k for path, entries, _ in owners.values() for k in _full(path, entries))
    entries = tuple(frame.updates.get(k, frame.workspaces[k]) for k in keys) if frame.workspaces is not None else ()
    as_given = frozenset(k for path, _, given in owners.values() for k in _full(path, given))
    block = _Block(call, module, tuple(None if isinstance(v, torch.Tensor) else v for v in leaves), spec,
                   tensors, names, keys, as_given, frame.workspaces is not None, frame.recipe,
                   owners, frame.is_first_microbatch, frame.update_state, frame.batch_scales, frame.weight_cache,
                   [None])
    outputs = _Checkpoint.apply(block, *(leaves[i] for i in tensors), *params, *entries)
    spec, static = block.out[0]
    n_out = sum(v is None for v in static)
    out, new_entries = iter(outputs[:n_out]), outputs[n_out:]
    if new_entries:
        new = dict(zip(keys, new_entries))
        frame.updates.update(new)
        if frame.watch is not None:
            frame.watch(new)
    return pytree.tree_unflatten([next(out) if v is None else v for v in static], spec)


def _callable(function):
    """(what to call with the block's args and kwargs, the module, the partial's keywords)."""
    if isinstance(function, nn.Module):
        return function, function, {}
    if isinstance(function, functools.partial) and function.args and isinstance(function.args[0], nn.Module):
        return functools.partial(function.func, *function.args), function.args[0], dict(function.keywords)
    if isinstance(function, functools.partial) and isinstance(getattr(function.func, "__self__", None), nn.Module):
        # a partial of the module's bound call (transformers 5.17: partial(super().__call__, **kwargs))
        return functools.partial(function.func, *function.args), function.func.__self__, dict(function.keywords)
    module = getattr(function, "__self__", None)
    if isinstance(module, nn.Module):
        return function, module, {}
    raise TypeError(f"tef.checkpoint: give the module to recompute (or a bound method of it, or a partial of "
                    f"one, or of a function taking it first), not {type(function).__name__}: under torch.func every "
                    f"tensor the gradient depends on must be an input, and a module's parameters are known")


def _outside_transforms() -> bool:
    # Plain eager code (tef.Stateful, .backward()): no torch.func level is open.
    return not torch.compiler.is_compiling() and not transform_level()


def _full(path: str, names) -> list[str]:
    return [f"{path}.{n}" if path else n for n in names]


def _owners(frame: Frame, module: nn.Module) -> dict:
    """id -> (path, entry names, those its backward reads as given) of the te_func layers in module."""
    owners = {}
    for m in module.modules():
        if isinstance(m, TEModule):
            owner = frame.owners.get(id(m))
            if owner is None and frame.workspaces is not None:
                raise RuntimeError(f"tef.checkpoint: {type(m).__name__} inside the checkpointed block is not a "
                                   f"submodule of the model passed to tef.functional_call")
            if owner is not None:
                owners[id(m)] = owner
    return owners


@dataclass(frozen=True, eq=False)
class _Block:
    """How to run the block again from the Function's inputs (args' tensors, params, entries)."""
    call: Callable
    module: nn.Module
    leaves: tuple         # (args, kwargs) flattened, None where a tensor input goes
    spec: pytree.TreeSpec
    tensors: tuple        # indices of leaves that are tensor inputs
    names: tuple          # parameter names, in input order
    keys: tuple           # workspace entries, in input order
    as_given: frozenset   # of keys: read by backward as the forward was given them
    keeps_state: bool     # the frame has workspaces (not tef.autocast)
    recipe: object
    owners: dict
    is_first_microbatch: bool | None
    update_state: bool | None
    batch_scales: bool
    weight_cache: bool
    # [(the outputs' pytree spec, their non-tensor leaves)], set by the forward (tensors go through the Function).
    out: list

    def split(self, values):
        n, p = len(self.tensors), len(self.names)
        return values[:n], values[n:n + p], values[n + p:]

    def run(self, values, *, recompute: bool):
        """(tensor outputs, new entries in key order) of the block on `values` (args, params, entries)."""
        inputs, params, entries = self.split(values)
        leaves = list(self.leaves)
        for i, t in zip(self.tensors, inputs):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        ws = dict(zip(self.keys, entries))
        frame = Frame(self.recipe, ws if self.keeps_state else None, self.owners,
                      False if recompute else self.is_first_microbatch, update_state=self.update_state,
                      batch_scales=self.batch_scales, weight_cache=self.weight_cache)
        # tie_weights as torch.func.functional_call: a tied parameter (GPT-2's lm_head) is listed once.
        with push(frame), _reparametrize_module(self.module, dict(zip(self.names, params)), tie_weights=True):
            out = self.call(*args, **kwargs)
        flat, spec = pytree.tree_flatten(out)
        if not recompute:
            self.out[0] = (spec, [None if isinstance(v, torch.Tensor) else v for v in flat])
        return (tuple(v for v in flat if isinstance(v, torch.Tensor)),
                tuple(frame.updates.get(k, ws[k]) for k in self.keys))


class _Checkpoint(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(block, *values):
        with torch.no_grad():
            out, new = block.run(values, recompute=False)
        # An entry left as it was is returned as a view: torch.func takes no input returned as is.
        ids = {id(v) for v in values}
        return tuple(t.view_as(t) if isinstance(t, torch.Tensor) and id(t) in ids else t for t in (*out, *new))

    @staticmethod
    def setup_context(ctx, inputs, output):
        block, *values = inputs
        n_out = len(output) - len(block.keys)
        new = output[n_out:]
        # The forward's new entries, with grad histories and random streams as it was given them.
        args, params, given = block.split(values)
        recompute_ws = [g if k in block.as_given else n for k, g, n in zip(block.keys, given, new)]
        ctx.save_for_backward(*args, *params, *recompute_ws)
        if "jvp" in _compat.transform_levels():
            raise DerivativeError(
                "tef.checkpoint: forward-mode derivatives (torch.func.jvp, jacfwd, hessian) of a checkpointed "
                "block were asked for: it recomputes for reverse mode only. Call the block without "
                "tef.checkpoint there; te_func's layers take forward mode")
        if backward_differentiable((*args, *params))[1]:
            raise DerivativeError(
                "tef.checkpoint: a derivative of a checkpointed block's backward was asked for (a second "
                "derivative, a Hessian, MAML's meta-gradient): the recompute cannot give one. Call the block "
                "without tef.checkpoint there; te_func's layers take any order of derivative")
        ctx.block = block
        ctx.mark_non_differentiable(*(t for t in new if isinstance(t, torch.Tensor)))
        ctx.set_materialize_grads(False)
        ctx.out_meta = [(t.shape, t.dtype, t.device) for t in output[:n_out]]

    @staticmethod
    def backward(ctx, *grads):
        block = ctx.block
        values = ctx.saved_tensors
        if not torch.is_grad_enabled():
            # No graph of this backward was asked for: the layers need keep nothing for one.
            values = tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in values)
        need = ctx.needs_input_grad[1:]
        wanted = [i for i, (v, n) in enumerate(zip(values, need)) if n and v is not None]
        n_out = len(ctx.out_meta)
        grads = [torch.zeros(s, dtype=d, device=dev) if g is None else g
                 for g, (s, d, dev) in zip(grads[:n_out], ctx.out_meta)]

        def recomputed(*diff):
            vals = list(values)
            for i, v in zip(wanted, diff):
                vals[i] = v
            out, _ = block.run(tuple(vals), recompute=True)
            return out
        with torch.enable_grad(), first_order_only():
            _, vjp = torch.func.vjp(recomputed, *(values[i] for i in wanted))
            got = vjp(tuple(grads))
        result = [None] * len(values)
        for i, g in zip(wanted, got):
            result[i] = g
        return (None, *result)
