"""Checks and workspace plumbing shared by the per-op functions."""
from __future__ import annotations

import torch

from ..quant import DelayedState, Quantizer, delayed_update, quantize_weight, scheme_for
from ..recipe import DelayedScaling

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_input(layer: str, inp: torch.Tensor, features: int, params: dict[str, torch.Tensor | None],
                recipe=None):
    """Clear errors for the misuses a layer can see from its arguments' metadata.

    High precision (recipe None) also takes float64, as the plain torch layer does.
    """
    dtypes = FLOAT_DTYPES if recipe is not None else FLOAT_DTYPES + (torch.float64,)
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{layer}: input must be a torch.Tensor, got {type(inp).__name__}")
    if inp.dim() < 1 or inp.shape[-1] != features:
        raise ValueError(f"{layer}: input's last dim must be in_features={features}, got input of shape "
                         f"{tuple(inp.shape)}; reshape the input or build the layer with "
                         f"in_features={inp.shape[-1] if inp.dim() else '?'}")
    if inp.dtype not in dtypes:
        raise TypeError(f"{layer}: input dtype {inp.dtype} is not supported; use float32, bfloat16 or "
                        f"float16 (cast with inp.to(torch.bfloat16))")
    for name, p in params.items():
        if p is None:
            continue
        if p.dtype not in dtypes:
            raise TypeError(f"{layer}: parameter {name} has dtype {p.dtype}; use float32, bfloat16 or "
                            f"float16 (params_dtype=...)")
        if p.device != inp.device:
            raise ValueError(f"{layer}: input is on {inp.device} but parameter {name} is on {p.device}; "
                             f"move one of them (model.to(device) or inp.to(device))")
    if _check_finite:
        _assert_finite(layer, {"input": inp, **params})


# Off by default: the check reads every input and parameter and waits for the
# device. An inf would otherwise not stay visible: the FP8 casts saturate it
# to the format's max, as TE does, and the output looks plausible.
_check_finite = False


def set_check_finite(enabled: bool) -> bool:
    """Make every te_func layer raise on a NaN or inf in its input or parameters
    (eager calls; compiled and vmapped calls skip the check). Returns the previous setting."""
    global _check_finite
    previous, _check_finite = _check_finite, bool(enabled)
    return previous


def _assert_finite(layer: str, tensors: dict):
    if torch.compiler.is_compiling():
        return
    for name, t in tensors.items():
        if t is None:
            continue
        try:
            finite = bool(torch.isfinite(t).all())
        except RuntimeError:   # under vmap a batched tensor has no single truth value
            continue
        if not finite:
            bad = (~torch.isfinite(t)).sum().item()
            raise ValueError(f"{layer}: {name} holds {bad} non-finite value(s) (NaN or inf) out of "
                             f"{t.numel()}; find where they come from (te_func.set_check_finite(False) "
                             f"turns this check off)")


def sub(workspace: dict | None, prefix: str) -> dict | None:
    """The entries of `workspace` under `prefix.`, with the prefix stripped."""
    if workspace is None:
        return None
    p = prefix + "."
    return {k[len(p):]: v for k, v in workspace.items() if k.startswith(p)}


def prefixed(workspace: dict, prefix: str) -> dict:
    return {f"{prefix}.{k}": v for k, v in workspace.items()}


def cast_weight(name: str, weight, recipe, workspace, is_first_microbatch, *, state: DelayedState | None = None):
    """Quantize (or fetch from cache) the layer parameter `name`; returns (WeightCast, entries).

    Under DelayedScaling pass the weight's `state` for this step (from
    `step_states`); entries then also hold it as `{name}_amax_history` /
    `{name}_scale`, with the weight's amax recorded unless the cast was a cache hit.
    """
    cast, entries = quantize_weight(weight, Quantizer(recipe, "weight"), sub(workspace, f"{name}_cast"),
                                    is_first_microbatch, state)
    recorded = entries.pop("amax_history", None)     # only on a fresh cast: a cache hit records nothing
    entries.pop("scale", None)
    entries = prefixed(entries, f"{name}_cast")
    if state is not None:
        history = state.amax_history if recorded is None else recorded
        entries.update(state_entries({name: DelayedState(history, state.scale)}))
    return cast, entries


