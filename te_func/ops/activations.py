"""TE's MLP activations, forward and backward, as plain tensor functions.

Gated ones take fc1's output of width 2 * ffn and compute act(first half) * gate(second half),
the gate the identity but for clamped_swiglu (TE's glu is not torch's F.glu, which is the other
way round). The math runs in fp32 (float64 stays); derivatives are written out so that
backward needs only fc1's output. `Activation` holds TE's `activation_params`, frozen so that
an op holding it stays hashable."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import kernels

__all__ = ["ACTIVATIONS", "Activation", "is_gated", "check_activation", "activation_spec", "activation_forward",
           "activation_backward", "activation_reference", "activation_with_amax", "activation_grad_with_sums"]

_K = math.sqrt(2.0 / math.pi)   # tanh approximation of gelu


def _gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(_K * (x + 0.044715 * x ** 3)))


def _dgelu(x):
    t = torch.tanh(_K * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _K * (1.0 + 3 * 0.044715 * x * x)


def _qgelu(x, alpha=1.702):
    return x * torch.sigmoid(alpha * x)


def _dqgelu(x, alpha=1.702):
    s = torch.sigmoid(alpha * x)
    return s + alpha * x * s * (1.0 - s)


def _relu(x):
    return torch.clamp(x, min=0)


def _drelu(x):
    return (x > 0).to(x.dtype)


def _srelu(x):
    return torch.clamp(x, min=0).square()


def _dsrelu(x):
    return 2.0 * torch.clamp(x, min=0)


def _silu(x):
    return x * torch.sigmoid(x)


def _dsilu(x):
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _dsigmoid(x):
    s = torch.sigmoid(x)
    return s * (1.0 - s)


# clamped_swiglu (GPT-OSS's): the activated half clamped from above through qgelu with `alpha`, the
# gate clamped to [-limit, limit] and offset; an active clamp's derivative is 0 (TE tests `<= limit`).
def _clamped_silu(x, limit, alpha, glu_linear_offset):
    return _qgelu(torch.clamp(x, max=limit), alpha)


def _clamped_dsilu(x, limit, alpha, glu_linear_offset):
    return torch.where(x <= limit, _dqgelu(torch.clamp(x, max=limit), alpha), 0.0)


def _clamped_gate(g, limit, alpha, glu_linear_offset):
    return torch.clamp(g, -limit, limit) + glu_linear_offset


def _clamped_dgate(g, limit, alpha, glu_linear_offset):
    return ((g >= -limit) & (g <= limit)).to(g.dtype)


class _Kind(NamedTuple):
    fn: Callable
    dfn: Callable
    gated: bool
    params: dict | None = None      # the activation_params it takes, with TE's defaults
    gate: Callable | None = None    # the gate half's transform (None: the identity)
    dgate: Callable | None = None


_CLAMPED = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}

_TABLE = {
    "gelu": _Kind(_gelu, _dgelu, False), "geglu": _Kind(_gelu, _dgelu, True),
    "glu": _Kind(torch.sigmoid, _dsigmoid, True),
    "qgelu": _Kind(_qgelu, _dqgelu, False), "qgeglu": _Kind(_qgelu, _dqgelu, True),
    "relu": _Kind(_relu, _drelu, False), "reglu": _Kind(_relu, _drelu, True),
    "srelu": _Kind(_srelu, _dsrelu, False), "sreglu": _Kind(_srelu, _dsrelu, True),
    "silu": _Kind(_silu, _dsilu, False), "swiglu": _Kind(_silu, _dsilu, True),
    "clamped_swiglu": _Kind(_clamped_silu, _clamped_dsilu, True, _CLAMPED, _clamped_gate, _clamped_dgate),
}
ACTIVATIONS = tuple(_TABLE)


@dataclass(frozen=True)
class Activation:
    """An activation and its parameters (name, value) pairs, TE's defaults filled in."""
    name: str
    params: tuple[tuple[str, float], ...] = ()

    @property
    def kwargs(self) -> dict:
        return dict(self.params)


def check_activation(activation: str, layer: str = "LayerNormMLP") -> str:
    if activation not in _TABLE:
        raise ValueError(f"{layer}: unknown activation {activation!r}; TE's activations are "
                         f"{', '.join(ACTIVATIONS)}")
    return activation


def activation_spec(activation: str, activation_params: dict | None = None,
                    layer: str = "LayerNormMLP") -> Activation:
    """`activation` with `activation_params` checked against what it takes (TE's defaults for the rest)."""
    kind = _TABLE[check_activation(activation, layer)]
    given = dict(activation_params or {})
    accepted = kind.params or {}
    unknown = sorted(given.keys() - accepted.keys())
    if unknown:
        takes = f"takes only {', '.join(accepted)}" if accepted else "takes no activation_params"
        raise ValueError(f"{layer}: activation {activation!r} {takes}; got {', '.join(map(repr, unknown))}")
    params = {**accepted, **given}
    for k, v in params.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{layer}: activation_params[{k!r}] must be a finite number, got {v!r}")
    if "limit" in params and params["limit"] <= 0:
        raise ValueError(f"{layer}: activation_params['limit'] must be positive, got {params['limit']!r}")
    return Activation(activation, tuple((k, float(v)) for k, v in params.items()))


def is_gated(activation: str) -> bool:
    return _TABLE[check_activation(activation)].gated


def _compute_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


# torch's own relu and silu kernels for the FP8 path: one pass each way where the formulas take ten
# eagerly; fp32 math rounded once, so equal to fp32 rounding (float64 keeps the formulas).
class _Fused(NamedTuple):
    fn: Callable        # x -> act(x)
    dfn: Callable       # (dy, x) -> dy * act'(x)


