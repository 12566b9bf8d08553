"""`grouped_linear`: TE's GroupedLinear as a function of tensors and one op-local workspace."""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..ops import GroupedLinearFP8, GroupedLinearRunsFP8, call
from ..quant import Gemm, scheme_for
from ..quant.tensor import batched_by_vmap
from ._common import autocast_input, check_input, first_microbatch
from ._gemm import GemmStep

__all__ = ["grouped_linear", "split_sizes", "fp8_split_sizes", "grouped_gemms", "device_offsets",
           "counts_stay_on_device"]


def grouped_gemms(num_gemms: int) -> tuple[Gemm, ...]:
    """GEMM i, named `weight{i}`: one set of entries per GEMM, as TE keeps one FP8 meta slot each."""
    return tuple(Gemm(f"weight{i}") for i in range(num_gemms))


def split_sizes(m_splits, num_gemms: int, tokens: int, layer: str = "GroupedLinear") -> list[int]:
    """m_splits (ints, or a 1-D integer tensor) as a list of Python ints, checked. A tensor is read
    with `.tolist()`: one device-to-host copy eagerly; under torch.compile data-dependent ints,
    checked with torch._check. FP8 quantization cannot trace those, so it asks for a list."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.dtype.is_complex:
            raise TypeError(f"{layer}: m_splits must be a list of ints or a 1-D integer tensor, got a tensor "
                            f"of shape {tuple(m_splits.shape)} and dtype {m_splits.dtype}")
        sizes = m_splits.tolist()
    elif hasattr(m_splits, "tolist") and getattr(m_splits, "ndim", None) == 1 and \
            str(getattr(m_splits, "dtype", "")).startswith(("int", "uint")):
        sizes = m_splits.tolist()                                   # a numpy array, as TE accepts
    elif isinstance(m_splits, Sequence) and all(isinstance(s, (numbers.Integral, torch.SymInt)) for s in m_splits):
        sizes = [s if isinstance(s, torch.SymInt) else int(s) for s in m_splits]   # numpy ints too
    else:
        raise TypeError(f"{layer}: m_splits must be a list of ints, a 1-D integer tensor or a 1-D integer "
                        f"numpy array, got {m_splits!r}")
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


def fp8_split_sizes(m_splits, num_gemms: int, tokens: int, recipe, layer: str = "GroupedLinear") -> list:
    """`split_sizes`, refusing a tensor m_splits under torch.compile (FP8 cannot trace it)."""
    if recipe is not None and isinstance(m_splits, torch.Tensor) and torch.compiler.is_compiling():
        # Compiled, FP8 scaling needs every group's size to trace, unknown in a tensor.
        raise ValueError(f"{layer}: under torch.compile with an FP8 recipe, pass m_splits as a list of "
                         f"Python ints (m_splits.tolist() outside the compiled function); the graph is "
                         f"then specialized to those sizes. A tensor m_splits compiles in high "
                         f"precision (recipe=None) and works in eager mode with every recipe")
    return split_sizes(m_splits, num_gemms, tokens, layer)


def counts_stay_on_device(recipe, batch_scales: bool = False) -> bool:
    """Whether a tensor of counts runs on the device under `recipe`: tensor-wise scaling of every
    role (current and delayed), no backward_override, outside batch scope."""
    if recipe is None or batch_scales or recipe.backward_override is not None:
        return False
    return not any(s.block is not None or s.nvfp4 for s in (scheme_for(recipe, r) for r in ("input", "weight", "grad")))


def device_offsets(m_splits, num_gemms: int, x: torch.Tensor, recipe, batch_scales: bool,
                   layer: str = "GroupedLinear") -> torch.Tensor | None:
    """The groups' ends (G,) int32 on x's device, where m_splits is a 1-D integer tensor and the
    recipe scales every role tensor-wise (current and delayed scaling, no backward_override) outside
    batch scope and vmap: those calls run with no host sync (GroupedLinearRunsFP8). Else None.
    The counts are checked on the device (non-negative, summing to the tokens); a CPU tensor given
    eagerly is checked on the host first, with `split_sizes`' message."""
    if (not isinstance(m_splits, torch.Tensor) or not counts_stay_on_device(recipe, batch_scales)
            or batched_by_vmap(x) or batched_by_vmap(m_splits)):
        return None
    if m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.dtype.is_complex \
            or m_splits.dtype == torch.bool or m_splits.shape[0] != num_gemms:
        return None         # the host path refuses it, saying what is wrong
    if m_splits.device.type == "cpu" and not torch.compiler.is_compiling():
        split_sizes(m_splits, num_gemms, x.shape[0], layer)
    counts = m_splits.to(device=x.device)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    torch._assert_async((counts >= 0).all() & (offs[-1] == x.shape[0]),
                        f"{layer}: m_splits must be non-negative and sum to the number of input tokens")
    return offs


