"""TE's MLP activations, forward and backward, as plain tensor functions.

Gated ones (geglu, qgeglu, reglu, sreglu, swiglu) take fc1's output of width
2 * ffn and compute act(first half) * second half. As in TE the math runs
in fp32 (float64 stays float64); the result is in the input's dtype.
The derivatives are written out so that LayerNormMLP's backward needs only
fc1's output, which it keeps.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "is_gated", "check_activation", "activation_forward", "activation_backward",
           "activation_reference"]

_K = math.sqrt(2.0 / math.pi)   # tanh approximation of gelu


def _gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(_K * (x + 0.044715 * x ** 3)))


def _dgelu(x):
    t = torch.tanh(_K * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _K * (1.0 + 3 * 0.044715 * x * x)


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _dqgelu(x):
    s = torch.sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1.0 - s)


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


# name -> (function, derivative, gated)
_TABLE = {
    "gelu": (_gelu, _dgelu, False), "geglu": (_gelu, _dgelu, True),
    "qgelu": (_qgelu, _dqgelu, False), "qgeglu": (_qgelu, _dqgelu, True),
    "relu": (_relu, _drelu, False), "reglu": (_relu, _drelu, True),
    "srelu": (_srelu, _dsrelu, False), "sreglu": (_srelu, _dsrelu, True),
    "silu": (_silu, _dsilu, False), "swiglu": (_silu, _dsilu, True),
}
ACTIVATIONS = tuple(_TABLE)


def check_activation(activation: str, layer: str = "LayerNormMLP") -> str:
    if activation not in _TABLE:
        raise ValueError(f"{layer}: unknown activation {activation!r}; TE's activations are "
                         f"{', '.join(ACTIVATIONS)}")
    return activation


def is_gated(activation: str) -> bool:
    return _TABLE[check_activation(activation)][2]


def _compute_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


def activation_forward(activation: str, x: torch.Tensor) -> torch.Tensor:
    """x (tokens, ffn), or (tokens, 2 * ffn) when gated -> (tokens, ffn), x's dtype."""
    fn, _, gated = _TABLE[check_activation(activation)]
    xf = x.to(_compute_dtype(x))
    if gated:
        a, gate = xf.chunk(2, dim=-1)
        return (fn(a) * gate).to(x.dtype)
    return fn(xf).to(x.dtype)


# torch's own fused activations for gelu and relu: one kernel, and autograd keeps
# only the input, where gelu's formula above keeps six intermediates. (F.silu is
# left out: its eager backward and torch.func.grad's differ in the last bit.)
_gelu_tanh = lambda x: F.gelu(x, approximate="tanh")  # noqa: E731
_TORCH = {"gelu": _gelu_tanh, "geglu": _gelu_tanh, "relu": F.relu, "reglu": F.relu}


def activation_reference(activation: str, x: torch.Tensor) -> torch.Tensor:
    """The activation as plain torch computes it, for the high-precision path that
    autograd differentiates: torch's function where it has one, else the formula."""
    torch_fn = _TORCH.get(activation)
    if torch_fn is None:
        return activation_forward(activation, x)
    if is_gated(activation):
        a, gate = x.chunk(2, dim=-1)
        return torch_fn(a) * gate
    return torch_fn(x)


def activation_backward(activation: str, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dy (tokens, ffn), x = the forward's input -> dx of x's shape and dtype."""
    fn, dfn, gated = _TABLE[check_activation(activation)]
    ct = _compute_dtype(x)
    xf, dy = x.to(ct), dy.to(ct)
    if gated:
        a, gate = xf.chunk(2, dim=-1)
        return torch.cat([dy * gate * dfn(a), dy * fn(a)], dim=-1).to(x.dtype)
    return (dy * dfn(xf)).to(x.dtype)
