"""What a backward produces besides gradients, and how it comes back into the workspaces.

Under DelayedScaling each GEMM's backward computes the amax of its output gradient, which the op
returns as the "gradient" of the grad history its forward read (zeros but for slot 0;
te_func.ops.gemm_layer.backward_amax). Whatever runs the backward, it reaches the workspaces by
one rule: an elementwise max into the history as it is when the backward ends (two microbatches'
amaxes give their max, as TE's do). tef.grad: frame.py differentiates the entries and `merge`
puts the amaxes into new_ws. tef.Stateful: a hook on the op's node (eager, `deliver`) or
`DeliverToInboxes` (compiled) puts them into the shell's inboxes, merged when the backward ends.
vmap: te_func.vmapped folds per-sample copies by max. tef.checkpoint: the recompute reads the
histories as the forward was given them, so its amax lands likewise."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch

from . import _compat, distributed

__all__ = ["merge", "reduce_amaxes", "merge_inboxes", "DeliverToInboxes", "AmaxInboxes", "deliver",
           "merge_when_backward_ends", "remove_hooks"]


# --- tef.grad ------------------------------------------------------------------------------

def reduce_amaxes(state_grads: dict, groups: dict) -> dict:
    """The backward amaxes all-reduced over each entry's group, one all-reduce per group (as TE)."""
    by_group: dict = {}
    for k, g in state_grads.items():
        if groups.get(k) is not None:
            by_group.setdefault(groups[k], {})[k] = g
    for group, entries in by_group.items():
        state_grads = {**state_grads, **distributed.reduce_amax_slots(entries, group)}
    return state_grads


def merge(new_ws: dict, state_grads: dict) -> dict:
    """new_ws with each grad record combined with its "gradient" by elementwise max: for a history
    that gradient is the backward amax in slot 0, so the max records it in the current step's slot
    (a sum would add microbatches' amaxes); a batch amax's is the amax itself."""
    return {**new_ws, **{k: torch.maximum(new_ws[k], g) for k, g in state_grads.items()}}


# --- tef.Stateful: inboxes ----------------------------------------------------------------------
# Backwards leave their amaxes in the history's inbox (the shell's private buffer) by max; the shell
# merges each inbox into its history and empties it when a backward it hears of ends, on a read, and
# before every call rolls the histories: an amax lands in the slot current when its backward ran.

@torch.library.custom_op("te_func::merge_inboxes", mutates_args=())
def merge_inboxes(histories: list[torch.Tensor], inboxes: list[torch.Tensor]) -> list[torch.Tensor]:
    """max(history, inbox) of each pair ((L,) fp32 each), leaving the inboxes zero.

    Declared as not mutating the inboxes, on purpose: torch.compile would otherwise hand a compiled
    backward each inbox as the compiled forward left it (zeros), overwriting what other backwards
    put there since. Opaque to the compiler, a compiled backward reads and writes the live buffers."""
    merged = [torch.maximum(h, inbox) for h, inbox in zip(histories, inboxes)]
    for inbox in inboxes:
        inbox.zero_()
    return merged


@merge_inboxes.register_fake
def _(histories, inboxes):
    return [torch.empty_like(h) for h in histories]


class DeliverToInboxes(torch.autograd.Function):
    """`DeliverToInboxes.apply(*histories, *inboxes)` is `histories`; backward merges each history's
    gradient (the backward amax) into its inbox by max, whatever the backward was asked for."""

    @staticmethod
    def forward(*histories_and_inboxes):
        histories = histories_and_inboxes[:len(histories_and_inboxes) // 2]
        return tuple(h.view_as(h) for h in histories)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # On ctx, not saved: saved tensors are version-checked, and others write the inboxes.
        ctx.inboxes = inputs[len(inputs) // 2:]

    @staticmethod
    def backward(ctx, *amaxes):
        for inbox, amax in zip(ctx.inboxes, amaxes):
            inbox.copy_(torch.maximum(inbox, amax))
        return (None,) * (2 * len(amaxes))


class AmaxInboxes(Protocol):
    """What the eager hooks below deliver a backward's amaxes to (tef.Stateful is one), held by a
    weak reference: these three methods are all they use of it."""

    def _amax_inbox(self, key: str) -> torch.Tensor | None:
        """History `key`'s inbox, which backwards fill by max (None: no history of that key)."""

    def _claim_backward_end(self, task) -> bool:
        """True the first time a hook of backward `task` asks, False after: its end merges once."""

    def _absorb_inboxes(self) -> None:
        """Merge every inbox into its history and empty it: a backward has ended."""


_Ref = Callable[[], "AmaxInboxes | None"]     # a weak reference to the receiver


def deliver(receiver_ref: _Ref, key: str, amax: torch.Tensor) -> None:
    """An eager call's backward amax for history `key`, from the op's node, into the inbox by max."""
    receiver = receiver_ref()
    inbox = None if receiver is None else receiver._amax_inbox(key)
    if inbox is None:
        return
    inbox.copy_(torch.maximum(inbox, amax.detach().to(inbox.device)))
    merge_when_backward_ends(receiver_ref)


def merge_when_backward_ends(receiver_ref: _Ref, grad: torch.Tensor | None = None) -> None:
    # Also a hook on each GEMM weight: a backward that computes its gradient went through its layer.
    receiver = receiver_ref()
    if receiver is not None and receiver._claim_backward_end(_compat.backward_task_id()):
        _compat.queue_backward_callback(functools.partial(_merge_now, receiver_ref))


def _merge_now(receiver_ref: _Ref) -> None:
    receiver = receiver_ref()
    if receiver is not None:
        receiver._absorb_inboxes()


def remove_hooks(handles: list):
    for handle in handles:
        handle.remove()
    handles.clear()
