"""`grouped_linear`: TE's GroupedLinear as a function of tensors and one op-local workspace."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..ops.gemm_layer import GemmConfig
from ..ops.grouped_linear import grouped_linear_fp8
from ._common import (cast_weight, check_input, gemm_recipe, grad_sink, needs_weight_grad, schemes,
                      state_entries, state_names, step_states)

__all__ = ["grouped_linear", "split_sizes"]


def gemm_state_names(i: int) -> dict[str, str]:
    """GEMM i's DelayedScaling states: `gemm{i}_input`, `weight{i}` (as its parameter and its
    `weight{i}_cast` entries), `gemm{i}_grad`. One set per GEMM, as TE keeps one FP8 meta
    slot per GEMM and role."""
    return state_names(f"gemm{i}_", f"weight{i}")


def split_sizes(m_splits, num_gemms: int, tokens: int, layer: str = "GroupedLinear") -> list[int]:
    """m_splits (a sequence of ints or a 1-D integer tensor) as a list of Python ints, checked.

    A tensor is read with `.tolist()`: in eager mode that is one device-to-host
    copy (TE takes a list and leaves that copy to its caller). Under
    torch.compile `.tolist()` stays in the graph as data-dependent ints (no
    graph break, no recompile per set of sizes), checked with torch._check
    instead of an `if`. FP8 quantization cannot trace data-dependent sizes, so
    `grouped_linear` asks for a list there (a list specializes the graph).
    """
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.dtype.is_complex:
            raise TypeError(f"{layer}: m_splits must be a list of ints or a 1-D integer tensor, got a tensor "
                            f"of shape {tuple(m_splits.shape)} and dtype {m_splits.dtype}")
        sizes = m_splits.tolist()
    elif isinstance(m_splits, Sequence) and all(isinstance(s, (int, torch.SymInt)) for s in m_splits):
        sizes = list(m_splits)
    else:
        raise TypeError(f"{layer}: m_splits must be a list of ints or a 1-D integer tensor, got {m_splits!r}")
    if len(sizes) != num_gemms:
        raise ValueError(f"{layer}: got {len(sizes)} m_splits for num_gemms={num_gemms}; pass one token "
                         f"count per GEMM (zeros allowed)")
    if torch.compiler.is_compiling():
        # Under torch.compile `.tolist()` gives data-dependent ints: assert, do not branch.
        for s in sizes:
            torch._check(s >= 0)
        torch._check(sum(sizes) == tokens)
        return sizes
    if any(s < 0 for s in sizes) or sum(sizes) != tokens:
        raise ValueError(f"{layer}: m_splits {sizes} must be non-negative and sum to the number of input "
                         f"tokens ({tokens}, the product of the input's leading dims)")
    return sizes


def grouped_linear(inp: torch.Tensor, m_splits, weights: Sequence[torch.Tensor],
                   biases: Sequence[torch.Tensor | None] | None = None, *, recipe=None,
                   workspace: dict | None = None, is_first_microbatch: bool | None = None):
    """Row group i of inp times weights[i].T plus biases[i], in FP8 per `recipe` (None: F.linear).

    inp: (tokens, in_features), or (..., in_features) flattened to tokens; the first
    m_splits[0] tokens use weights[0], the next m_splits[1] weights[1], and so on.
    weights[i]: (out_features, in_features); biases[i]: (out_features,) or None.
    workspace: this op's entries (`weight{i}_cast.*`; under DelayedScaling also the
    `_amax_history` and `_scale` of `gemm{i}_input`, `weight{i}`, `gemm{i}_grad`), or None
    to cache nothing.
    Returns `(out, new_workspace)`, out (..., out_features) in inp's dtype.
    """
    layer = "GroupedLinear"
    n = len(weights)
    biases = [None] * n if biases is None else list(biases)
    if n == 0 or len(biases) != n:
        raise ValueError(f"{layer}: need one weight (and one bias or None) per GEMM, got {n} weights "
                         f"and {len(biases)} biases")
    out_features, in_features = weights[0].shape
    for i, w in enumerate(weights):
        if tuple(w.shape) != (out_features, in_features):
            raise ValueError(f"{layer}: weight{i} has shape {tuple(w.shape)}, weight0 {tuple(weights[0].shape)}; "
                             f"all GEMMs share (out_features, in_features)")
    check_input(layer, inp, in_features, {**{f"weight{i}": w for i, w in enumerate(weights)},
                                          **{f"bias{i}": b for i, b in enumerate(biases)}}, recipe)
    x = inp.reshape(-1, in_features)                                                # (tokens, in)
    if recipe is not None and isinstance(m_splits, torch.Tensor) and torch.compiler.is_compiling():
        # Compiled, a tensor's values are unknown until run time, and FP8 scaling
        # (per-group amax, blocks along tokens) needs every group's size to trace.
        raise ValueError(f"{layer}: under torch.compile with an FP8 recipe, pass m_splits as a list of "
                         f"Python ints (m_splits.tolist() outside the compiled function); the graph is "
                         f"then specialized to those sizes. A tensor m_splits compiles in high "
                         f"precision (recipe=None) and works in eager mode with every recipe")
    sizes = split_sizes(m_splits, n, x.shape[0], layer)
    # One precision for the whole group (its GEMMs share their weights' shape),
    # decided by the mean group: per-group choices would mix recipes in one call.
    recipe = gemm_recipe(recipe, inp.device, x.shape[0] // n, in_features, out_features)
    workspace = {} if workspace is None else workspace
    if recipe is None:
        outs = [F.linear(xi, w.to(x.dtype), None if b is None else b.to(x.dtype))
                for xi, w, b in zip(torch.split(x, sizes), weights, biases)]
        out, entries = torch.cat(outs), {}
    else:
        names = [gemm_state_names(i) for i in range(n)]
        states = step_states(recipe, workspace, {k: v for ns in names for k, v in ns.items()},
                             is_first_microbatch)                                   # None unless delayed
        casts, entries = [], {}
        for i, w in enumerate(weights):
            cast, e = cast_weight(f"weight{i}", w, recipe, workspace, is_first_microbatch,
                                  state=None if states is None else states[f"weight{i}"])
            casts.append(cast)
            entries.update(e)
        cfg = GemmConfig(*schemes(recipe), save_input=any(needs_weight_grad(w) for w in weights))
        if states is None:
            out, _ = grouped_linear_fp8(x, sizes, weights, biases, casts, cfg)      # (tokens, out)
        else:
            out, new_inputs = grouped_linear_fp8(
                x, sizes, weights, biases, casts, cfg,
                x_states=[states[f"gemm{i}_input"] for i in range(n)],
                g_states=[states[f"gemm{i}_grad"] for i in range(n)],
                g_sinks=[grad_sink(workspace, states, ns) for ns in names])
            for i, new_input in enumerate(new_inputs):
                entries.update(state_entries({f"gemm{i}_input": new_input,
                                              f"gemm{i}_grad": states[f"gemm{i}_grad"]}))
    return out.reshape(*inp.shape[:-1], out_features), {**workspace, **entries}
