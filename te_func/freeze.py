"""`tef.freeze`: a te_func model for inference, holding its GEMM weights in FP8 only.

The copy (of the same class: a HuggingFace model keeps `generate`) has each te_func GEMM layer in
its frozen form (te_func.nn.frozen). It is made without the GEMM weights, casting layer by layer
where the weights are, so only FP8 bytes reach `device`; on `meta` it is a skeleton to load a
frozen checkpoint into. The casts are those in `workspaces` when given (so the frozen model
computes what `is_first_microbatch=False` computes, bit for bit), else of the current weights."""
from __future__ import annotations

import copy

import torch
from torch import nn

from .errors import RecipeMismatchError
from .frame import _check_recipe, validate_workspaces
from .functional._gemm import GemmStep
from .nn import TEModule
from .nn.frozen import FROZEN_LAYERS, FrozenLayer
from .quant import DelayedState, Quantized, lower
from .recipe import Recipe, describe
from .shell import Stateful

__all__ = ["freeze", "frozen_layers"]


def _gemm_layers(model: nn.Module) -> list[tuple[str, TEModule]]:
    return [(path, m) for path, m in model.named_modules() if isinstance(m, TEModule) and m.gemms()]


def _gemm_only_weights(model: nn.Module, layers) -> list[nn.Parameter]:
    """The GEMM weights that nothing else holds (a weight tied to an embedding stays)."""
    params = [m.get_parameter(name) for _, m in layers for name in _gemm_params(m)]
    gemm = {id(p) for p in params}
    elsewhere = {id(p) for m in model.modules() if not (isinstance(m, TEModule) and m.gemms())
                 for p in m._parameters.values() if p is not None}
    elsewhere |= {id(p) for _, m in layers for name, p in m._parameters.items()
                  if p is not None and name not in _gemm_params(m)}
    return [p for p in params if id(p) in gemm - elsewhere]


def _gemm_params(m: TEModule) -> tuple[str, ...]:
    # The parameters holding a layer's GEMM weights, each once (experts' hold one per expert).
    return tuple(dict.fromkeys(m.gemm_param(g.weight) for g in m.gemms()))


def _check_finite(path: str, name: str, weight: torch.Tensor):
    if weight.device.type == "meta":
        return
    bad = (~torch.isfinite(weight)).sum().item()
    if bad:
        where = f"{path}.{name}" if path else name
        raise ValueError(f"tef.freeze: {where} holds {bad} non-finite value(s) (NaN or inf) out of "
                         f"{weight.numel()}; its FP8 cast would saturate or propagate them into every "
                         f"output. Find where they come from before freezing")


def _own(t: torch.Tensor, device) -> torch.Tensor:
    # A tensor of its own: loading into the frozen model must not write the trained model's workspaces.
    return t.to(device if device is not None else t.device, copy=True)


def _frozen(path: str, source: TEModule, skeleton: nn.Module, recipe, ws: dict | None, device,
            weight_only_tokens: int) -> FrozenLayer:
    """The frozen form of `source`, its non-GEMM parameters taken from `skeleton` (its copy)."""
    prefix = f"{path}." if path else ""
    casts, scales, meta, lowering = {}, {}, {}, lower(recipe)
    for g in source.gemms():
        weight = source.gemm_weight(g.weight)
        _check_finite(path, g.weight, weight)
        # The cast and scale exactly as the cached-weight forward reads them: its own code path.
        local = {k[len(prefix):]: v for k, v in ws.items() if k.startswith(prefix)} if ws is not None \
            else lowering.write(g, lowering.init(g, weight))
        step = GemmStep.begin(g, weight, recipe, local, False, update_state=False)
        cast = step.cast.rowwise
        amax = None if cast.global_amax is None else _own(cast.global_amax, device)
        casts[g.weight] = Quantized(_own(cast.data, device), _own(cast.scale_inv, device), cast.block, amax,
                                    cast.columns)
        if isinstance(step.state.input, DelayedState):
            scales[g.weight] = _own(step.state.input.scale, device)
        param = source.get_parameter(source.gemm_param(g.weight))   # as the model holds it (Conv1D's: (in, out))
        meta[source.gemm_param(g.weight)] = (tuple(param.shape), param.dtype)
    assert isinstance(skeleton, TEModule)       # the source's copy
    return FROZEN_LAYERS[type(source)](skeleton, recipe, casts, scales, weight_only_tokens, meta)


