"""GroupedLinear's op: one FP8 GEMM per group of tokens (group i through slot i).

Each group's input is quantized on its own, as TE does (one quantizer per GEMM), so the result
equals a loop of Linear layers bit for bit; each has its own DelayedScaling states, and an empty
group records an amax of 0."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .gemm_layer import GemmSlot

__all__ = ["GroupedLinearFP8"]


@dataclass(frozen=True)
class GroupedLinearFP8:
    """inputs: x (tokens, in), m{i} (group i's token count), weight{i} (out, in), bias{i} or None,
    and slot i's tensors (prefix weight{i}.)."""
    slots: tuple[GemmSlot, ...]
    differentiable = ("out",)

    def _splits(self, t) -> list:
        return [t[f"m{i}"] for i in range(len(self.slots))]

    @property
    def outputs(self):
        return ("out", *(k for slot in self.slots for k in slot.outputs))

    @property
    def carried(self):
        return {k: v for slot in self.slots for k, v in slot.carried.items()}

    @property
    def saved(self):
        return tuple(k for slot in self.slots for k in slot.saved)

    @property
    def primals(self):
        return ("x", *(f"{k}{i}" for i in range(len(self.slots)) for k in ("weight", "bias")))

    @property
    def linearization_inputs(self):
        return ("x", *(f"bias{i}" for i in range(len(self.slots))),
                *(k for slot in self.slots for k in slot.linearization_reads))

    def linearized(self, t):
        outs = [slot.linearized(t, xi, t[f"bias{i}"])
                for i, (slot, xi) in enumerate(zip(self.slots, torch.split(t["x"], self._splits(t))))]
        return {"out": torch.cat(outs)}                                          # (tokens, out)

    def forward(self, t):
        outs, state = [], {}
        for i, (slot, xi) in enumerate(zip(self.slots, torch.split(t["x"], self._splits(t)))):
            out, slot_out = slot.forward(t, xi, t[f"bias{i}"])                 # (m_splits[i], out)
            outs.append(out)
            state.update(slot_out)
        return {"out": torch.cat(outs), **state}                                # (tokens, out)

    def backward(self, s, grads, ctx):
        out, dxs = {}, []
        for i, (slot, gi) in enumerate(zip(self.slots, torch.split(grads["out"], self._splits(s)))):
            dx, dw, sink = slot.backward(s, gi, ctx.need["x"], ctx.dtype["x"], ctx)
            dxs.append(dx)
            out.update({f"weight{i}": dw, f"bias{i}": ctx.cast(f"bias{i}", gi.sum(0)), **sink})
        return {"x": torch.cat(dxs) if ctx.need["x"] else None, **out}
