"""One GEMM of a layer for one call: from its workspace entries to its slot's tensors and back.

Per GEMM: read the workspace through the recipe's lowering, start a step where the call starts
one, cast the weight (or take the cached cast), hand the slot its tensors, and turn the slot's
outputs into the entries the call leaves. NVFP4's RNG state moves in forward: a training call
hands its backward the current state and leaves the next one, so every backward draws its own
numbers and nothing comes back from backward."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import GemmConfig, GemmSlot
from ..quant import Gemm, GemmWorkspace, Lowering, WeightCast, advance_rng, cast_weight, lower
from ._common import needs_weight_grad

__all__ = ["GemmStep", "starts_step"]


def starts_step(is_first_microbatch: bool | None, update_state: bool | None = None) -> bool:
    """A call with is_first_microbatch True or None begins a step: DelayedScaling's scales update
    and its histories roll; later microbatches add their amaxes to the slot by max. As in TE,
    nothing updates while grad is disabled. `update_state` says so explicitly (None: grad mode)."""
    return is_first_microbatch is not False and _trains(update_state)


def _trains(update_state: bool | None) -> bool:
    # Whether this call trains: as the frame decided when it opened, else the grad mode.
    return torch.is_grad_enabled() if update_state is None else update_state


@dataclass
class GemmStep:
    """One GEMM's part of a call: the slot, this call's state, and the grad record's entry."""
    gemm: Gemm
    lowering: Lowering
    slot: GemmSlot
    state: GemmWorkspace           # the cast this call uses, the states it quantizes with
    sink: torch.Tensor | None      # the raw grad record entry (see te_func.ops.gemm_layer)
    next_rng: torch.Tensor | None = None    # the RNG state the call leaves (NVFP4)

    @classmethod
    def begin(cls, gemm: Gemm, weight: torch.Tensor, recipe, workspace: dict, is_first_microbatch,
              update_state: bool | None = None, batch_scales: bool = False,
              configs: dict | None = None) -> GemmStep:
        """configs: a dict the GEMMs of one call share, save_input -> GemmConfig (filled here): a
        grouped layer's GEMMs take the recipe's config once, not once each."""
        lowering = lower(recipe)
        gw = lowering.read(gemm, workspace, batch_scales)
        sink = None if gw.grad is None else gw.grad.record
        gw = lowering.begin(gw, starts_step(is_first_microbatch, update_state))
        save_input = needs_weight_grad(weight)
        cfg = None if configs is None else configs.get(save_input)
        if cfg is None:
            cfg = GemmConfig.of(recipe, save_input=save_input)
            if configs is not None:
                configs[save_input] = cfg
        cast, weight_state, _ = cast_weight(weight, cfg.weight, gw.cast, is_first_microbatch, gw.weight)
        slot = GemmSlot(cfg, gemm)
        # Only a training call moves the stream (TE draws only when it rounds).
        next_rng = advance_rng(gw.rng) if gw.rng is not None and _trains(update_state) else gw.rng
        return cls(gemm, lowering, slot, gw._replace(cast=cast, weight=weight_state), sink, next_rng)

    @property
    def cast(self) -> WeightCast:
        """The weight cast this call uses."""
        assert self.state.cast is not None      # `begin` casts the weight (or takes the cached cast)
        return self.state.cast

    def tensors(self) -> dict:
        """The slot's inputs by name."""
        return self.slot.inputs(self.cast, self.state.input, self.state.grad, self.sink, self.state.rng)

    def entries(self, outputs: dict) -> dict:
        """The op-local workspace entries this call leaves, from the op's outputs."""
        x_state, g_state = self.slot.new_states(outputs, self.state.input, self.state.grad)
        return self.lowering.write(self.gemm, self.state._replace(input=x_state, grad=g_state, rng=self.next_rng))
