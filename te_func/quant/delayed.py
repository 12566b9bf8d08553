"""Delayed scaling: the scale of a step comes from the amaxes of earlier steps.

A role's `DelayedState` holds an amax history, whose slot 0 collects the current step's amax
(by max), and the scale the step quantizes with. At a step's start `delayed_update` turns the
history into the new scale and rolls it (TE's `amax_and_scale_update`):

    amax  = max(history) (NaN skipped), or history[0] ("most_recent")
    scale = (fp8_max * 2**-margin) / amax in fp32; the old scale where amax is 0, inf or NaN;
            the largest finite fp32 where the quotient overflows
    history <- roll by -1 with slot 0 zeroed; nothing changes when history[0] is 0"""
from __future__ import annotations

import torch

from ..kernels import delayed_update as fused_update
from ..recipe import DelayedScaling
from .scheme import scheme_for
from .tensor import DelayedState

__all__ = ["delayed_update", "init_delayed_state"]


def init_delayed_state(recipe: DelayedScaling, device=None) -> DelayedState:
    """TE's initial state: a history of zeros and scale 1."""
    return DelayedState(torch.zeros(recipe.amax_history_len, dtype=torch.float32, device=device),
                        torch.ones((), dtype=torch.float32, device=device))


def delayed_update(state: DelayedState, recipe: DelayedScaling, role: str) -> DelayedState:
    """The state a new step starts from, as TE's fused amax-and-scale update leaves it; nothing is
    mutated. A step whose slot 0 is 0 is skipped (an expert that got no tokens); NaN entries are
    skipped by the max, as TE's fmax does."""
    history, scale = state
    if history is None:
        raise ValueError("delayed_update: a forward-only DelayedState (a frozen model's) has no history to update")
    # TE's arithmetic: (fp8_max * 2**-margin) / amax, one fp32 division.
    scaled_max = scheme_for(recipe, role).fp8_max * 2.0 ** -recipe.margin
    fused = fused_update(history, scale, scaled_max, recipe.amax_compute_algo != "max")
    if fused is not None:      # eager CUDA: one kernel, these bits (te_func.kernels.delayed)
        return DelayedState(*fused)
    last = history[0]
    if recipe.amax_compute_algo == "max":
        amax = torch.amax(torch.where(torch.isnan(history), 0.0, history))
    else:
        amax = last
    amax = torch.where(last == 0, 0.0, amax)
    new_scale = torch.full_like(amax, scaled_max) / amax
    new_scale = torch.where((amax > 0) & torch.isfinite(amax), new_scale, scale)
    new_scale = torch.where(torch.isinf(new_scale), torch.finfo(torch.float32).max, new_scale)
    # roll(-1) then zero slot 0, written as one concatenation (no in-place write).
    rolled = torch.cat([history.new_zeros(1), history[2:], history[:1]]) if history.numel() > 1 \
        else history.new_zeros(1)
    return DelayedState(torch.where(last == 0, history, rolled), new_scale)
