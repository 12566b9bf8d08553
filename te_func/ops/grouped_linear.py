"""GroupedLinear's op: one FP8 GEMM per group of tokens (group i through slot i).

Each group's input is quantized on its own, as TE does (one quantizer per GEMM), so the result
equals a loop of Linear layers bit for bit; each has its own DelayedScaling states, and an empty
group records an amax of 0."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..gemm import grouped_gemm
from ..quant import cast_runs, record_run_amaxes, run_amaxes, run_ids, scale_from_amax
from .gemm_layer import GemmSlot

__all__ = ["GroupedLinearFP8", "GroupedLinearRunsFP8"]


def _linearized(slots, t: dict, sizes) -> dict:
    """Each group's slot linearized on its rows: (tokens, out)."""
    outs = [slot.linearized(t, xi, t[f"bias{i}"])
            for i, (slot, xi) in enumerate(zip(slots, torch.split(t["x"], sizes)))]
    return {"out": torch.cat(outs)}


@dataclass(frozen=True)
class GroupedLinearFP8:
    """inputs: x (tokens, in), m{i} (group i's token count), slot i's weight (out, in) under its
    GEMM's name (`weight{i}`; te_func.nn.Experts' `down_proj{i}`), bias{i} or None, and slot i's
    tensors (that name's prefix)."""
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
        return ("x", *(n for i, slot in enumerate(self.slots) for n in (slot.weight, f"bias{i}")))

    @property
    def linearization_inputs(self):
        return ("x", *(f"bias{i}" for i in range(len(self.slots))),
                *(k for slot in self.slots for k in slot.linearization_reads))

    def linearized(self, t):
        return _linearized(self.slots, t, self._splits(t))

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
            out.update({slot.weight: dw, f"bias{i}": ctx.cast(f"bias{i}", gi.sum(0)), **sink})
        return {"x": torch.cat(dxs) if ctx.need["x"] else None, **out}


