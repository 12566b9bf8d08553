"""Which GEMM runs where: the GPU paths against the exact fp32 emulation."""
import pytest
import torch

from te_func.gemm import gemm
from te_func.quant import dequantize, quantize_scheme, scheme_for
from te_func.recipe import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling


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
