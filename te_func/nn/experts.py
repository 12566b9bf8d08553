"""`te_func.nn.Experts`: transformers' experts (one 3-D parameter per projection) as a te_func layer."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..functional.experts import expert_gemms, experts
from ..quant import Gemm
from .module import TEModule, make_param, te_init

__all__ = ["Experts", "apply_gate", "gate"]


def apply_gate(layer: Any, gate_up_out: torch.Tensor) -> torch.Tensor:
    """An experts layer's (Experts', FrozenExperts') gate: its custom one (layer._custom_gate, read
    from the module tef.convert replaced) or transformers' default, act(gate) * up over [gate; up]."""
    if layer._custom_gate is not None:
        return layer._custom_gate(layer, gate_up_out)
    g, up = gate_up_out.chunk(2, dim=-1)
    return layer.act_fn(g) * up


def gate(layer: Any, h: torch.Tensor) -> torch.Tensor:
    """What runs between the two projections: the gate, or the activation alone without one."""
    return apply_gate(layer, h) if layer.has_gate else layer.act_fn(h)


class Experts(TEModule):
    """num_experts expert MLPs whose weights are slices of 3-D parameters, as transformers keeps
    them: `gate_up_proj` (E, 2I, H) ([gate; up] per expert; `up_proj` (E, I, H) where has_gate is
    False), `down_proj` (E, H, I), each (E, in, out) where is_transposed; optional biases
    `{name}_bias` (E, out). forward(hidden_states (tokens, H), top_k_index (tokens, k),
    top_k_weights (tokens, k)) -> (tokens, H), as transformers' experts interface.

    Under a recipe each expert's projections are FP8 GEMMs with their own scales and entries
    (`gate_up_proj{i}`, `down_proj{i}`: TE's one FP8 meta slot per GEMM), run as grouped GEMMs
    over the tokens sorted by expert. Without one, a layer made by `tef.convert` runs the forward
    of the module it replaced (its output bit for bit), and one built here runs one F.linear per
    expert."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, *, act_fn: nn.Module | None = None,
                 has_gate: bool = True, has_bias: bool = False, is_transposed: bool = False, params_dtype=None,
                 device=None):
        super().__init__()
        if min(num_experts, hidden_dim, intermediate_dim) <= 0:
            raise ValueError(f"Experts: num_experts, hidden_dim and intermediate_dim must be positive, got "
                             f"{num_experts}, {hidden_dim}, {intermediate_dim}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        # The attributes transformers' experts forwards read (use_experts_implementation's).
        self.has_gate, self.has_bias, self.is_transposed = has_gate, has_bias, is_transposed
        self.is_concatenated, self.has_post_expert_norm, self._is_expert_parallel = True, False, False
        self.act_fn = nn.SiLU() if act_fn is None else act_fn
        up_out = 2 * intermediate_dim if has_gate else intermediate_dim
        self.up_name = "gate_up_proj" if has_gate else "up_proj"
        projections = ((self.up_name, (up_out, hidden_dim)), ("down_proj", (hidden_dim, intermediate_dim)))
        for name, (out_f, in_f) in projections:
            shape = (num_experts, in_f, out_f) if is_transposed else (num_experts, out_f, in_f)
            self.register_parameter(name, make_param(shape, params_dtype, device, te_init()))
            self.register_parameter(f"{name}_bias", make_param((num_experts, out_f), params_dtype, device)
                                    if has_bias else None)
        # From the module tef.convert replaced: its forward, run where no recipe is, and its own
        # gate where it has one (e.g. interleaved [gate, up] rows), both called as (self, ...).
        self._original_forward = None
        self._custom_gate = None

    def _projections(self) -> tuple[tuple[Gemm, ...], tuple[Gemm, ...]]:
        # Made once (2E GEMMs a call would otherwise build; a trace reads them).
        return self._cached(("projections",), lambda: (expert_gemms(self.up_name, self.num_experts),
                                                       expert_gemms("down_proj", self.num_experts)))

    def gemms(self) -> tuple[Gemm, ...]:
        up, down = self._projections()
        return up + down

    def _gemm_layout(self, param: str) -> torch.Tensor:
        # The parameter with each expert's slice as the GEMM reads it, (E, out, in).
        w = getattr(self, param)
        return w.transpose(-2, -1) if self.is_transposed else w

    def gemm_param(self, name: str) -> str:
        return self.up_name if name.startswith(self.up_name) else "down_proj"

    def gemm_weight(self, name: str, value: torch.Tensor | None = None) -> torch.Tensor:
        param = self.gemm_param(name)
        w = getattr(self, param) if value is None else value
        w = w[int(name[len(param):])]
        return w.t() if self.is_transposed else w

    def _layout(self):
        # Every expert's slice has its parameter's shape less the expert dim: no slicing per call.
        gemms = self.gemms()
        shapes = {p: tuple(self._gemm_layout(p).shape[1:]) for p in (self.up_name, "down_proj")}
        return gemms, tuple(shapes[self.gemm_param(g.weight)] for g in gemms)

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        """[gate; up] -> act(gate) * up, as transformers' default gate; the replaced module's own if it
        had one (transformers' experts forwards call this too)."""
        return apply_gate(self, gate_up_out)

    def _gate(self, h: torch.Tensor) -> torch.Tensor:
        return gate(self, h)

    def _compute(self, hidden_states, top_k_index, top_k_weights, *, recipe, workspace, **kwargs):
        if recipe is None and self._original_forward is not None:
            return self._original_forward(self, hidden_states, top_k_index, top_k_weights), \
                ({} if workspace is None else workspace)
        return experts(hidden_states, top_k_index, top_k_weights, self._gemm_layout(self.up_name),
                       self._gemm_layout("down_proj"), getattr(self, f"{self.up_name}_bias"), self.down_proj_bias,
                       gate=self._gate, names=(self.up_name, "down_proj"), gemms=self._projections(),
                       recipe=recipe, workspace=workspace, **kwargs)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return self._run(self._compute, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, has_gate={self.has_gate}, has_bias={self.has_bias}, "
                f"is_transposed={self.is_transposed}")
