"""The one autograd boundary every te_func op goes through: tensors in and out by name.

An op is a frozen dataclass holding its static configuration (a constant for torch.compile):

    outputs         every tensor `forward` returns, by name
    differentiable  those that receive gradients (an unused one gets None, but the first zeros)
    carried         output name -> input name: state whose new value is known only in backward,
                    where it comes back as that input's gradient; `on_backward` hooks onto it
    saved           the inputs and outputs `backward` reads, by name
    forward(t)                  input name -> tensor, None or a size; returns name -> tensor
    backward(saved, grads, ctx) returns input name -> gradient (names left out get None)

One Function class, called by name: torch.func takes a Function only in the setup_context form;
`torch.compile(torch.func.grad(f))` would differentiate an inlined Function's forward (torch
2.13) unless it is called through `allow_in_graph`; and the names travel as one static string
(a tuple would be a pytree of many leaves to the generated vmap rule, whose forward-mode path
then pairs the inputs' batch dims with one tangent per argument: jacfwd(jacfwd) broke). Under a
torch.func transform, inputs given as None are named in it and not passed (`call`)."""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import torch

from .. import _compat
from ..errors import DerivativeError, TransformError, UnrecordedAmaxError

__all__ = ["call", "call_forward", "GradContext", "on_backward", "higher_order", "first_order_only",
           "backward_differentiable"]


@dataclass(frozen=True)
class GradContext:
    """What backward knows about the forward's inputs, by name."""
    need: dict          # name -> whether its gradient is wanted
    dtype: dict         # name -> its dtype (absent for None inputs)
    # The backward of an outer reverse level (reverse-over-reverse): its cotangents are second-order.
    second_order: bool = False

    def cast(self, name: str, grad: torch.Tensor | None) -> torch.Tensor | None:
        """`grad` in the dtype of input `name`, or None where that gradient is not wanted."""
        return grad.to(self.dtype[name]) if self.need.get(name) and grad is not None else None


