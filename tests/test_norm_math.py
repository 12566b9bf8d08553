"""The fused layers' hand-written norm backward equals autograd of torch's own norms."""
import pytest
import torch

from te_func.ops.normalization import NormConfig, norm_backward, norm_forward, norm_reference


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_forward_and_backward_match_autograd_in_float64(normalization, zero_centered_gamma):
    cfg = NormConfig(normalization, 1e-5, zero_centered_gamma)
    x = torch.randn(24, 40, dtype=torch.float64) * 3 + 0.5
    weight = torch.randn(40, dtype=torch.float64)
    bias = None if cfg.rms else torch.randn(40, dtype=torch.float64)
    dy = torch.randn(24, 40, dtype=torch.float64)

    y, mean, rsigma = norm_forward(x, weight, bias, cfg)
    dx, dw, db = norm_backward(dy, x, mean, rsigma, weight, cfg)

    inputs = (x, weight) if bias is None else (x, weight, bias)
    ref_y, vjp = torch.func.vjp(lambda x, w, *b: norm_reference(x, w, b[0] if b else None, cfg), *inputs)
    ref = vjp(dy)
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dw, ref[1], rtol=1e-10, atol=1e-10)
    if bias is not None:
        torch.testing.assert_close(db, ref[2], rtol=1e-10, atol=1e-10)
