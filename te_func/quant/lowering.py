"""A recipe lowered once into what each of its GEMMs keeps and does: `lower(recipe)`.

A `Lowering` says what a recipe means for one GEMM's workspace: which entries it keeps, how they
read into typed state and write back, their initial values, and how a step starts. Callers hold
a Lowering and never ask which recipe it came from.

    Lowering         recipe None: nothing kept
    Stateless        current and block recipes: the weight cast; NVFP4's random stream; in
                     batch scope, the batch's amaxes of tensor-wise current scales
    Delayed          DelayedScaling: the cast and, per role, an amax history and a scale"""
from __future__ import annotations

import torch

from ..errors import MissingEntryError
from ..recipe import DelayedScaling, derivation, derived
from .delayed import delayed_update, init_delayed_state
from .nvfp4 import init_rng_state, rng_seed
from .scheme import scheme_for
from .tensor import BatchAmax, DelayedState
from .workspace import (CAST_FIELDS, ROLES_OF_GEMM, Entry, Gemm, GemmWorkspace, cast_entries, cast_fields,
                        cast_from_flat, cast_to_flat, make_cast)

__all__ = ["Lowering", "Stateless", "Delayed", "lower"]


def lower(recipe) -> Lowering:
    """The Lowering of `recipe` (None: high precision)."""
    if recipe is None:
        return _HIGH_PRECISION
    return derived(recipe, "lowering")


class Lowering:
    """Recipe None: no entries, no state; the base every recipe's lowering refines."""
    # Whether GEMMs keep amax histories and scales between steps: no tef.autocast, no shared
    # layer, and a frozen copy keeps its input scales.
    keeps_history = False

    def __init__(self, recipe):
        self.recipe = recipe

    @property
    def keeps_rng(self) -> bool:
        """Whether each GEMM keeps a random stream for NVFP4's stochastic rounding."""
        r = self.recipe
        return r is not None and scheme_for(r, "grad").stochastic_rounding and r.backward_override is None

    @property
    def tensorwise(self) -> bool:
        """Whether every scale is one number per tensor (FP8 all-gather, sharded weights need it)."""
        return self.recipe is None or all(scheme_for(self.recipe, role).block is None for role in ROLES_OF_GEMM)

    @property
    def token_local(self) -> bool:
        """Whether every activation and gradient is quantized with scales from one token's values (blocks
        along the features), so no sample's forward or input gradient depends on another's: what
        per-sample gradients for differential privacy need."""
        r = self.recipe
        if r is None:
            return True
        roles = ("input",) if r.backward_override is not None else ("input", "grad")
        return not self.keeps_history and all(scheme_for(r, role).block is not None and not scheme_for(r, role).nvfp4
                                              for role in roles)

    def entries(self, gemm: Gemm, weight_shape) -> dict[str, Entry]:
        """Op-local entry name -> Entry of `gemm`'s workspace, its weight of `weight_shape`."""
        return {}

    def batch_entries(self, gemm: Gemm) -> dict[str, Entry]:
        """Op-local name -> Entry of the batch-scope amaxes (te_func.quant.workspace)."""
        return {}

    def read(self, gemm: Gemm, workspace: dict, batch_scales: bool = False) -> GemmWorkspace:
        """The typed view of `gemm`'s entries in an op-local `workspace` (None where missing).
        batch_scales: a per-sample call in batch scope, whose batch amaxes give the scales."""
        return GemmWorkspace(None)

    def write(self, gemm: Gemm, gw: GemmWorkspace) -> dict[str, torch.Tensor]:
        """`gw` as op-local flat entries (the inverse of `read`)."""
        return {}

    def init(self, gemm: Gemm, weight: torch.Tensor, path: str = "", cast: bool = True) -> GemmWorkspace:
        """Fresh state: the current weight's cast (None without `cast`) and the recipe's initial states."""
        return GemmWorkspace(None)

    def begin(self, gw: GemmWorkspace, starts_step: bool) -> GemmWorkspace:
        """The state a call quantizes with: each role's detached (only the grad record gets a
        gradient, through g_sink), after what the recipe does where the call starts a step."""
        def detached(state):
            return None if state is None else type(state)(*(None if t is None else t.detach() for t in state))
        return gw._replace(**{role: detached(getattr(gw, role)) for role in ROLES_OF_GEMM})


_HIGH_PRECISION = Lowering(None)


