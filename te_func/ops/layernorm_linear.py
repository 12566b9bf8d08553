"""LayerNormLinear's op: norm, then an FP8 GEMM.

The normalized output is quantized once (both copies) and kept for backward only as its cast
along tokens; the norm backward reads the input, mean and rsigma, as in TE."""
from __future__ import annotations

from dataclasses import dataclass

from .gemm_layer import GemmSlot
from .normalization import NormConfig, norm_backward, norm_output, norm_reference

__all__ = ["LayerNormLinearFP8"]


@dataclass(frozen=True)
class LayerNormLinearFP8:
    """inputs: x (tokens, in), ln_weight, ln_bias (in,) or None, weight (out, in), bias, the slot's tensors."""
    gemm: GemmSlot
    norm: NormConfig
    differentiable = ("out", "ln_out")
    primals = ("x", "ln_weight", "ln_bias", "weight", "bias")

    @property
    def outputs(self):
        return ("out", "ln_out", "mean", "rsigma", *self.gemm.outputs)

    @property
    def carried(self):
        return self.gemm.carried

    @property
    def saved(self):
        return ("x", "ln_weight", "mean", "rsigma", *self.gemm.saved)

    @property
    def linearization_inputs(self):
        return ("x", "ln_weight", "ln_bias", "bias", *self.gemm.linearization_reads)

    def linearized(self, t):
        ln_out = norm_reference(t["x"], t["ln_weight"], t["ln_bias"], self.norm)        # (tokens, in)
        return {"out": self.gemm.linearized(t, ln_out, t["bias"]), "ln_out": ln_out}

    def forward(self, t):
        x = t["x"]
        ln_out, mean, rsigma, ln_amax = norm_output(x, t["ln_weight"], t["ln_bias"], self.norm)  # (tokens, in)
        out, gemm_out = self.gemm.forward(t, ln_out, t["bias"], ln_amax)  # (tokens, out)
        return {"out": out, "ln_out": ln_out, "mean": mean, "rsigma": rsigma, **gemm_out}

    def backward(self, s, grads, ctx):
        g = grads["out"]
        need_dln = ctx.need["x"] or ctx.need["ln_weight"] or ctx.need["ln_bias"]
        dln, dw, sink = self.gemm.backward(s, g, need_dln, ctx.dtype["x"], ctx)
        out = {"weight": dw, "bias": ctx.cast("bias", g.sum(0)), **sink}
        if need_dln:
            if grads["ln_out"] is not None:     # return_layernorm_output: TE adds its gradient
                dln = dln + grads["ln_out"]
            dx, dlnw, dlnb = norm_backward(dln, s["x"], s["mean"], s["rsigma"], s["ln_weight"], self.norm)
            out.update(x=dx, ln_weight=ctx.cast("ln_weight", dlnw), ln_bias=ctx.cast("ln_bias", dlnb))
        return out
