"""LayerNormMLP's op: norm -> fc1 -> activation -> fc2, every GEMM in FP8.

Backward keeps, as TE: the input, mean and rsigma; the normalized output's FP8 cast along tokens;
fc1's output in high precision (without its bias where the GELU kernel adds it on the way); and
the activation output's FP8 cast along tokens. Each GEMM input is quantized once. Under
DelayedScaling fc1's input is the normalized output and its grad the gradient of fc1's output;
fc2's input is the activation output and its grad the layer's output gradient."""
from __future__ import annotations

from dataclasses import dataclass

from .activations import Activation, activation_grad_with_sums, activation_reference, activation_with_amax
from .gemm_layer import GemmSlot
from .normalization import NormConfig, norm_backward, norm_output, norm_reference

__all__ = ["LayerNormMLPFP8"]


@dataclass(frozen=True)
class LayerNormMLPFP8:
    """inputs: x (tokens, hidden), ln_weight, ln_bias, fc1_weight (fc1 width, hidden), fc1_bias,
    fc2_weight (hidden, ffn), fc2_bias, and the tensors of slots fc1 and fc2."""
    fc1: GemmSlot
    fc2: GemmSlot
    norm: NormConfig
    activation: Activation
    differentiable = ("out", "ln_out")
    primals = ("x", "ln_weight", "ln_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")

    @property
    def outputs(self):
        return ("out", "ln_out", "mean", "rsigma", "fc1_out", "fc1_bias_pending", *self.fc1.outputs,
                *self.fc2.outputs)

    @property
    def carried(self):
        return {**self.fc1.carried, **self.fc2.carried}

    @property
    def saved(self):
        return ("x", "ln_weight", "mean", "rsigma", "fc1_out", "fc1_bias_pending", *self.fc1.saved,
                *self.fc2.saved)

    @property
    def linearization_inputs(self):
        return ("x", "ln_weight", "ln_bias", "fc1_bias", "fc2_bias", *self.fc1.linearization_reads,
                *self.fc2.linearization_reads)

    def linearized(self, t):
        ln_out = norm_reference(t["x"], t["ln_weight"], t["ln_bias"], self.norm)          # (tokens, hidden)
        act = activation_reference(self.activation, self.fc1.linearized(t, ln_out, t["fc1_bias"]))
        return {"out": self.fc2.linearized(t, act, t["fc2_bias"]), "ln_out": ln_out}

    def forward(self, t):
        x = t["x"]
        ln_out, mean, rsigma, ln_amax = norm_output(x, t["ln_weight"], t["ln_bias"], self.norm)  # (tokens, hidden)
        fc1_out, fc1_state = self.fc1.forward(t, ln_out, None, ln_amax)  # (tokens, fc1 width), bias: next line
        act_out, act_amax, fc1_out, pending = activation_with_amax(self.activation, fc1_out, t["fc1_bias"],
                                                                   self.fc2.input_cast_takes_partials)
        out, fc2_state = self.fc2.forward(t, act_out, t["fc2_bias"], act_amax)  # (tokens, hidden)
        if pending is not None:
            pending = pending.view_as(pending)      # a view: a Function may not save an input it returns as is
        return {"out": out, "ln_out": ln_out, "mean": mean, "rsigma": rsigma, "fc1_out": fc1_out,
                "fc1_bias_pending": pending, **fc1_state, **fc2_state}

    def backward(self, s, grads, ctx):
        g, need = grads["out"], ctx.need
        need_dln = need["x"] or need["ln_weight"] or need["ln_bias"]
        need_dfc1 = need_dln or need["fc1_weight"] or need["fc1_bias"]
        dact, dw2, sink2 = self.fc2.backward(s, g, need_dfc1, ctx.dtype["x"], ctx)
        out = {"fc2_weight": dw2, "fc2_bias": ctx.cast("fc2_bias", g.sum(0)), **sink2}
        if not need_dfc1:
            return out
        dfc1, dfc1_amax, dfc1_sum = activation_grad_with_sums(self.activation, dact, s["fc1_out"], need["fc1_bias"],
                                                              s["fc1_bias_pending"])   # (tokens, fc1 width)
        # The (tokens, ffn) gradients go as soon as they are used (eager's peak memory).
        del dact
        out["fc1_bias"] = ctx.cast("fc1_bias", dfc1_sum)
        casts = self.fc1.backward_cast(s, dfc1, need_dln, ctx, dfc1_amax)
        del dfc1
        dln, dw1, sink1 = self.fc1.backward_gemms(s, casts, ctx.dtype["x"], ctx)
        del casts
        out.update(fc1_weight=dw1, **sink1)
        if need_dln:
            if grads["ln_out"] is not None:     # return_layernorm_output: TE adds its gradient
                dln = dln + grads["ln_out"]
            dx, dlnw, dlnb = norm_backward(dln, s["x"], s["mean"], s["rsigma"], s["ln_weight"], self.norm)
            out.update(x=dx, ln_weight=ctx.cast("ln_weight", dlnw), ln_bias=ctx.cast("ln_bias", dlnb))
        return out