class _Quantized(Lowering):
    """What every FP8 (or FP4) recipe keeps: the weight's cast in both layouts."""

    def entries(self, gemm, weight_shape):
        return {f"{gemm.cast}.{k}": e for k, e in cast_entries(tuple(weight_shape), self._weight_scheme).items()}

    @property
    def _weight_scheme(self):
        return scheme_for(self.recipe, "weight")

    def _read_cast(self, gemm, workspace):
        p = f"{gemm.cast}."
        # By name, not by a scan of the workspace: a layer of 2 x 128 experts' GEMMs reads 256 casts.
        flat = {k: workspace[p + k] for k in CAST_FIELDS if p + k in workspace}
        # all(...), not `set <= keys`: torch 2.11's dynamo cannot trace set comparisons.
        s = self._weight_scheme
        return cast_from_flat(flat, s) if all(k in flat for k in cast_fields(s)) else None

    def write(self, gemm, gw):
        out = {} if gw.cast is None else {f"{gemm.cast}.{k}": v
                                          for k, v in cast_to_flat(gw.cast, self._weight_scheme).items()}
        for role, name in gemm.state_names().items():
            state = getattr(gw, role)
            if isinstance(state, DelayedState):
                out[f"{name}_amax_history"], out[f"{name}_scale"] = state
            elif isinstance(state, BatchAmax):
                out[f"{name}_batch_amax"] = state.amax
        if gw.rng is not None:
            out[gemm.rng_name] = gw.rng
        return out

    def _init_cast(self, weight, cast, state=None):
        return make_cast(weight.detach(), self._weight_scheme, state)[0] if cast else None


class Stateless(_Quantized):
    """Scales from the tensor at hand: only the cast (and NVFP4's random stream) carries over."""

    def entries(self, gemm, weight_shape):
        out = super().entries(gemm, weight_shape)
        if self.keeps_rng:
            out[gemm.rng_name] = Entry((2,), torch.int64, "rng")
        return out

    def batch_entries(self, gemm):
        # One per role with a tensor-wise current scale (the weight is shared; block scales come
        # from within one token, or one sample: docs/functional.md).
        names = gemm.state_names()
        return {f"{names[role]}_batch_amax": Entry((), torch.float32, "batch_amax", role == "grad")
                for role in ("input", "grad") if self._batch_scoped(role)}

    def _batch_scoped(self, role: str) -> bool:
        if role == "grad" and self.recipe.backward_override is not None:
            return False          # the gradient stays in high precision
        s = scheme_for(self.recipe, role)
        return s.block is None and s.rule == "current"

    def read(self, gemm, workspace, batch_scales=False):
        cast = self._read_cast(gemm, workspace)
        if self.keeps_rng:
            rng = workspace.get(gemm.rng_name)
            if rng is None:
                raise MissingEntryError(
                    f"NVFP4BlockScaling's stochastic rounding of gradients needs the workspace entry "
                    f"{gemm.rng_name} (its random stream); make the workspaces with "
                    f"tef.init_workspaces(model, recipe), or set disable_stochastic_rounding=True", entry=gemm.rng_name)
            return GemmWorkspace(cast, rng=rng)
        # Batch scope: the entries are there for the call (the frame checks all or none are).
        names = gemm.state_names()
        batch = {role: BatchAmax.of(workspace[f"{names[role]}_batch_amax"], scheme_for(self.recipe, role),
                                    batch_scales)
                 for role in ("input", "grad") if f"{names[role]}_batch_amax" in workspace}
        return GemmWorkspace(cast, **batch)

    def init(self, gemm, weight, path="", cast=True):
        # Seeded by the layer's path and weight: the same streams each time, none shared.
        rng = init_rng_state(rng_seed(f"{path}.{gemm.weight}"), weight.device) if self.keeps_rng else None
        return GemmWorkspace(self._init_cast(weight, cast), rng=rng)


class Delayed(_Quantized):
    """DelayedScaling: each role's scale comes from its amax history at the step's start."""
    keeps_history = True

    def entries(self, gemm, weight_shape):
        out = super().entries(gemm, weight_shape)
        for role, name in gemm.state_names().items():
            out[f"{name}_amax_history"] = Entry((self.recipe.amax_history_len,), torch.float32, "amax_history",
                                                role == "grad")
            out[f"{name}_scale"] = Entry((), torch.float32, "scale")
        return out

    def read(self, gemm, workspace, batch_scales=False):
        states = {}
        for role, name in gemm.state_names().items():
            history, scale = workspace.get(f"{name}_amax_history"), workspace.get(f"{name}_scale")
            if history is None or scale is None:
                raise MissingEntryError(f"DelayedScaling needs workspace entries {name}_amax_history and "
                                        f"{name}_scale; make the workspaces with tef.init_workspaces(model, recipe)",
                                        entry=f"{name}_amax_history" if history is None else f"{name}_scale")
            states[role] = DelayedState(history, scale)
        return GemmWorkspace(self._read_cast(gemm, workspace), **states)

    def init(self, gemm, weight, path="", cast=True):
        # TE's initial states (zero histories, scale 1); the cast with the initial scale.
        states = {role: init_delayed_state(self.recipe, weight.device) for role in ROLES_OF_GEMM}
        return GemmWorkspace(self._init_cast(weight, cast, states["weight"]), **states)

    def begin(self, gw, starts_step):
        gw = super().begin(gw, starts_step)
        if not starts_step:
            return gw
        return gw._replace(**{role: delayed_update(getattr(gw, role), self.recipe, role) for role in ROLES_OF_GEMM})


derivation("lowering", lambda recipe: Delayed(recipe) if isinstance(recipe, DelayedScaling) else Stateless(recipe))