# --- DelayedScaling state -------------------------------------------------------
# Each quantized tensor of a GEMM has a state named after it, stored as two
# op-local entries `{name}_amax_history` (L,) and `{name}_scale` (). One GEMM
# has three (see state_names): `{prefix}input`, its weight (named like the
# parameter) and `{prefix}grad`; the grad one must end in "grad", which is how
# tef.grad and tef.Stateful find the entries that backward updates.


def state_names(prefix: str = "", weight: str | None = None) -> dict[str, str]:
    """State name -> role for one GEMM: `{prefix}input`, `weight` (default `{prefix}weight`), `{prefix}grad`."""
    return {f"{prefix}input": "input", weight or f"{prefix}weight": "weight", f"{prefix}grad": "grad"}


def starts_step(is_first_microbatch: bool | None) -> bool:
    """A call with is_first_microbatch True or None begins a step: scales update, histories roll.

    Later microbatches of the step (False) quantize with the same scales and
    add their amaxes to the current slot by max.
    """
    return is_first_microbatch is not False


def step_states(recipe, workspace: dict, names: dict[str, str], is_first_microbatch) -> dict | None:
    """Each named state as this call quantizes with it, or None unless `recipe` is DelayedScaling.

    Read from `workspace` and, when the call starts a step, updated and rolled
    (`te_func.quant.delayed_update`). Detached: the only gradient a state
    receives is the grad history's, through the Function's g_sink.
    """
    if not isinstance(recipe, DelayedScaling):
        return None
    states = {}
    for name, role in names.items():
        state = DelayedState(workspace[f"{name}_amax_history"].detach(), workspace[f"{name}_scale"].detach())
        states[name] = delayed_update(state, recipe, role) if starts_step(is_first_microbatch) else state
    return states


def state_entries(states: dict[str, DelayedState] | None) -> dict:
    """Named states back to workspace entries."""
    if not states:
        return {}
    out = {}
    for name, (history, scale) in states.items():
        out[f"{name}_amax_history"], out[f"{name}_scale"] = history, scale
    return out


def grad_sink(workspace: dict, states: dict | None, names: dict[str, str]) -> torch.Tensor | None:
    """The grad history's own workspace entry: the tensor whose gradient carries the backward amax."""
    if states is None:
        return None
    (grad_name,) = [n for n, role in names.items() if role == "grad"]
    return workspace[f"{grad_name}_amax_history"]


def schemes(recipe):
    return scheme_for(recipe, "input"), scheme_for(recipe, "weight"), scheme_for(recipe, "grad")


def needs_weight_grad(weight: torch.Tensor) -> bool:
    """Whether forward must keep what the weight-gradient GEMM reads.

    While dynamo traces torch.func.grad, requires_grad of the differentiated
    tensors reads False, so under compile any grad-enabled call keeps it.
    """
    return torch.is_grad_enabled() and (weight.requires_grad or torch.compiler.is_compiling())


# FP8 pays only where the GEMM outweighs the casts around it: a GEMM moves
# ~(MK + KN + MN) bytes per 2MKN FLOPs, so the ratio 1 / (1/M + 1/K + 1/N)
# (its arithmetic intensity, up to a constant) decides. Below 2048 the casts
# cost more than FP8 saves on an H200 (benchmarks/, docs/benchmarks.md).
_fp8_min_gemm_size = 2048


def gemm_size(m: int, k: int, n: int) -> float:
    """1 / (1/m + 1/k + 1/n) of an (m, k) x (k, n) GEMM: the same for its forward,
    input-gradient and weight-gradient GEMMs (a permutation of m, k, n)."""
    return 1.0 / (1.0 / m + 1.0 / k + 1.0 / n) if m and k and n else 0.0


def set_fp8_min_gemm_size(size: float) -> float:
    """Run GEMMs whose `gemm_size(tokens, in, out)` is below `size` in high precision on CUDA
    devices (0: always FP8). Returns the previous value. CPUs always use the recipe."""
    global _fp8_min_gemm_size
    if not size >= 0:
        raise ValueError(f"set_fp8_min_gemm_size: size must be >= 0, got {size!r}")
    previous, _fp8_min_gemm_size = _fp8_min_gemm_size, size
    return previous


def gemm_recipe(recipe, device: torch.device, tokens: int, in_features: int, out_features: int):
    """`recipe`, or None (high precision) for a GEMM too small for FP8 to pay on a CUDA device."""
    if recipe is None or device.type != "cuda":
        return recipe
    return recipe if gemm_size(tokens, in_features, out_features) >= _fp8_min_gemm_size else None
