"""`TEModule`: what every te_func layer shares: its workspace spec and its call context."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..quant import Entry, Gemm, lower
from ..recipe import RECIPES, fingerprint
from . import context

__all__ = ["TEModule", "LayerEntries", "LayerView"]


class LayerEntries(NamedTuple):
    """One layer's entries as a call validates them (TEModule.entries_at)."""
    names: tuple[str, ...]                  # op-local entry names
    reads: tuple[str, ...]                  # those a call's backward reads (grad histories, random streams)
    keyed: tuple[tuple[str, Entry], ...]    # (full key, Entry) of each


class LayerView(NamedTuple):
    """One layer's entries as a call validates them (TEModule.view)."""
    kinds: dict[str, tuple[str, ...]]       # "batch_amax" / "cast" -> the full keys of that kind
    at: dict[tuple[bool, bool], LayerEntries]   # (batch amaxes dropped, casts dropped) -> its entries


def _key_of(recipe):
    # A recipe in a cache key by its fingerprint (one attribute read), not its hash: hashing a recipe
    # traces the __hash__ of its enums. Anything else as itself (`lower` says what is wrong with it).
    return fingerprint(recipe) if isinstance(recipe, RECIPES) else recipe


class TEModule(nn.Module):
    """A parameter holder whose forward runs one `te_func.functional` op over the GEMMs of `gemms()`."""

    def gemms(self) -> tuple[Gemm, ...]:
        """The layer's FP8 GEMMs, as its functional op declares them."""
        return ()

    def gemm_param(self, name: str) -> str:
        """The parameter that holds GEMM `name`'s weight: its own, but for weights that are slices of
        one parameter (te_func.nn.Experts')."""
        return name

    def gemm_weight(self, name: str, value: torch.Tensor | None = None) -> torch.Tensor:
        """The GEMM weight `name` as the GEMM reads it, (out, in), from its parameter (`gemm_param`)
        or from `value`, that parameter's value elsewhere (e.g. FSDP's gathered one)."""
        return getattr(self, name) if value is None else value

    def workspace_spec(self, recipe) -> dict[str, Entry]:
        """Entry name -> Entry (shape, dtype, updated in backward) of every entry this layer needs.
        Shared and cached: a caller copies it before changing it."""
        gemms, shapes = self._layout()
        return self._cached(("workspace", _key_of(recipe), gemms, shapes), lambda: {
            k: e for g, shape in zip(gemms, shapes) for k, e in lower(recipe).entries(g, shape).items()})

    def batch_scope_spec(self, recipe) -> dict[str, Entry]:
        """The entries a call in batch scope adds (te_func.quant.workspace's batch amaxes); cached too."""
        gemms = self.gemms()
        return self._cached(("batch", _key_of(recipe), gemms), lambda: {
            k: e for g in gemms for k, e in lower(recipe).batch_entries(g).items()})

    def view(self, recipe, path: str) -> LayerView:
        """What a call's validation walks for this layer at `path` (batch scope's entries included),
        made once per recipe, layout and path: a call computes one layout, not one per question."""
        return self._cached(("view", _key_of(recipe), *self._layout(), path), lambda: self._make_view(recipe, path))

    def _make_view(self, recipe, path: str) -> LayerView:
        spec = {**self.workspace_spec(recipe), **self.batch_scope_spec(recipe)}
        prefix = f"{path}." if path else ""

        def at(dropped):
            kept = {k: e for k, e in spec.items()
                    if not (dropped[0] and e.kind == "batch_amax" or dropped[1] and e.kind == "cast")}
            return LayerEntries(tuple(kept), tuple(k for k, e in kept.items() if e.backward or e.stream),
                                tuple((prefix + k, e) for k, e in kept.items()))
        return LayerView({kind: tuple(prefix + k for k, e in spec.items() if e.kind == kind)
                          for kind in ("batch_amax", "cast")},
                         {dropped: at(dropped) for dropped in ((False, False), (False, True), (True, False),
                                                               (True, True))})

    def entries_at(self, recipe, path: str, dropped: tuple[bool, bool]) -> LayerEntries:
        """This layer's entries at `path`, without batch amaxes / weight casts where `dropped` says so."""
        return self.view(recipe, path).at[dropped]

    def _layout(self) -> tuple[tuple[Gemm, ...], tuple[tuple[int, ...], ...]]:
        # What a layer's entries follow from besides the recipe: its GEMMs and their weights' shapes.
        gemms = self.gemms()
        return gemms, tuple(tuple(self.gemm_weight(g.weight).shape) for g in gemms)

    def _cached(self, key: tuple, make):
        # Every call validates its workspaces against these: made once per key (a torch.compile
        # trace then reads them where it interpreted ~90 Entry constructions).
        # A trace only reads it: torch 2.11's dynamo cannot trace `__dict__.setdefault`, and a
        # store while tracing would be a side effect replayed after the graph.
        cache = getattr(self, "_te_func_specs", None)
        value = None if cache is None else cache.get(key)
        if value is None:
            value = make()
            if not torch.compiler.is_compiling():
                self.__dict__.setdefault("_te_func_specs", {})[key] = value
        return value

    def init_workspace(self, recipe, weights: dict | None = None, path: str = "",
                       weight_cache: bool = True) -> dict[str, torch.Tensor]:
        """Fresh entries: casts of the current weights (none without `weight_cache`), initial
        DelayedScaling states, NVFP4's random streams (seeded by `path` and each weight's name).
        weights: parameter name (`gemm_param`) -> the value to cast instead (FSDP's gathered weight)."""
        entries, lowering = {}, lower(recipe)
        for g in self.gemms():
            weight = self.gemm_weight(g.weight, (weights or {}).get(self.gemm_param(g.weight)))
            entries.update(lowering.write(g, lowering.init(g, weight, path, cast=weight_cache)))
        return entries

    def _run(self, op, *args, is_first_microbatch=None, **kwargs):
        """Run the functional `op` on `args` with what this module's frame gives it; commit its entries."""
        b = context.bind(self, type(self).__name__, is_first_microbatch)
        if b.batch_scales and self.gemms():
            kwargs["batch_scales"] = True
        out, new_workspace = op(*args, recipe=b.recipe, workspace=b.workspace,
                                is_first_microbatch=b.is_first_microbatch, update_state=b.update_state, **kwargs)
        b.commit(new_workspace)
        return out


def make_param(shape, dtype, device, init=None) -> nn.Parameter:
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"params_dtype must be float32, bfloat16 or float16 (float64 for high-precision "
                        f"references), got {dtype}")
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and not torch.cuda.is_available():
        # torch's own error here is a bare "Torch not compiled with CUDA enabled" assertion.
        raise RuntimeError(f"device={str(device)!r} was asked for, but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
                           f"use device='cpu' or install a CUDA build of torch on a machine with a GPU")
    t = torch.empty(shape, dtype=dtype, device=device)
    with torch.no_grad():
        init(t) if init is not None else t.zero_()
    return nn.Parameter(t)


def te_init(std: float = 0.023):
    """TE's default weight init: normal(0, 0.023)."""
    return lambda t: nn.init.normal_(t, 0.0, std)
