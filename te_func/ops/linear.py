"""Linear's op: y = x @ weight.T + bias, every GEMM in FP8.

The input is saved for backward only as its FP8 cast along tokens (what the
weight-gradient GEMM reads), never in high precision.
"""
from __future__ import annotations

from dataclasses import dataclass

from .gemm_layer import GemmSlot

__all__ = ["LinearFP8"]


@dataclass(frozen=True)
class LinearFP8:
    """inputs: x (tokens, in), weight (out, in), bias (out,) or None, and the slot's tensors."""
    gemm: GemmSlot
    differentiable = ("out",)
    primals = ("x", "weight", "bias")

    @property
    def outputs(self):
        return ("out", *self.gemm.outputs)

    @property
    def carried(self):
        return self.gemm.carried

    @property
    def saved(self):
        return self.gemm.saved

    @property
    def linearization_inputs(self):
        return ("x", "bias", *self.gemm.linearization_reads)

    def linearized(self, t):
        return {"out": self.gemm.linearized(t, t["x"], t["bias"])}

    def forward(self, t):
        out, gemm_out = self.gemm.forward(t, t["x"], t["bias"])                # (tokens, out)
        return {"out": out, **gemm_out}

    def backward(self, s, grads, ctx):
        g = grads["out"]                                                        # (tokens, out)
        dx, dw, sink = self.gemm.backward(s, g, ctx.need["x"], ctx.dtype["x"], ctx)
        return {"x": dx, "weight": dw, "bias": ctx.cast("bias", g.sum(0)), **sink}
