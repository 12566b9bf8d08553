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


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_backward_in_row_chunks_gives_the_same_bits(normalization, monkeypatch):
    """Eager norm backward makes dx in row chunks (peak memory); each row's math is its own, so the
    chunks (one of them partial) give exactly what one pass gives, per sample under vmap too."""
    import te_func.ops.normalization as normalization_module
    cfg = NormConfig(normalization, 1e-5)
    x = (torch.randn(3, 39, 48) * 2 + 0.3).bfloat16()                  # 4 chunks: 10, 10, 10, 9 rows
    weight = (torch.randn(48) * 0.1 + 1).bfloat16()
    bias = None if cfg.rms else torch.randn(48).bfloat16()
    dy = torch.randn(3, 39, 48).bfloat16()

    def grads(x, dy):
        _, mean, rsigma = norm_forward(x, weight, bias, cfg)
        return norm_backward(dy, x, mean, rsigma, weight, cfg)

    whole = [grads(x[i], dy[i]) for i in range(3)]
    whole_vmapped = torch.func.vmap(grads)(x, dy)
    monkeypatch.setattr(normalization_module, "_MIN_ROWS_TO_CHUNK", 16)
    for i in range(3):
        assert all(torch.equal(a, b) for a, b in zip(grads(x[i], dy[i]), whole[i]))
    assert all(torch.equal(a, b) for a, b in zip(torch.func.vmap(grads)(x, dy), whole_vmapped))
    for i in range(3):      # and vmapped equals alone
        assert all(torch.equal(a[i], b) for a, b in zip(whole_vmapped, whole[i]))