def grouped_linear(inp: torch.Tensor, m_splits, weights: Sequence[torch.Tensor],
                   biases: Sequence[torch.Tensor | None] | None = None, *, recipe=None,
                   workspace: dict | None = None, is_first_microbatch: bool | None = None,
                   update_state: bool | None = None, batch_scales: bool = False,
                   gemms: Sequence[Gemm] | None = None, layer: str = "GroupedLinear"):
    """Row group i of inp times weights[i].T plus biases[i], in FP8 per `recipe` (None: F.linear).

    inp: (tokens, in_features) (more leading dims are flattened); group i is the m_splits[i] tokens
    after the previous groups'. weights[i]: (out_features, in_features); biases[i]: (out_features,)
    or None. workspace, update_state, batch_scales: as `te_func.functional.linear`'s. gemms: the
    GEMMs' names, which name their entries (default `grouped_gemms`: weight0, weight1, ...);
    layer: the name errors give. Returns `(out, new_workspace)`, out (..., out_features) in inp's dtype."""
    n = len(weights)
    gemms = grouped_gemms(n) if gemms is None else tuple(gemms)
    biases = [None] * n if biases is None else list(biases)
    if n == 0 or len(biases) != n or len(gemms) != n:
        raise ValueError(f"{layer}: need one weight (and one bias or None, one name) per GEMM, got {n} "
                         f"weights, {len(biases)} biases and {len(gemms)} names")
    out_features, in_features = weights[0].shape
    for i, w in enumerate(weights):
        if tuple(w.shape) != (out_features, in_features):
            raise ValueError(f"{layer}: weight{i} has shape {tuple(w.shape)}, weight0 {tuple(weights[0].shape)}; "
                             f"all GEMMs share (out_features, in_features)")
    check_input(layer, inp, in_features, {**{f"weight{i}": w for i, w in enumerate(weights)},
                                          **{f"bias{i}": b for i, b in enumerate(biases)}}, recipe)
    x = inp.reshape(-1, in_features)                                                # (tokens, in)
    offs = device_offsets(m_splits, n, x, recipe, batch_scales, layer)
    sizes = None if offs is not None else fp8_split_sizes(m_splits, n, x.shape[0], recipe, layer)
    workspace = {} if workspace is None else workspace
    if recipe is None:
        assert sizes is not None        # device counts run only under a recipe (device_offsets)
        outs = [F.linear(xi, w.to(x.dtype), None if b is None else b.to(x.dtype))
                for xi, w, b in zip(torch.split(x, sizes), weights, biases)]
        out, entries = torch.cat(outs), {}
    else:
        ifm = first_microbatch(is_first_microbatch, layer)
        x = autocast_input(x)
        configs: dict = {}
        steps = [GemmStep.begin(g, w, recipe, workspace, ifm, update_state, batch_scales, configs)
                 for g, w in zip(gemms, weights)]
        tensors = {k: v for st in steps for k, v in st.tensors().items()}
        slots = tuple(st.slot for st in steps)
        groups = {"offs": offs} if sizes is None else {f"m{i}": m for i, m in enumerate(sizes)}
        res = call(GroupedLinearFP8(slots) if sizes is not None else GroupedLinearRunsFP8(slots), x=x, **groups,
                   **{g.weight: w for g, w in zip(gemms, weights)},
                   **{f"bias{i}": b for i, b in enumerate(biases)}, **tensors)
        out = res["out"]                                                            # (tokens, out)
        entries = {k: v for st in steps for k, v in st.entries(res).items()}
    return out.reshape(*inp.shape[:-1], out_features), {**workspace, **entries}
