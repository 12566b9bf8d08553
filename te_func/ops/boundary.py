"""The one autograd boundary every te_func op goes through: tensors in and out by name.

An op is a frozen dataclass holding its static configuration (a constant for
torch.compile) and its math:

    outputs         every tensor `forward` returns, by name
    differentiable  those of them that receive gradients (an unused one gets None, but for
                    the first, which gets zeros); the others (new
                    state, what backward reads) are non-differentiable
    saved           the inputs and outputs `backward` reads, by name
    forward(t)                  t: input name -> tensor or None; returns output name -> tensor or None
    backward(saved, grads, ctx) returns input name -> gradient (names left out get None)

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

from dataclasses import dataclass

import torch

__all__ = ["call", "GradContext"]


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
        out = op.forward(dict(zip(names, values)))
        unknown = out.keys() - set(op.outputs)
        if unknown:
            raise RuntimeError(f"{type(op).__name__}.forward returned {sorted(unknown)}, not among its outputs")
        return tuple(out.get(k) for k in op.outputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        op, names, *values = inputs
        outputs = dict(zip(op.outputs, output))
        ctx.mark_non_differentiable(*(t for k, t in outputs.items() if k not in op.differentiable and t is not None))
        named = {**dict(zip(names, values)), **outputs}
        ctx.save_for_backward(*(named.get(k) for k in op.saved))
        ctx.op, ctx.names = op, names
        ctx.dtypes = {k: v.dtype for k, v in zip(names, values) if isinstance(v, torch.Tensor)}
        # An output nobody used gets None, not zeros that autograd would make as a plain
        # tensor (wrong beside DTensor gradients under tensor parallelism); only the first
        # output's gradient, which every op's backward starts from, is filled in.
        ctx.set_materialize_grads(False)
        first = outputs[op.differentiable[0]]
        ctx.first_meta = (first.shape, first.dtype, first.device)

    @staticmethod
    def backward(ctx, *grads):
        op = ctx.op
        saved = dict(zip(op.saved, ctx.saved_tensors))
        need = dict(zip(ctx.names, ctx.needs_input_grad[2:]))
        out_grads = {k: g for k, g in zip(op.outputs, grads) if k in op.differentiable}
        first = op.differentiable[0]
        if out_grads[first] is None:
            shape, dtype, device = ctx.first_meta
            out_grads[first] = torch.zeros(shape, dtype=dtype, device=device)
        input_grads = op.backward(saved, out_grads, GradContext(need, ctx.dtypes))
        unknown = input_grads.keys() - need.keys()
        if unknown:
            raise RuntimeError(f"{type(op).__name__}.backward returned gradients of {sorted(unknown)}, "
                               f"which are not among its inputs")
        return (None, None, *(input_grads.get(k) if need[k] else None for k in ctx.names))


@torch._dynamo.allow_in_graph
def _apply(op, names, *values):
    return _Boundary.apply(op, names, *values)


def call(op, **tensors) -> dict:
    """Run `op` on `tensors` (name -> tensor or None); returns its outputs by name."""
    return dict(zip(op.outputs, _apply(op, tuple(tensors), *tensors.values())))