@dataclass(frozen=True)
class GroupedLinearRunsFP8:
    """GroupedLinear with its groups' token counts on the device (`offs`, the groups' ends, int32):
    no host sync, one grouped FP8 GEMM per direction (te_func.gemm's grouped GEMM), each group still
    quantized on its own scale as TE's one quantizer per GEMM: the casts, states and GEMMs of
    GroupedLinearFP8 (bit for bit where a loop of GEMMs runs; the bias gradients are summed in
    fp32 in another order). Tensor-wise schemes (current and delayed scaling) without
    backward_override; the slots share one config.
    inputs: x (tokens, in), offs (G,), each slot's weight, bias{i} (all or none), slot i's tensors."""
    slots: tuple[GemmSlot, ...]
    differentiable = ("out",)

    @property
    def outputs(self):
        return ("out", "x_t", "x_t_scale_inv", *(k for slot in self.slots for k in slot.outputs))

    @property
    def carried(self):
        return {k: v for slot in self.slots for k, v in slot.carried.items()}

    @property
    def saved(self):
        names = ("w_t", "w_t_scale_inv", "g_record", "g_scale")
        return ("offs", "x_t", "x_t_scale_inv", *(slot._n(k) for slot in self.slots for k in names))

    @property
    def primals(self):
        return ("x", *(n for i, slot in enumerate(self.slots) for n in (slot.weight, f"bias{i}")))

    @property
    def linearization_inputs(self):
        return ("x", "offs", *(f"bias{i}" for i in range(len(self.slots))),
                *(k for slot in self.slots for k in slot.linearization_reads))

    def _stack(self, t: dict, name: str) -> torch.Tensor:
        return torch.stack([t[slot._n(name)] for slot in self.slots])

    def _biases(self, t: dict) -> torch.Tensor | None:
        biases = [t[f"bias{i}"] for i in range(len(self.slots))]
        return None if biases[0] is None else torch.stack(biases)

    def linearized(self, t):
        # Forward-mode and higher derivatives (rare paths): the groups' sizes read on the host.
        return _linearized(self.slots, t, torch.diff(t["offs"], prepend=t["offs"].new_zeros(1)).tolist())

    def _scales(self, t: dict, s, amaxes: torch.Tensor, role: str):
        """The runs' scales (G,) and new records (G of them, or None): a delayed role's from its
        states, which record the runs' amaxes; a current one's from the amaxes."""
        if s.rule == "delayed":
            records = record_run_amaxes(self._stack(t, f"{role}_record"), amaxes)
            # Each its own tensor: workspace entries share no storage (checkpoints refuse it).
            return self._stack(t, f"{role}_scale"), [r.clone() for r in records.unbind(0)]
        return scale_from_amax(amaxes, s.fp8_max, s.amax_epsilon, s.power_2_scale), None

    def forward(self, t):
        cfg, x, offs = self.slots[0].cfg, t["x"], t["offs"]
        ids = run_ids(offs, x.shape[0])
        scales, records = self._scales(t, cfg.input, run_amaxes(x, ids, len(self.slots)), "x")
        xq, x_scale_inv = cast_runs(x, ids, scales, cfg.input)
        out = grouped_gemm(xq, self._stack(t, "w"), x_scale_inv, self._stack(t, "w_scale_inv"), x.dtype,
                           fast_accum=cfg.fast_accum[0], bias=self._biases(t), offs=offs)
        state = {}
        for i, slot in enumerate(self.slots):
            g_record = t[slot._n("g_record")]
            state[slot._n("new_x_record")] = None if records is None else records[i]
            # a copy: a Function may not return an input as it is
            state[slot._n("new_g_record")] = None if g_record is None else g_record.clone()
        saved = (xq.t().contiguous(), x_scale_inv) if any(sl.cfg.save_input for sl in self.slots) else (None, None)
        return {"out": out, "x_t": saved[0], "x_t_scale_inv": saved[1], **state}

    def backward(self, s, grads, ctx):
        cfg, g, offs, n = self.slots[0].cfg, grads["out"], s["offs"], len(self.slots)
        need_dw = any(ctx.need[slot.weight] for slot in self.slots)
        if need_dw and s["x_t"] is None:
            raise RuntimeError("te_func: a GroupedLinear weight's gradient was requested but the forward ran "
                               "without saving the GEMMs' input (the weights did not require grad then)")
        ids = run_ids(offs, g.shape[0])
        out: dict = {"x": None}
        if any(ctx.need.get(f"bias{i}") for i in range(n)):
            sums = g.new_zeros((n, g.shape[1]), dtype=torch.float32).index_add_(0, ids, g.float())
            out.update({f"bias{i}": ctx.cast(f"bias{i}", sums[i]) for i in range(n)})
        if not (ctx.need["x"] or need_dw):      # as GemmSlot: no cast; a history's sink records nothing
            history = cfg.grad.rule == "delayed" and not ctx.second_order
            return {**out, **{slot._n("g_sink"): torch.zeros_like(s[slot._n("g_record")]) if history else None
                              for slot in self.slots}}
        amaxes = run_amaxes(g, ids, n)
        grad_scheme = cfg.grad
        if grad_scheme.rule == "delayed" and ctx.second_order:
            # As GemmSlot: second-order cotangents scaled from their own amax, recorded nowhere.
            grad_scheme = replace(grad_scheme, rule="current", margin=0)
        if grad_scheme.rule == "delayed":
            scales = self._stack(s, "g_scale")
            # This backward's amaxes in zero histories, as GemmSlot's backward_amax returns them.
            records = record_run_amaxes(torch.zeros_like(self._stack(s, "g_record")), amaxes)
            sinks = {slot._n("g_sink"): r.clone() for slot, r in zip(self.slots, records.unbind(0))}
        else:
            scales = scale_from_amax(amaxes, grad_scheme.fp8_max, grad_scheme.amax_epsilon, grad_scheme.power_2_scale)
            sinks = {slot._n("g_sink"): None for slot in self.slots}
        gq, g_scale_inv = cast_runs(g, ids, scales, grad_scheme)
        if ctx.need["x"]:
            out["x"] = grouped_gemm(gq, self._stack(s, "w_t"), g_scale_inv, self._stack(s, "w_t_scale_inv"),
                                    ctx.dtype["x"], fast_accum=cfg.fast_accum[1], offs=offs)
        if need_dw:
            w_dtype = next(ctx.dtype[slot.weight] for slot in self.slots if ctx.need[slot.weight])
            dw = grouped_gemm(gq.t().contiguous(), s["x_t"], g_scale_inv, s["x_t_scale_inv"], w_dtype,
                              fast_accum=cfg.fast_accum[2], offs=offs)
            out.update({slot.weight: ctx.cast(slot.weight, dw[i]) for i, slot in enumerate(self.slots)})
        return {**out, **sinks}