def _relu_backward(dy, x):
    # exact in dy's dtype; NaN * 0 stays NaN, as in the formula (a `where` would drop it)
    return dy * (x > 0).to(dy.dtype)


_RELU = _Fused(F.relu, _relu_backward)
_SILU = _Fused(F.silu, torch.ops.aten.silu_backward)
# Not the GELU: its formulas fuse into the casts under inductor (docs/benchmarks.md), and eagerly
# te_func.kernels computes them in one pass.
_FUSED = {"relu": _RELU, "reglu": _RELU, "silu": _SILU, "swiglu": _SILU}


def _fused(act: Activation, x: torch.Tensor) -> _Fused | None:
    return None if x.dtype == torch.float64 else _FUSED.get(act.name)


def _formulas(act: Activation) -> _Fused:
    kind, p = _TABLE[act.name], act.kwargs
    return _Fused(lambda a: kind.fn(a, **p), lambda dy, a: dy * kind.dfn(a, **p))


def _kernels(act: Activation, x: torch.Tensor) -> _Fused:
    """(act, dy * act') for x: torch's kernels where they apply, else the formulas."""
    return _fused(act, x) or _formulas(act)


def activation_forward(act: Activation, x: torch.Tensor) -> torch.Tensor:
    """x (tokens, ffn), or (tokens, 2 * ffn) when gated -> (tokens, ffn), x's dtype."""
    return _forward(act, x, _kernels(act, x))


def _forward(act: Activation, x: torch.Tensor, k: _Fused) -> torch.Tensor:
    kind, p = _TABLE[act.name], act.kwargs
    if not kind.gated and k is _fused(act, x):
        return k.fn(x)              # torch's kernel: fp32 inside for a bf16 / fp16 x, one rounding
    xf = x.to(_compute_dtype(x))
    if kind.gated:
        a, gate = xf.chunk(2, dim=-1)
        if kind.gate is not None:
            gate = kind.gate(gate, **p)
        return (k.fn(a) * gate).to(x.dtype)
    return k.fn(xf).to(x.dtype)


# torch's own functions for the high-precision path: gelu and relu keep only their input for
# backward (F.silu not: its eager and torch.func.grad backwards differ in the last bit).
def _torch_gelu(x):
    return F.gelu(x, approximate="tanh")


_TORCH = {"gelu": _torch_gelu, "geglu": _torch_gelu, "relu": F.relu, "reglu": F.relu}


def activation_reference(act: Activation, x: torch.Tensor) -> torch.Tensor:
    """The activation in plain torch, for the high-precision path: torch's function, else the formula."""
    torch_fn = _TORCH.get(act.name)
    if torch_fn is None:
        return _forward(act, x, _formulas(act))     # autograd differentiates the formula
    if is_gated(act.name):
        a, gate = x.chunk(2, dim=-1)
        return torch_fn(a) * gate
    return torch_fn(x)


def activation_backward(act: Activation, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dy (tokens, ffn), x = the forward's input -> dx of x's shape and dtype."""
    kind, p, k = _TABLE[act.name], act.kwargs, _kernels(act, x)
    if not kind.gated and k is _fused(act, x) and dy.dtype == x.dtype:
        return k.dfn(dy, x)         # torch's kernel: fp32 inside, one rounding
    ct = _compute_dtype(x)
    xf, dy = x.to(ct), dy.to(ct)
    if kind.gated:
        a, g = xf.chunk(2, dim=-1)
        gate, dgate = (g, 1.0) if kind.gate is None or kind.dgate is None else (kind.gate(g, **p), kind.dgate(g, **p))
        return torch.cat([k.dfn(dy * gate, a), dy * k.fn(a) * dgate], dim=-1).to(x.dtype)
    return k.dfn(dy, xf).to(x.dtype)


# The FP8 path's GELU and gradient by te_func.kernels (eager CUDA), with the amax (and fc1's bias
# gradient) taken in the same pass, as TE's fused activation kernels do.
_KERNELS = {"gelu": ("gelu", "gelu_backward")}


def activation_with_amax(act: Activation, x: torch.Tensor, bias: torch.Tensor | None = None,
                         partials: bool = False):
    """`activation_forward(act, x + bias)` -> (out; max |out| where a kernel made it, else None; and
    (x, bias) as `activation_grad_with_sums` reads them back: bias None unless the kernel added it).
    partials: under torch.compile a small out comes with its tiles' maxes (P,) instead, which the
    current-scaling cast after it reduces itself."""
    bias = None if bias is None else bias.to(x.dtype)
    if act.name in _KERNELS:
        fused = kernels.activation(x, _KERNELS[act.name][0], bias=bias)
        if fused is None and partials and act.name == "gelu":
            fused = kernels.gelu_partials(x, bias)
        if fused is not None:
            return *fused[:2], x, bias
    if bias is not None:
        x = x + bias
    return activation_forward(act, x), None, x, None


def activation_grad_with_sums(act: Activation, dy: torch.Tensor, x: torch.Tensor, column_sums: bool,
                              bias: torch.Tensor | None = None):
    """`activation_backward(act, dy, x + bias)` -> (g, max |g| where a kernel made it, g.sum(0) or
    None); x, bias as `activation_with_amax` returned them."""
    if act.name in _KERNELS and dy.dtype == x.dtype:
        fused = kernels.activation(dy, _KERNELS[act.name][1], x, column_sums, bias)
        if fused is not None:
            return fused
    if bias is not None:
        x = x + bias
    g = activation_backward(act, dy, x)
    return g, None, g.sum(0) if column_sums else None
