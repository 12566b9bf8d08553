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

import torch

from . import _compat, distributed

__all__ = ["merge", "reduce_amaxes", "merge_inboxes", "DeliverToInboxes", "deliver", "merge_when_backward_ends",
           "remove_hooks"]


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


def deliver(shell_ref, key: str, amax: torch.Tensor):
    """An eager call's backward amax for history `key`, from the op's node, into the inbox by max."""
    shell = shell_ref()
    if shell is None or key not in shell._inboxes:
        return
    inbox = shell._inboxes[key]
    inbox.copy_(torch.maximum(inbox, amax.detach().to(inbox.device)))
    merge_when_backward_ends(shell_ref)


def merge_when_backward_ends(shell_ref, grad=None):
    # Also a hook on each GEMM weight: a backward that computes its gradient went through its layer.
    shell = shell_ref()
    if shell is None:
        return
    task = _compat.backward_task_id()
    if shell._merge_queued_for != task:      # once per backward
        shell._merge_queued_for = task
        _compat.queue_backward_callback(functools.partial(_merge_now, shell_ref))


def _merge_now(shell_ref):
    shell = shell_ref()
    if shell is None:
        return
    shell._merge_queued_for = None
    shell._workspaces = shell._merged(shell._workspaces)


def remove_hooks(handles: list):
    for handle in handles:
        handle.remove()
    handles.clear()
