"""Which GEMM runs where: the FP8 size rule, and the GPU paths against the exact fp32 emulation."""
import pytest
import torch

import te_func as tef
from te_func.functional import _common
from te_func.gemm import gemm
from te_func.quant import dequantize, quantize_scheme, scheme_for
from te_func.recipe import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling


def test_gemm_size_is_symmetric_and_tracks_the_smallest_dim():
    assert _common.gemm_size(4096, 4096, 4096) == pytest.approx(4096 / 3)
    assert _common.gemm_size(16384, 4096, 14336) == _common.gemm_size(14336, 16384, 4096)
    assert _common.gemm_size(16384, 16, 16384) < 16
    assert _common.gemm_size(0, 64, 64) == 0.0


def test_small_gemms_use_high_precision_on_cuda_only_and_the_threshold_is_overridable():
    r = Float8CurrentScaling()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _common.gemm_recipe(r, cpu, 8, 8, 8) is r               # CPU: always the recipe
    assert _common.gemm_recipe(r, cuda, 4096, 2048, 8192) is None  # size ~1170 < 2048
    assert _common.gemm_recipe(r, cuda, 16384, 4096, 14336) is r   # size ~2667
    assert _common.gemm_recipe(None, cuda, 16384, 4096, 14336) is None
    previous = tef.set_fp8_min_gemm_size(0)
    try:
        assert _common.gemm_recipe(r, cuda, 16, 16, 16) is r
    finally:
        assert tef.set_fp8_min_gemm_size(previous) == 0
    with pytest.raises(ValueError, match="size must be >= 0"):
        tef.set_fp8_min_gemm_size(-1)


def _pair(recipe, m, k, n, device, b_role="weight"):
    a = torch.randn(m, k, device=device)
    b = torch.randn(n, k, device=device)
    aq, _ = quantize_scheme(a, scheme_for(recipe, "input"))
    bq, _ = quantize_scheme(b, scheme_for(recipe, b_role))
    return aq, bq


@pytest.mark.cuda
@pytest.mark.parametrize("recipe, b_role", [(Float8BlockScaling(), "weight"), (Float8BlockScaling(), "input"),
                                            (MXFP8BlockScaling(), "weight")])
def test_gpu_block_gemms_agree_with_the_fp32_emulation(cuda, recipe, b_role):
    # 1x128 x 128x128 (forward, dgrad) and 1x128 x 1x128 (wgrad) run in cuBLAS on
    # Hopper; MXFP8 runs a bf16 GEMM on exactly dequantized operands. Both equal the
    # fp32 emulation up to accumulation order: measured rel. error ~1e-4 (bf16-out
    # rounding is 2**-9 = 2e-3), so 4e-3 is the bound.
    aq, bq = _pair(recipe, 512, 1024, 384, cuda, b_role)
    ref = dequantize(aq).double() @ dequantize(bq).double().t()
    out = gemm(aq, bq, torch.bfloat16).double()
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() < 4e-3
