"""LayerNorm and RMSNorm: the one implementation of the norm math.

`norm_forward` / `norm_backward` are plain tensor functions the fused ops call inside their own
Functions. As in TE the math runs in fp32 (float64 stays) and backward reads the input, mean and
rsigma. Eagerly on a GPU each is one Triton pass (te_func.kernels), equal to fp32 rounding.
`norm_reference` is the same function in plain torch ops, which autograd differentiates: the
standalone norms and every high-precision path."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import _compat, kernels

__all__ = ["NormConfig", "norm_forward", "norm_output", "norm_backward", "norm_reference", "NORMALIZATIONS"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass(frozen=True)
class NormConfig:
    """Static (hashable) description of a norm: a constant for torch.compile."""
    normalization: str = "LayerNorm"
    eps: float = 1e-5
    # The stored weight is gamma - 1 (TE's zero_centered_gamma): y = x_hat * (1 + weight) + bias.
    zero_centered_gamma: bool = False

    def __post_init__(self):
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")

    @property
    def rms(self) -> bool:
        return self.normalization == "RMSNorm"


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _gamma(weight: torch.Tensor, cfg: NormConfig, dtype: torch.dtype) -> torch.Tensor:
    # 1 + weight in fp32: bf16 would round away the offsets zero_centered_gamma keeps.
    gamma = weight.to(dtype)
    return gamma + 1 if cfg.zero_centered_gamma else gamma


def norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: NormConfig):
    """x (tokens, hidden) -> (y (tokens, hidden) in fp32, mean (tokens, 1) or None for RMSNorm, rsigma (tokens, 1))."""
    xf = x.to(_compute_dtype(x))
    if cfg.rms:
        mean = None
        rsigma = torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.eps)
        x_hat = xf * rsigma
    else:
        mean = xf.mean(-1, keepdim=True)
        centered = xf - mean
        rsigma = torch.rsqrt(centered.square().mean(-1, keepdim=True) + cfg.eps)
        x_hat = centered * rsigma
    y = x_hat * _gamma(weight, cfg, xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y, mean, rsigma


def norm_output(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: NormConfig):
    """x (tokens, hidden) -> (y, mean, rsigma, max |y| where the fused kernel took it, else None)."""
    ct = _compute_dtype(x)
    if ct == torch.float32:
        fused = kernels.norm_forward(x, _gamma(weight, cfg, ct), None if bias is None else bias.to(ct), cfg.eps,
                                     cfg.rms)
        if fused is not None:
            return fused
    y, mean, rsigma = norm_forward(x, weight, bias, cfg)
    return y.to(x.dtype), mean, rsigma, None


# The eager norm backward's dx in 4 row chunks from 1024 rows on (fewer: its temporaries are small).
_CHUNKS, _MIN_ROWS_TO_CHUNK = 4, 1024


def norm_backward(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor | None, rsigma: torch.Tensor,
                  weight: torch.Tensor, cfg: NormConfig):
    """dy (tokens, hidden) -> (dx in x's dtype, dweight (hidden,) fp32, dbias (hidden,) fp32)."""
    # For eager's peak memory: dx is made in _CHUNKS row chunks (the same bits: rows are
    # independent), dy enters in its own dtype (promoted inside the kernel). Compiled: one chunk.
    ct = _compute_dtype(x)
    gamma, rows = _gamma(weight, cfg, ct), x.shape[0]
    if ct == torch.float32:
        fused = kernels.norm_backward(dy, x, mean, rsigma, gamma)
        if fused is not None:
            return fused
    x_hat = _normalized(x, mean, rsigma, ct)
    dweight, dbias = (dy * x_hat).sum(0), dy.sum(0, dtype=ct)
    if torch.compiler.is_compiling() or not isinstance(rows, int) or rows < _MIN_ROWS_TO_CHUNK:
        return _norm_dx(dy, x_hat, gamma, rsigma, mean is not None).to(x.dtype), dweight, dbias
    del x_hat       # each chunk makes its rows' own
    step = -(-rows // _CHUNKS)
    part = lambda t, i: None if t is None else t[i:i + step]  # noqa: E731
    chunks = [_norm_dx(dy[i:i + step], _normalized(x[i:i + step], part(mean, i), part(rsigma, i), ct), gamma,
                       part(rsigma, i), mean is not None).to(x.dtype) for i in range(0, rows, step)]
    return torch.cat(chunks), dweight, dbias


def _normalized(x, mean, rsigma, ct):
    return (x.to(ct) if mean is None else x.to(ct) - mean) * rsigma


def _norm_dx(dy, x_hat, gamma, rsigma, centered: bool) -> torch.Tensor:
    """dx in fp32 for these rows. In-place updates only on `inner`, a fresh tensor that depends on
    every input (so batched under vmap if any of them is)."""
    dx_hat = dy * gamma
    # d/dx of x_hat: remove the components along x_hat (and, for LayerNorm, the mean).
    inner = x_hat * (dx_hat * x_hat).mean(-1, keepdim=True)
    inner.neg_().add_(dx_hat)           # dx_hat - x_hat * proj, exactly
    if centered:
        inner.sub_(dx_hat.mean(-1, keepdim=True))
    return inner.mul_(rsigma)


def norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: NormConfig):
    """The same norm in plain torch (autograd differentiates it), in x's dtype: torch's F.layer_norm /
    F.rms_norm on the tensors as they are, so a converted torch norm gives the same bits; with
    zero_centered_gamma, 1 + weight is formed in fp32 and the norm runs there."""
    shape = (x.shape[-1],)
    # torch takes params of x's dtype or fp32; other mixes go the fp32 way below.
    torch_takes = weight.dtype == x.dtype or (weight.dtype == torch.float32 and x.element_size() == 2)
    if not cfg.zero_centered_gamma and torch_takes and (bias is None or bias.dtype == weight.dtype):
        if cfg.rms:
            return F.rms_norm(x, shape, weight, cfg.eps)
        if _compat.forward_over_forward():      # F.layer_norm's second forward derivative is wrong there
            return norm_forward(x, weight, bias, cfg)[0].to(x.dtype)
        return F.layer_norm(x, shape, weight, bias, cfg.eps)
    ct = _compute_dtype(x)
    gamma = _gamma(weight, cfg, ct)
    if cfg.rms:
        y = F.rms_norm(x.to(ct), shape, gamma, cfg.eps)
    elif _compat.forward_over_forward():
        y = norm_forward(x.to(ct), weight, bias, cfg)[0]
    else:
        y = F.layer_norm(x.to(ct), shape, gamma, None if bias is None else bias.to(ct), cfg.eps)
    return y.to(x.dtype)