def freeze(model: nn.Module, recipe: Recipe | None, *, workspaces: dict | None = None, device=None,
           weight_only_tokens: int = 0) -> nn.Module:
    """An inference copy of `model` holding each GEMM weight as its FP8 forward cast only.

    model: a module with te_func layers, or a tef.Stateful. recipe: the recipe it runs with.
    workspaces: whose casts and DelayedScaling scales are frozen (needed under DelayedScaling);
    without them the current weights are cast. device: where the copy lives (default: the model's).
    weight_only_tokens: calls of at most this many tokens run weight-only FP8 (the input not
    quantized; not a TE mode; 0: never; docs/inference.md). The copy is in eval mode, without
    gradients; `model` is not modified."""
    if isinstance(model, Stateful):
        if recipe != model.recipe:
            raise RecipeMismatchError(f"tef.freeze: the shell runs {describe(model.recipe)}, not {describe(recipe)}",
                                      recipe=recipe)
        workspaces = model.workspaces if workspaces is None else workspaces
        model = model.model
    if not isinstance(model, nn.Module):
        raise TypeError(f"tef.freeze: model must be a torch.nn.Module, got {type(model).__name__}")
    if recipe is None:
        raise ValueError("tef.freeze: recipe is None; a high-precision model needs no freezing (model.eval() "
                         "under torch.no_grad() is its inference form). Pass the FP8 recipe the model runs with")
    _check_recipe(recipe)
    if isinstance(weight_only_tokens, bool) or not isinstance(weight_only_tokens, int) or weight_only_tokens < 0:
        raise ValueError(f"tef.freeze: weight_only_tokens must be an int >= 0, got {weight_only_tokens!r}")
    layers = _gemm_layers(model)
    if not layers:
        frozen_inside = any(isinstance(m, FrozenLayer) for m in model.modules())
        raise ValueError(f"tef.freeze: {type(model).__name__} has no te_func GEMM layers to freeze"
                         + (" (it is frozen already)" if frozen_inside else
                            "; convert it first: tef.freeze(tef.convert(model), recipe)"))
    for path, m in layers:
        if type(m) not in FROZEN_LAYERS:
            raise TypeError(f"tef.freeze: {path or '(root)'} is a {type(m).__name__}, a subclass of a te_func layer "
                            f"whose forward may differ; te_func freezes {', '.join(t.__name__ for t in FROZEN_LAYERS)}")
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if workspaces is not None:
        validate_workspaces(model, workspaces, recipe)
    elif lower(recipe).keeps_history and not on_meta:
        raise ValueError("tef.freeze: under DelayedScaling the scales live in the workspaces: pass the "
                         "model's, tef.freeze(model, recipe, workspaces=ws) (a training step's new_ws, or "
                         "shell.workspaces; tef.freeze(shell, recipe) takes them from a tef.Stateful)")
    with torch.no_grad():
        # Copied without its GEMM weights: they are never duplicated, nor moved to `device`.
        memo = {id(p): None for p in _gemm_only_weights(model, layers)}
        frozen = copy.deepcopy(model, memo)
        if device is not None and not on_meta:
            frozen.to(device)
        sources = {id(memo[id(m)]): (path, m) for path, m in layers}
        built = {}
        for parent in [frozen, *frozen.modules()]:
            for name, child in list(parent._modules.items()):
                if child is not None and id(child) in sources:
                    if id(child) not in built:
                        path, source = sources[id(child)]
                        built[id(child)] = _frozen(path, source, child, recipe, workspaces,
                                                   None if on_meta else device, weight_only_tokens)
                    parent._modules[name] = built[id(child)]
        if id(frozen) in sources:           # the model is itself one te_func layer
            path, source = sources[id(frozen)]
            frozen = _frozen(path, source, frozen, recipe, workspaces, None if on_meta else device,
                             weight_only_tokens)
    frozen.requires_grad_(False)
    return frozen.eval()


def frozen_layers(model: nn.Module) -> dict[str, FrozenLayer]:
    """The frozen te_func layers of `model`, by path."""
    return {path: m for path, m in model.named_modules() if isinstance(m, FrozenLayer)}
