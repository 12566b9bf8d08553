"""The one autograd boundary every te_func op goes through: tensors in and out by name.

An op is a frozen dataclass holding its static configuration (a constant for
torch.compile) and its math:

    outputs         every tensor `forward` returns, by name
    differentiable  those of them that receive gradients (an unused one gets None, but for
                    the first, which gets zeros); the others (new
                    state, what backward reads) are non-differentiable
    carried         output name -> input name: state whose new value is known only
                    in backward, where it comes back as that input's gradient
                    ("overwrite with gradient"); `on_backward` hooks onto it
    saved           the inputs and outputs `backward` reads, by name
    forward(t)                  t: input name -> tensor, None or a size (an int, symbolic under
                                torch.compile); returns output name -> tensor or None
    backward(saved, grads, ctx) saved: the `saved` tensors and every size input, by name;
                                returns input name -> gradient (names left out get None)

`call(op, **tensors)` runs it and returns its outputs by name. Why one
Function class for all ops, called like this:
- torch.func.grad and vmap accept a custom Function only in the
  `forward` + `setup_context` form (with a vmap rule);
- `torch.compile(torch.func.grad(f))` inlines a Function and silently
  differentiates its forward instead of calling its backward (torch 2.13), unless the
  Function is called through `torch._dynamo.allow_in_graph`, which keeps it opaque;
- a Function takes tensors positionally; the names travel beside them as a
  static tuple, so no op needs index constants.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["call", "call_forward", "GradContext", "on_backward"]


@dataclass(frozen=True)
class GradContext:
    """What backward knows about the forward's inputs, by name."""
    need: dict          # name -> whether its gradient is wanted
    dtype: dict         # name -> its dtype (absent for None inputs)

    def cast(self, name: str, grad: torch.Tensor | None) -> torch.Tensor | None:
        """`grad` in the dtype of input `name`, or None where that gradient is not wanted."""
        return grad.to(self.dtype[name]) if self.need.get(name) and grad is not None else None


class _Boundary(torch.autograd.Function):
    # Every op inside has a batching rule, so vmap can run forward and backward per sample.
    generate_vmap_rule = True

    @staticmethod
    def forward(op, names, *values):
        # The op's math is exact by design (an emulated FP8 GEMM accumulates in fp32):
        # torch.autocast around a layer must not round it to bf16 behind its back.
        with _no_autocast(values):
            out = op.forward(dict(zip(names, values)))
        # Plain loops, not set algebra on dict views: torch 2.11's dynamo cannot trace the latter.
        unknown = [k for k in out if k not in op.outputs]
        if unknown:
            raise RuntimeError(f"{type(op).__name__}.forward returned {sorted(unknown)}, not among its outputs")
        return tuple(out.get(k) for k in op.outputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        op, names, *values = inputs
        outputs = dict(zip(op.outputs, output))
        # Carried state stays "differentiable" so that it keeps this node as its grad_fn
        # (see on_backward); nothing differentiates it, so its gradient is only ever zero.
        keep = set(op.differentiable) | set(op.carried)
        ctx.mark_non_differentiable(*(t for k, t in outputs.items() if k not in keep and t is not None))
        named = {**dict(zip(names, values)), **outputs}
        ctx.save_for_backward(*(named.get(k) for k in op.saved))
        # Sizes are inputs, not part of the op's static config, so that a new size (an MoE
        # group's token count) is a new value for torch.compile, not a new graph.
        ctx.sizes = {k: v for k, v in zip(names, values) if isinstance(v, (int, torch.SymInt))}
        ctx.op, ctx.names = op, names
        ctx.dtypes = {k: v.dtype for k, v in zip(names, values) if isinstance(v, torch.Tensor)}
        # An output nobody used gets None, not zeros that autograd would make as a plain
        # tensor (wrong beside DTensor gradients under tensor parallelism); only the first
        # output's gradient, which every op's backward starts from, is filled in.
        ctx.set_materialize_grads(False)
        first = outputs[op.differentiable[0]]
        ctx.first_meta = (first.shape, first.dtype, first.device)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        # once_differentiable: the backward runs without recording a graph (torch.func.grad
        # always asks for one; it would keep every temporary of the backward alive, as
        # much again as the layer's activations), and a second derivative through it is
        # refused with torch's error instead of differentiating casts and GEMMs that have
        # none. TE's backward is not differentiable either.
        op = ctx.op
        saved = {**ctx.sizes, **dict(zip(op.saved, ctx.saved_tensors))}
        need = dict(zip(ctx.names, ctx.needs_input_grad[2:]))
        out_grads = {k: g for k, g in zip(op.outputs, grads) if k in op.differentiable}
        first = op.differentiable[0]
        if out_grads[first] is None:
            shape, dtype, device = ctx.first_meta
            out_grads[first] = torch.zeros(shape, dtype=dtype, device=device)
        with _no_autocast(grads):
            input_grads = op.backward(saved, out_grads, GradContext(need, ctx.dtypes))
        unknown = [k for k in input_grads if k not in need]
        if unknown:
            raise RuntimeError(f"{type(op).__name__}.backward returned gradients of {sorted(unknown)}, "
                               f"which are not among its inputs")
        return (None, None, *(input_grads.get(k) if need[k] else None for k in ctx.names))


def _no_autocast(values):
    device = next((v.device.type for v in values if isinstance(v, torch.Tensor)), "cpu")
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


@torch._dynamo.allow_in_graph
def _apply(op, names, *values):
    return _Boundary.apply(op, names, *values)


def call(op, **tensors) -> dict:
    """Run `op` on `tensors` (name -> tensor or None); returns its outputs by name."""
    return dict(zip(op.outputs, _apply(op, tuple(tensors), *tensors.values())))


def call_forward(op, **tensors) -> dict:
    """`op`'s forward alone, for inference (te_func.freeze): the math `call` runs, under the
    same autocast rule, with no autograd node, so nothing is kept for a backward and
    torch.export sees plain aten ops. Returns its outputs by name."""
    with _no_autocast(tensors.values()):
        out = op.forward(tensors)
    return {k: out.get(k) for k in op.outputs}


def on_backward(t: torch.Tensor, fn) -> bool:
    """When `t` is carried state of a te_func op (op.carried), call fn(new value) when that op's
    backward runs, whichever inputs the backward was asked for (a post-hook on the op's node sees
    every gradient it computes, also those autograd then drops). Returns whether `t` is such state.
    """
    node = t.grad_fn
    op = getattr(node, "op", None)
    if op is None or not isinstance(getattr(node, "names", None), tuple):
        return False
    source = op.carried.get(op.outputs[t.output_nr])
    if source is None:
        return False
    # The node's gradients are those of forward's tensor inputs only, in order (autograd drops
    # the non-tensor ones: op, names, and inputs given as None); dtypes lists exactly those.
    tensor_inputs = list(node.dtypes)
    if source not in tensor_inputs:
        return False
    index = tensor_inputs.index(source)

    def hook(grad_inputs, grad_outputs):
        if grad_inputs[index] is not None:
            fn(grad_inputs[index])
    node.register_hook(hook)
    return True