class _Boundary(torch.autograd.Function):
    # Every op inside has a batching rule, so vmap can run forward and backward per sample.
    generate_vmap_rule = True

    @staticmethod
    def forward(op, joined, *values):
        names, absent = _split_names(joined)
        # The op's math is exact by design: torch.autocast must not round it to bf16 behind its back.
        with _no_autocast(values):
            out = op.forward({**dict(zip(names, values)), **dict.fromkeys(absent)})
        _mode.nodes = []        # this call's nodes, one per transform level, set up next (`_mark_outer`)
        # Plain loops, not set algebra on dict views: torch 2.11's dynamo cannot trace the latter.
        names_out = op.outputs      # a property built on each read: read once
        unknown = [k for k in out if k not in names_out]
        if unknown:
            raise RuntimeError(f"{type(op).__name__}.forward returned {sorted(unknown)}, not among its outputs")
        if _tangents_possible():
            # Forward mode gives a view its base's tangent; an integer base holds none: copies.
            out = {k: v.clone() if isinstance(v, torch.Tensor) and v._base is not None
                   and not v._base.is_floating_point() else v for k, v in out.items()}
        return tuple(out.get(k) for k in names_out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        op, joined, *values = inputs
        names, ctx.absent = _split_names(joined)
        outputs = dict(zip(op.outputs, output))
        # Carried state stays "differentiable" to keep this node as its grad_fn (on_backward).
        keep = set(op.differentiable) | set(op.carried)
        ctx.mark_non_differentiable(*(t for k, t in outputs.items() if k not in keep and t is not None))
        named = {**dict(zip(names, values)), **outputs}
        # What backward reads, and the linearization's inputs where backward's derivative may be asked for.
        ctx.plain, ctx.higher = backward_differentiable(named.get(k) for k in getattr(op, "primals", ()))
        tangents = _tangents_possible()
        saved = op.saved
        extra = tuple(k for k in _linearization_inputs(op) if k not in saved) if ctx.higher or tangents else ()
        ctx.saved_names = saved + extra
        kept = tuple(named.get(k) for k in ctx.saved_names)
        ctx.save_for_backward(*kept)
        if tangents:
            # The same tensors both ways: torch's generated vmap rule keeps one set of batch dims
            # for what a Function saves, the last call's (torch 2.13), and pairs it with either.
            ctx.save_for_forward(*kept)
            # torch takes no None tangent for a float output it differentiates (2.13): zeros.
            ctx.zero_tangents = {k: (t.shape, t.dtype, t.device) for k, t in outputs.items()
                                 if k in keep and t is not None and t.is_floating_point()}
        # Sizes are inputs, not static config: a new MoE group size is not a new graph.
        ctx.sizes = {k: v for k, v in zip(names, values) if isinstance(v, (int, torch.SymInt))}
        ctx.op, ctx.names = op, names
        _mark_outer(ctx)
        # On ctx, not saved (saved tensors are version-checked): where nothing differentiates a
        # carried input, backward records its new value into the output itself (`_record_carried`).
        # Detached aliases: the outputs themselves would hold this node, a cycle gc cannot free.
        ctx.carried_out = {src: outputs[k].detach() for k, src in op.carried.items() if outputs.get(k) is not None}
        ctx.dtypes = {k: v.dtype for k, v in zip(names, values) if isinstance(v, torch.Tensor)}
        # An unused output's gradient stays None (autograd's zeros are plain tensors, wrong beside
        # DTensor gradients); only the first output's, which every backward starts from, is filled.
        ctx.set_materialize_grads(False)
        first = outputs[op.differentiable[0]]
        ctx.first_meta = (first.shape, first.dtype, first.device)

    @staticmethod
    def backward(ctx, *grads):
        op = ctx.op
        saved = {**ctx.sizes, **dict(zip(ctx.saved_names, ctx.saved_tensors))}
        # The inputs given as None were not passed: no gradient is wanted of them.
        need = {**dict.fromkeys(ctx.absent, False), **dict(zip(ctx.names, ctx.needs_input_grad[2:]))}
        out_grads = {k: g for k, g in zip(op.outputs, grads) if k in op.differentiable}
        first = op.differentiable[0]
        if out_grads[first] is None:
            shape, dtype, device = ctx.first_meta
            out_grads[first] = torch.zeros(shape, dtype=dtype, device=device)
        if torch.is_grad_enabled() and ctx.plain and not ctx.higher:
            _refuse_create_graph(op)
        differentiated = torch.is_grad_enabled() and ctx.higher
        # The FP8 backward on detached tensors: a graph of it would keep every temporary alive.
        # Its derivatives, where a transform outside can ask for them, come from the linearization.
        with torch.no_grad(), _no_autocast(grads):
            input_grads = op.backward(_detached(saved), _detached(out_grads),
                                      GradContext(need, ctx.dtypes, ctx.second_order))
        unknown = [k for k in input_grads if k not in need]
        if unknown:
            raise RuntimeError(f"{type(op).__name__}.backward returned gradients of {sorted(unknown)}, "
                               f"which are not among its inputs")
        if differentiated:
            input_grads = _linearized_grads(op, saved, out_grads, input_grads, need)
        input_grads = _record_carried(ctx, input_grads, need)
        return (None, None, *(input_grads.get(k) if need[k] else None for k in ctx.names))

    @staticmethod
    def jvp(ctx, _op, _names, *tangents):
        # Forward mode: the linearization's tangents at the forward's operands; state gets none.
        op = ctx.op
        _require_linearization(op)
        saved = dict(zip(ctx.saved_names, ctx.saved_tensors))
        primals = {k: saved.get(k) for k in op.linearization_inputs}
        given = {k: t for k, t in zip(ctx.names, tangents) if k in op.primals and t is not None
                 and primals.get(k) is not None}
        out_tangents = {}
        if given:
            fixed = {k: v for k, v in primals.items() if k not in given}
            names = tuple(given)
            try:
                _, out_tangents = torch.func.jvp(
                    lambda *d: op.linearized({**fixed, **dict(zip(names, d)), **ctx.sizes}),
                    tuple(primals[k] for k in names), tuple(given.values()))
            except RuntimeError as e:
                # Under plain autograd's dual_level torch refuses the jvp's own level
                if "Nested forward mode AD is not supported" not in str(e):
                    raise
                raise DerivativeError(
                    f"{type(op).__name__}: plain autograd's forward mode (torch.autograd.forward_ad.dual_level) "
                    f"is not supported through te_func's FP8 layers; take forward-mode derivatives with "
                    f"torch.func.jvp, jacfwd or hessian, which are (docs/functional.md)") from e
        zeros = {k: torch.zeros(shape, dtype=dtype, device=device)
                 for k, (shape, dtype, device) in ctx.zero_tangents.items() if k not in out_tangents}
        return tuple({**zeros, **out_tangents}.get(k) for k in op.outputs)


def _detached(tensors: dict) -> dict:
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


# --- derivatives beyond the first-order backward ------------------------------------------------
# As TE defines the first-order backward: each GEMM is linear in its FP8 operands, and a cast
# passes derivatives straight through. `op.linearized(t)` is that function in high precision (each
# GEMM on its dequantized operands). te_func returns the FP8 backward's value with the vjp's
# derivatives (`value + (v - v.detach())`): first order stays bit-identical, higher orders and
# forward mode are exact derivatives of the linearization (docs/functional.md).

_mode = threading.local()      # .higher: inside higher_order(); .first_order: inside first_order_only()


@contextlib.contextmanager
def _setting(name: str):
    previous = getattr(_mode, name, False)
    setattr(_mode, name, True)
    try:
        yield
    finally:
        setattr(_mode, name, previous)


def higher_order():
    """Forward calls inside keep what plain autograd's `create_graph=True` needs."""
    return _setting("higher")


def first_order_only():
    """For te_func's own recomputes, which nothing differentiates: the layers keep nothing for it."""
    return _setting("first_order")


def backward_differentiable(primals) -> tuple[bool, bool]:
    """For a Function node set up over `primals`: (whether it is plain autograd's; whether something
    outside its backward's level can differentiate that backward: a torch.func grad or jvp level
    around it, plain autograd below it (MAML), or `higher_order()`)."""
    levels = _compat.transform_levels()
    while levels and levels[-1] == "vmap":
        levels.pop()
    if getattr(_mode, "first_order", False):
        return not levels, False
    if not levels:          # plain autograd: create_graph is known only in backward
        return True, getattr(_mode, "higher", False)
    levels.pop()            # the level this node belongs to
    if getattr(_mode, "higher", False) or "grad" in levels or "jvp" in levels:
        return False, True
    return False, any(isinstance(v, torch.Tensor) and _compat.base_tensor(v).requires_grad for v in primals)


def _tangents_possible() -> bool:
    return "jvp" in _compat.transform_levels() or _compat.forward_ad_active()


def _refuse_create_graph(op):
    """create_graph=True for a forward that kept too little: refused, not differentiated as zero."""
    raise TransformError(
        f"te_func: a derivative of {type(op).__name__}'s backward was asked for (autograd.grad(..., "
        f"create_graph=True) or backward(create_graph=True)), but its forward ran outside "
        f"tef.higher_order() and kept only the FP8 casts its first-order backward reads. Run the forward "
        f"inside `with tef.higher_order():`, or take the derivatives with torch.func (tef.grad, "
        f"torch.func.grad, jacrev, hessian), which te_func sees and keeps what they need for")


def _linearization_inputs(op) -> tuple:
    return getattr(op, "linearization_inputs", ())


def _require_linearization(op):
    # An op without a linearization (FSDP's gathers) gives first derivatives only.
    if not hasattr(op, "linearized"):
        raise DerivativeError(f"te_func: {type(op).__name__} gives first derivatives only; a derivative of "
                              f"its backward or a forward-mode tangent was asked for")


def _linearized_grads(op, saved: dict, out_grads: dict, input_grads: dict, need: dict) -> dict:
    """`input_grads` given the derivatives of the linearization's vjp."""
    _require_linearization(op)
    missing = [k for k in op.linearization_inputs if k not in saved]
    if missing:
        raise RuntimeError(f"te_func: {type(op).__name__} kept no {missing} for a derivative of its backward")
    wanted = tuple(k for k in op.primals if need.get(k) and saved.get(k) is not None
                   and input_grads.get(k) is not None)
    if not wanted:
        return input_grads
    fixed = {k: saved[k] for k in op.linearization_inputs if k not in wanted}
    sizes = {k: v for k, v in saved.items() if isinstance(v, (int, torch.SymInt))}
    outputs, vjp = torch.func.vjp(lambda *d: op.linearized({**fixed, **sizes, **dict(zip(wanted, d))}),
                                  *(saved[k] for k in wanted))[:2]     # (outputs, vjp function)
    linear = vjp({k: torch.zeros_like(v) if out_grads.get(k) is None else out_grads[k].to(v.dtype)
                  for k, v in outputs.items()})
    return {**input_grads, **{k: input_grads[k] + (g - g.detach()).to(input_grads[k].dtype)
                              for k, g in zip(wanted, linear)}}


def _mark_outer(ctx) -> None:
    """One forward sets up a node per transform level, outermost first. A node under fewer grad
    levels than a later one of the same forward is an outer reverse level's: its backward's
    cotangents are derivatives of the inner backward (a gradient penalty, MAML's outer step)."""
    ctx.grad_depth = _compat.transform_levels().count("grad")
    ctx.second_order = False
    nodes = getattr(_mode, "nodes", None)
    if nodes is None:
        return
    for ref in nodes:
        earlier = ref()
        if earlier is not None and earlier.grad_depth < ctx.grad_depth:
            earlier.second_order = True
    nodes.append(weakref.ref(ctx))      # weak: the last call's nodes would outlive its graph


def _record_carried(ctx, input_grads: dict, need: dict) -> dict:
    """Where nothing differentiates a carried input (plain .backward() or torch.func.grad through
    tef.functional_call), its new value is merged, by max, into the output the call returned as
    that state (so into the new workspaces). A compiled backward cannot write there: it refuses,
    from inside its graph, if it runs (AOT autograd traces backwards that never run)."""
    lost = [(k, out) for k, out in ctx.carried_out.items() if not need.get(k) and input_grads.get(k) is not None]
    if not lost:
        return input_grads
    if torch.compiler.is_compiling():
        first = next((k for k in ctx.names if need[k] and input_grads.get(k) is not None), None)
        if first is not None:
            input_grads = {**input_grads, first: refuse_unrecorded(input_grads[first], type(ctx.op).__name__)}
        return input_grads
    for k, out in lost:
        try:
            if _compat.is_batched_anywhere(out):    # per-member state (a vmapped ensemble's): per member
                out.copy_(torch.maximum(out, _compat.max_to_level(input_grads[k], _compat.tensor_level(out))))
                continue
            # One state for a vmapped batch of backwards (jacrev, hessian, MAML's tasks): their max.
            new, base = _compat.max_to_level(input_grads[k], -1), _compat.base_tensor(out)
            with _compat.functorch_disabled():     # plain tensors: the transforms above see nothing
                base.copy_(torch.maximum(base, new))
        except RuntimeError as e:       # batched otherwise than its state
            raise UnrecordedAmaxError(_UNRECORDED.format(op=type(ctx.op).__name__) + f" (here: {e})",
                                      op=type(ctx.op).__name__) from None
    return input_grads


_UNRECORDED = ("te_func: {op}'s backward under DelayedScaling computed its output gradient's amax, and nothing "
               "here can record it, so later gradients would be quantized with a stale scale. Differentiate with "
               "tef.grad / tef.value_and_grad (the amaxes come back in new_ws) or through tef.Stateful; "
               "docs/delayed.md")


@torch.library.custom_op("te_func::refuse_unrecorded", mutates_args=())
def refuse_unrecorded(t: torch.Tensor, op: str) -> torch.Tensor:
    """Raises UnrecordedAmaxError: a compiled backward whose carried state nothing records ran."""
    raise UnrecordedAmaxError(_UNRECORDED.format(op=op), op=op)


@refuse_unrecorded.register_fake
def _(t, op):
    return torch.empty_like(t)


@refuse_unrecorded.register_vmap
def _(info, in_dims, t, op):
    # Under a vmap (an ensemble's tef.grad) AOT autograd traces it too: it refuses for the batch.
    return refuse_unrecorded(t, op), in_dims[0]


def _no_autocast(values):
    device = next((v.device.type for v in values if isinstance(v, torch.Tensor)), "cpu")
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


@_compat.allow_in_graph
def _apply(op, joined, *values):
    return _Boundary.apply(op, joined, *values)


def call(op, **tensors) -> dict:
    """Run `op` on `tensors` (name -> tensor or None); returns its outputs by name."""
    if _compat.forward_over_forward():
        return _composite(op, tensors)
    if torch.compiler.is_compiling() or _compat.current_level() is None:
        return dict(zip(op.outputs, _apply(op, " ".join(tensors) + "|", *tensors.values())))
    # Under a torch.func transform the None ones travel by name alone: every value passed is
    # wrapped and unwrapped by each level (a pytree pass each).
    given = {k: v for k, v in tensors.items() if v is not None}
    joined = " ".join(given) + "|" + " ".join(k for k, v in tensors.items() if v is None)
    return dict(zip(op.outputs, _apply(op, joined, *given.values())))


def _split_names(joined: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    # `call`'s "given names|names given as None", each space-separated.
    given, _, absent = joined.partition("|")
    return tuple(given.split(" ")) if given else (), tuple(absent.split(" ")) if absent else ()


def _composite(op, tensors: dict) -> dict:
    """`op` without the Function, for forward over forward (torch differentiates a Function's jvp
    rule wrongly there, `_compat.forward_over_forward`): the FP8 forward's values, with the
    linearization's derivatives (`value + (v - v.detach())`), differentiated by torch itself."""
    _require_linearization(op)
    with _no_autocast(tensors.values()):
        out = op.forward(_detached(tensors))
        lin = op.linearized({**tensors, **out})
    return {k: out.get(k) if k not in lin or out.get(k) is None
            else out[k] + (lin[k] - lin[k].detach()).to(out[k].dtype) for k in op.outputs}


def call_forward(op, **tensors) -> dict:
    """`op`'s forward alone, for inference: no autograd node (torch.export sees plain aten ops)."""
    with _no_autocast(tensors.values()):
        out = op.forward(tensors)
    return {k: out.get(k) for k in op.outputs}


def on_backward(t: torch.Tensor, fn) -> bool:
    """Where `t` is carried state of a te_func op, call fn(new value) when its backward runs, whatever
    it was asked for (a post-hook sees gradients autograd then drops). Returns whether it is."""
    node = t.grad_fn
    op = getattr(node, "op", None)
    if node is None or op is None or not isinstance(getattr(node, "names", None), tuple):
        return False
    source = op.carried.get(op.outputs[t.output_nr])
    if source is None:
        return False
    # The node's gradients are those of the tensor inputs, in order: `dtypes` lists exactly those.
    tensor_inputs = list(node.dtypes)      # type: ignore[attr-defined]  # a te_func op's node has them
    if source not in tensor_inputs:
        return False
    index = tensor_inputs.index(source)

    def hook(grad_inputs, grad_outputs):
        if grad_inputs[index] is not None:
            fn(grad_inputs[index])
    node.register_hook(hook)
    return True
