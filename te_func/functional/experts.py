"""`experts`: a mixture of experts' expert MLPs, routed tokens in, their weighted sum out, the
two projections as grouped FP8 GEMMs.

The contract is transformers' experts interface (`grouped_mm_experts_forward`): hidden states
(tokens, hidden), each token's top-k expert ids and routing weights; every expert's weights are
one slice of a 3-D parameter. The routing itself (sort, gather, weighting, sum) stays in high
precision, as the router and top-k before it; the expert GEMMs run as `grouped_linear` does, with
each expert's token count on the device: no host sync under current and delayed scaling."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import TransformError
from ..quant import Gemm
from ..quant.tensor import batched_by_vmap
from .grouped_linear import counts_stay_on_device, grouped_linear

__all__ = ["experts", "expert_gemms", "check_routing", "route", "combine"]


def expert_gemms(param: str, num_experts: int) -> tuple[Gemm, ...]:
    """Expert i's GEMM of the 3-D parameter `param`, named f"{param}{i}": one set of entries (one
    FP8 meta slot) per expert and projection, as TE's GroupedLinear keeps one per GEMM. (Not
    cached here: te_func.nn.Experts keeps its own, which a torch.compile trace reads.)"""
    return tuple(Gemm(f"{param}{i}") for i in range(num_experts))


def check_routing(layer: str, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> None:
    """Clear errors for routing tensors that do not fit the tokens (their metadata only)."""
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0] if hidden_states.dim() else -1
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != tokens:
        raise ValueError(f"{layer}: top_k_index and top_k_weights must both be (tokens, k) for hidden_states of "
                         f"{tuple(hidden_states.shape)}, got {tuple(top_k_index.shape)} and "
                         f"{tuple(top_k_weights.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or top_k_index.dtype == torch.bool:
        raise TypeError(f"{layer}: top_k_index must be an integer tensor, got {top_k_index.dtype}")


def route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the (token, slot) pairs sorted by expert, stably, and each expert's count.
    An expert id outside [0, num_experts) fails on the device, with no host sync."""
    ids = top_k_index.reshape(-1)                                                   # (S,)
    torch._assert_async(((ids >= 0) & (ids < num_experts)).all(),
                        f"Experts: top_k_index holds an expert id outside [0, {num_experts})")
    order = torch.argsort(ids, stable=True)
    # scatter_add_, not bincount: its size is num_experts whatever the ids, so a trace stays static.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    return order, counts


def combine(y: torch.Tensor, top_k_weights: torch.Tensor, order: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The experts' rows y (S, hidden), sorted by expert, weighted and summed per token: (tokens, hidden)."""
    tokens, k = top_k_weights.shape
    weighted = y * top_k_weights.reshape(-1)[order].unsqueeze(-1)                  # (S, hidden), promoted
    # Back to (token, slot) order, then each token's k rows summed: no atomics, deterministic.
    unsorted = torch.empty_like(weighted).index_copy(0, order, weighted)
    return unsorted.view(tokens, k, -1).sum(dim=1).to(dtype)


def experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            up: torch.Tensor, down: torch.Tensor, up_bias: torch.Tensor | None = None,
            down_bias: torch.Tensor | None = None, *, gate: Callable[[torch.Tensor], torch.Tensor],
            names: tuple[str, str] = ("gate_up_proj", "down_proj"),
            gemms: tuple[tuple[Gemm, ...], tuple[Gemm, ...]] | None = None, recipe=None, workspace: dict | None = None,
            is_first_microbatch: bool | None = None, update_state: bool | None = None, batch_scales: bool = False):
    """sum over k of top_k_weights[t, k] * expert e = top_k_index[t, k] applied to hidden_states[t],
    expert e being down[e] @ gate(up[e] @ x + up_bias[e]) + down_bias[e], in FP8 per `recipe`.

    hidden_states (tokens, hidden); top_k_index (tokens, k) int; top_k_weights (tokens, k).
    up (E, N, hidden), down (E, hidden, I): GEMM layout (out, in) per expert; biases (E, out) or None.
    gate: (rows, N) -> (rows, I) (transformers' `_apply_gate`, or the activation where N == I).
    names: the two parameters' names, which name the GEMMs (`expert_gemms`) and their entries;
    gemms: those GEMMs, where the caller keeps them.
    workspace, is_first_microbatch, update_state, batch_scales: as `grouped_linear`'s.
    Returns `(out (tokens, hidden) in hidden_states' dtype, new_workspace)`."""
    layer = "Experts"
    if up.dim() != 3 or down.dim() != 3 or up.shape[0] != down.shape[0] or up.shape[2] != down.shape[1]:
        raise ValueError(f"{layer}: up must be (experts, N, hidden) and down (experts, hidden, I), got "
                         f"{tuple(up.shape)} and {tuple(down.shape)}")
    check_routing(layer, hidden_states, top_k_index, top_k_weights)
    if recipe is not None and any(batched_by_vmap(t) for t in (hidden_states, top_k_index)):
        # Each sample routes its tokens its own way: its groups would need counts of their own.
        raise TransformError(f"{layer}: vmap over routed tokens (per-sample gradients of a mixture of experts) "
                             f"is not supported under an FP8 recipe: each sample's tokens go to experts of "
                             f"their own. Differentiate the batch as a whole (tef.grad)", layer=layer)
    if recipe is not None and torch.compiler.is_compiling() and not counts_stay_on_device(recipe, batch_scales):
        raise ValueError(f"{layer}: under torch.compile, {type(recipe).__name__} (or its backward_override) reads "
                         f"each expert's token count on the host, which a trace cannot; compile the experts under "
                         f"Float8CurrentScaling or DelayedScaling, whose counts stay on the device, or run eagerly")
    num_experts, dtype = up.shape[0], hidden_states.dtype
    x = hidden_states.reshape(-1, hidden_states.shape[-1])                          # (tokens, hidden)
    k = top_k_index.shape[1]
    order, counts = route(top_k_index, num_experts)
    if gemms is None:
        gemms = (expert_gemms(names[0], num_experts), expert_gemms(names[1], num_experts))
    run = dict(recipe=recipe, is_first_microbatch=is_first_microbatch, update_state=update_state,
               batch_scales=batch_scales, layer=layer)
    h, workspace = grouped_linear(x[order // k], counts, list(up.unbind(0)),
                                  None if up_bias is None else list(up_bias.unbind(0)),
                                  workspace=workspace, gemms=gemms[0], **run)
    y, workspace = grouped_linear(gate(h), counts, list(down.unbind(0)),
                                  None if down_bias is None else list(down_bias.unbind(0)),
                                  workspace=workspace, gemms=gemms[1], **run)
    return combine(y, top_k_weights, order, dtype).reshape(hidden_states.shape), workspace
