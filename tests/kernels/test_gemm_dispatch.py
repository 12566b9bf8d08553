"""Which GEMM runs where: the GPU paths against the exact fp32 emulation."""
import dataclasses

import pytest
import torch

from te_func.gemm import gemm
from te_func.quant import dequantize, quantize_scheme, scheme_for
from te_func.recipe import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling


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


def _fp8(*shape, device="cpu"):
    return torch.randn(*shape, device=device).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling(),
                                    NVFP4BlockScaling()], ids=lambda r: type(r).__name__)
def test_the_bias_is_added_to_the_fp32_product_before_its_one_rounding(recipe):
    """As cuBLAS's epilogue adds it (and TE): not to the output already rounded to bf16."""
    aq, bq = _pair(recipe, 64, 128, 96, "cpu")
    bias = (torch.randn(96) * 3).to(torch.bfloat16)
    got = gemm(aq, bq, torch.bfloat16, bias=bias)
    assert torch.equal(got, (gemm(aq, bq, torch.float32) + bias.float()).to(torch.bfloat16))
    assert not torch.equal(got, gemm(aq, bq, torch.bfloat16) + bias)     # two roundings differ somewhere
    assert torch.equal(gemm(aq, bq, torch.float32, bias=bias), gemm(aq, bq, torch.float32) + bias.float())
    for wrong in (bias[:1], bias[:95], torch.randn(64, 96)):     # would broadcast in the emulation
        with pytest.raises(ValueError, match=r"one value per output column: expected shape \(96,\)"):
            gemm(aq, bq, torch.bfloat16, bias=wrong)


@pytest.mark.parametrize("bias", [None, "shared", "per-sample"])
@pytest.mark.parametrize("shared", [True, False])
def test_scaled_mm_batching_rule(shared, bias):
    """te_func::scaled_mm under vmap, run where torch._scaled_mm runs (CPUs included): samples
    against a shared operand with shared scales (and bias) are one GEMM over the stacked rows,
    anything else one GEMM per sample; both equal torch._scaled_mm sample by sample, bit for bit."""
    from te_func.gemm import _batched_scaled_mm
    a, scale_b = _fp8(4, 32, 64), torch.tensor(1.5)
    b, scale_a = (_fp8(48, 64), torch.tensor(0.25)) if shared else (_fp8(4, 48, 64), torch.rand(4) + 0.5)
    dims = (0, None, None, None) if shared else (0, 0, 0, None)
    biases = {None: None, "shared": torch.randn(48).bfloat16(), "per-sample": torch.randn(4, 48).bfloat16()}[bias]
    out_dtype = torch.float32 if bias is None else torch.bfloat16
    out = torch.func.vmap(_batched_scaled_mm, in_dims=(*dims, None, None, 0 if bias == "per-sample" else None))(
        a, b, scale_a, scale_b, out_dtype, False, biases)
    ref = torch.stack([torch._scaled_mm(a[i], (b if shared else b[i]).t(), scale_a=scale_a if shared else scale_a[i],
                                        scale_b=scale_b, out_dtype=out_dtype,
                                        bias=biases[i] if bias == "per-sample" else biases) for i in range(4)])
    assert torch.equal(out, ref)


@pytest.mark.cuda
def test_vmapped_gemm_runs_the_batch_gemm(cuda):
    """Under vmap (per-sample gradients) a tensor-wise FP8 GEMM against a shared weight is the
    batch's native GEMM, bit for bit: per-sample gradients in batch scope then meet the batch
    gradient to fp32 summation order, not to the emulation's distance from cuBLAS."""
    recipe = Float8CurrentScaling()
    x, w = torch.randn(8, 64, 256, device=cuda), torch.randn(512, 256, device=cuda)
    xq, _ = quantize_scheme(x.flatten(0, 1), scheme_for(recipe, "input"))
    wq, _ = quantize_scheme(w, scheme_for(recipe, "weight"))
    batch = gemm(xq, wq, torch.bfloat16)

    def one(data):
        return gemm(dataclasses.replace(xq, data=data), wq, torch.bfloat16)
    per_sample = torch.func.vmap(one)(xq.data.unflatten(0, (8, 64)))
    assert torch.equal(per_sample.flatten(0, 1), batch)
