"""`tef.convert`: swap a model's torch layers for te_func's, in place, keeping every tensor.

As torchao's `convert_to_float8_training`: nn.Linear, transformers' Conv1D (as TransposedLinear),
nn.LayerNorm, nn.RMSNorm and transformers' experts (3-D `gate_up_proj`/`down_proj`, as Experts)
become te_func's, holding the very Parameter objects of the old layer (values, dtype, device,
requires_grad and tied weights kept); with recipe None the model computes what it did, bit for
bit. What te_func cannot run in FP8 (GEMM dims not multiples of 16, other dtypes, nn.Linear
subclasses, other 3-D weights) is left as it is and reported through the `te_func.convert` logger."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .nn import Experts, LayerNorm, Linear, RMSNorm, TEModule, TransposedLinear

__all__ = ["convert", "gemm_size", "fp8_pays"]

log = logging.getLogger("te_func.convert")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:       # transformers is optional
        return None
    return Conv1D


def _why_not_linear(in_f: int, out_f: int, weight: torch.Tensor) -> str | None:
    if in_f % 16 or out_f % 16:
        return (f"in_features={in_f}, out_features={out_f}: FP8 GEMMs need both to be multiples of 16 "
                f"(TE refuses such layers too)")
    if weight.dtype not in _DTYPES:
        return f"weight dtype {weight.dtype}: te_func's FP8 layers take float32, bfloat16 and float16"
    return None


def _linear(old: Any, transposed: bool) -> tuple[nn.Module | None, str | None]:
    # old: an nn.Linear, or a transformers Conv1D (transposed), read by its attributes
    weight = old.weight
    in_f, out_f = (weight.shape if transposed else weight.shape[::-1])
    why = _why_not_linear(in_f, out_f, weight)
    if why:
        return None, why
    cls = TransposedLinear if transposed else Linear
    # Built on meta (no memory, no init), then given the old layer's own Parameters.
    new = cls(in_f, out_f, bias=old.bias is not None, params_dtype=weight.dtype, device="meta")
    new.weight, new.bias = old.weight, old.bias
    return new, None


def _norm(old: nn.LayerNorm | nn.RMSNorm) -> tuple[nn.Module | None, str | None]:
    shape = tuple(old.normalized_shape)
    if len(shape) != 1:
        return None, f"normalized_shape={shape}: te_func's norms normalize over the last dim only"
    if getattr(old, "weight", None) is None:
        return None, "elementwise_affine=False: te_func's norms always scale by a weight"
    if old.weight.dtype not in _DTYPES:
        return None, f"weight dtype {old.weight.dtype}: te_func's norms take float32, bfloat16 and float16"
    new: LayerNorm | RMSNorm
    if isinstance(old, nn.LayerNorm):
        new = LayerNorm(shape[0], eps=old.eps, params_dtype=old.weight.dtype, device="meta")
        new.weight, new.bias = old.weight, old.bias
    else:
        # eps=None is the input dtype's epsilon in torch; te_func needs a number: the weight dtype's.
        eps = torch.finfo(old.weight.dtype).eps if old.eps is None else old.eps
        new = RMSNorm(shape[0], eps=eps, params_dtype=old.weight.dtype, device="meta")
        new.weight = old.weight
    return new, None


def _is_hf_experts(module: nn.Module) -> bool:
    # What transformers' use_experts_implementation gives an experts class: these attributes, and
    # the experts interface's forward(hidden_states, top_k_index, top_k_weights).
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated", "_is_expert_parallel")) \
        and isinstance(getattr(module, "down_proj", None), nn.Parameter)


def _default_gate():
    try:
        from transformers.integrations.moe import _default_apply_gate
    except Exception:       # transformers is optional; older ones had no such hook
        return None
    return _default_apply_gate


def _experts(old: Any) -> tuple[nn.Module | None, str | None]:
    # old: a transformers experts module, read by its attributes (use_experts_implementation's)
    up_name = "gate_up_proj" if old.has_gate else "up_proj"
    up, down = getattr(old, up_name, None), old.down_proj
    if not isinstance(up, nn.Parameter) or up.dim() != 3 or down.dim() != 3:
        return None, f"no 3-D {up_name} and down_proj parameters: not the experts layout te_func converts"
    if old._is_expert_parallel:
        return None, "expert-parallel experts (sharded by transformers' expert-parallel plan) are not converted"
    if getattr(old, "has_post_expert_norm", False):
        return None, "experts with a norm after each expert are not converted"
    num_experts = up.shape[0]
    up_out, hidden = (up.shape[2], up.shape[1]) if old.is_transposed else (up.shape[1], up.shape[2])
    hidden_down, inter = (down.shape[2], down.shape[1]) if old.is_transposed else (down.shape[1], down.shape[2])
    if hidden_down != hidden or up_out != (2 * inter if old.has_gate else inter) or down.shape[0] != num_experts:
        return None, f"{up_name} {tuple(up.shape)} and down_proj {tuple(down.shape)} do not make one expert MLP"
    why = _why_not_linear(hidden, up_out, up) or _why_not_linear(inter, hidden, down)
    if why:
        return None, why
    custom_gate = getattr(type(old), "_apply_gate", None)
    custom_gate = None if custom_gate is _default_gate() else custom_gate
    act_fn = getattr(old, "act_fn", None)
    if custom_gate is None and not isinstance(act_fn, nn.Module):
        return None, "experts without an act_fn module or a gate of their own are not converted"
    new = Experts(num_experts, hidden, inter, act_fn=act_fn, has_gate=old.has_gate, has_bias=bool(old.has_bias),
                  is_transposed=old.is_transposed, params_dtype=up.dtype, device="meta")
    for name in (up_name, "down_proj"):
        setattr(new, name, getattr(old, name))
        setattr(new, f"{name}_bias", getattr(old, f"{name}_bias", None) if old.has_bias else None)
    # The old module's options (config, its gate's constants), which its forward and gate read.
    for k, v in vars(old).items():
        if not k.startswith("_") and k != "training" and k not in vars(new):
            setattr(new, k, v)
    new.is_concatenated = old.is_concatenated
    new._original_forward, new._custom_gate = type(old).forward, custom_gate
    return new, None


ROUTER = ("a mixture of experts' router: routing stays in high precision, as TE's and transformers' FP8 "
          "recipes keep it (tef.convert(router) converts one on its own)")


def _is_router(model: nn.Module, fqn: str) -> bool:
    # A Linear named gate or router beside the experts it routes to (e.g. Qwen2-MoE's `mlp.gate`);
    # transformers' top-k router classes hold their weight themselves and are no Linear to convert.
    parent, _, name = fqn.rpartition(".")
    return name in ("gate", "router") and hasattr(model.get_submodule(parent), "experts")


def _batched_weights(module: nn.Module) -> str | None:
    """Why a module with weights of 3-D or more, which it multiplies itself, stays; None if it has none."""
    held = [f"{name} {tuple(p.shape)}" for name, p in module.named_parameters(recurse=False) if p.dim() >= 3]
    if not held:
        return None
    return (f"{', '.join(held)}: weights of 3-D or more (batched experts, convolutions) are no Linear layer's; "
            f"te_func converts nn.Linear, transformers' Conv1D and its experts, so these GEMMs run in high "
            f"precision")


def _replacement(module: nn.Module, conv1d) -> tuple[nn.Module | None, str | None] | None:
    """(new layer or None, why not) for a module that holds GEMM weights; None for any other."""
    if isinstance(module, TEModule):
        return None
    if type(module) is nn.Linear:
        return _linear(module, transposed=False)
    if isinstance(module, nn.Linear):       # e.g. MultiheadAttention's out_proj, read by its parent directly
        return None, f"a subclass of torch.nn.Linear ({type(module).__name__}) may rely on behaviour of its own"
    if conv1d is not None and isinstance(module, conv1d):
        return _linear(module, transposed=True)
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return _norm(module)
    if _is_hf_experts(module):
        return _experts(module)
    why = _batched_weights(module)
    return None if why is None else (None, why)


def convert(model: nn.Module, *, module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Swap, in place, the convertible layers of `model` for te_func's; returns the model. A root
    that is itself convertible (a bare nn.Linear) comes back as its te_func layer, as torchao's swap
    does: use the return value. module_filter_fn(module, fqn) -> bool, as torchao's, picks layers
    (fqn "" for the root). What stays in high precision is summarized in one WARNING on the
    `te_func.convert` logger, grouped by reason; each layer is logged at INFO."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tef.convert: model must be a torch.nn.Module, got {type(model).__name__}")
    conv1d = _conv1d_type()
    converted: list[str] = []
    left: dict[str, list[str]] = {}        # why -> the layers left for it
    root = model
    for fqn, module in list(model.named_modules()):
        found = _replacement(module, conv1d)
        if found is None:
            continue
        if found[0] is not None and _is_router(model, fqn):
            found = None, ROUTER
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            continue
        new, why = found
        if new is None:
            why = why or "no reason given"
            left.setdefault(_reason(why), []).append(fqn or "(root)")
            log.info("tef.convert: %s (%s) stays as it is: %s", fqn or "(root)", type(module).__name__, why)
            continue
        new.train(module.training)
        if not fqn:
            root = new
        else:
            parent_name, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
        converted.append(fqn or "(root)")
    if left:
        groups = "; ".join(f"{len(fqns)} for {why}: {_some(fqns)}" for why, fqns in left.items())
        log.warning("tef.convert: %d layer(s) converted, %d left in high precision (%s)", len(converted),
                    sum(map(len, left.values())), groups)
    else:
        log.info("tef.convert: %d layer(s) converted", len(converted))
    return root


def _reason(why: str) -> str:
    # The reason without the layer's own sizes, so that layers left for one reason group together.
    return why.split(": ", 1)[1] if ": " in why else why


def _some(fqns: list[str], shown: int = 4) -> str:
    return ", ".join(fqns[:shown]) + (f" and {len(fqns) - shown} more" if len(fqns) > shown else "")


def gemm_size(tokens: int, in_features: int, out_features: int) -> float:
    """1 / (1/tokens + 1/in + 1/out): the arithmetic intensity of a layer's three GEMMs, up to a constant."""
    return 1.0 / (1.0 / tokens + 1.0 / in_features + 1.0 / out_features) if tokens and in_features and \
        out_features else 0.0


def fp8_pays(tokens: int, min_gemm_size: float = 2048.0) -> Callable[[nn.Module, str], bool]:
    """A module_filter_fn converting the Linear layers with gemm_size(tokens, in, out) >= min_gemm_size,
    where FP8 pays on its own (docs/benchmarks.md; a whole model may gain more: measure it)."""
    conv1d = _conv1d_type()

    def keep(module: nn.Module, fqn: str) -> bool:
        if isinstance(module, nn.Linear):
            return gemm_size(tokens, module.in_features, module.out_features) >= min_gemm_size
        if conv1d is not None and isinstance(module, conv1d):
            in_f, out_f = module.weight.shape
            return gemm_size(tokens, in_f, out_f) >= min_gemm_size
        return True
    return keep
