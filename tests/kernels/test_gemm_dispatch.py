"""Which GEMM runs where: the GPU paths against the exact fp32 emulation."""
import dataclasses

import pytest
import torch
import torch._dynamo.testing

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
    anything else one grouped GEMM (te_func::grouped_scaled_mm); both equal torch._scaled_mm
    sample by sample, bit for bit."""
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


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _loop_reference(a, b, scale_a, scale_b, out_dtype, bias, runs=None, fast_accum=False):
    """The grouped GEMM's definition: one te_func GEMM a group (`gemm` on its tensor-wise casts)."""
    from te_func.quant import Quantized
    outs = []
    for g in range(b.shape[0]):
        rows = a[g] if runs is None else a[runs[g][0]:runs[g][1]]
        s_a, s_b = (s.reshape(-1).expand(b.shape[0])[g] for s in (scale_a, scale_b))
        bias_g = None if bias is None else bias[g] if bias.dim() == 2 else bias
        outs.append(gemm(Quantized.tensorwise(rows, s_a), Quantized.tensorwise(b[g], s_b), out_dtype,
                         fast_accum=fast_accum, bias=bias_g))
    return outs


@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)], ids=str)
@pytest.mark.parametrize("bias", [None, "shared", "per-group"])
def test_grouped_gemm_is_a_loop_of_gemms_bit_for_bit(dtypes, bias):
    """te_func::grouped_scaled_mm where no grouped kernel runs (CPUs): batched (G, M, K) x (G, N, K),
    an operand or a scale shared by expanding it, equals one GEMM a group, bit for bit."""
    from te_func.gemm import _grouped_scaled_mm
    torch.manual_seed(0)
    g, m, n, k = 3, 24, 32, 48
    a = (torch.randn(g, m, k) * 8).to(dtypes[0])
    b = (torch.randn(g, n, k) * 8).to(dtypes[1])
    scale_a, scale_b = torch.rand(g) + 0.5, torch.tensor(0.75)
    biases = {None: None, "shared": torch.randn(n).bfloat16(), "per-group": torch.randn(g, n).bfloat16()}[bias]
    out_dtype = torch.float32 if bias is None else torch.bfloat16
    got = _grouped_scaled_mm(a, b, scale_a, scale_b, out_dtype, False, biases)
    assert torch.equal(got, torch.stack(_loop_reference(a, b, scale_a, scale_b, out_dtype, biases)))
    shared = b[:1].expand(g, n, k)          # one weight, per-group inputs and scales
    got = _grouped_scaled_mm(a, shared, scale_a, scale_b, out_dtype, True, biases)
    assert torch.equal(got, torch.stack(_loop_reference(a, shared, scale_a, scale_b, out_dtype, biases, None, True)))


@pytest.mark.parametrize("counts", [[10, 0, 45, 15], [70, 0, 0, 0], [0, 0, 0, 0], [5, 5, 5, 5]], ids=str)
def test_grouped_gemm_over_runs_of_rows_from_device_offsets(counts):
    """The MoE layout: a (T, K) cut into runs by device offsets (the runs' ends), one weight a run;
    empty runs, all rows in one run and rows past the last run (zeros) included."""
    from te_func.gemm import _grouped_scaled_mm
    torch.manual_seed(1)
    t, n, k = 70, 32, 48
    a, b = (torch.randn(t, k) * 8).to(E4M3), (torch.randn(len(counts), n, k) * 8).to(E4M3)
    scale_a, scale_b = torch.rand(len(counts)) + 0.5, torch.rand(len(counts)) + 0.5
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = _grouped_scaled_mm(a, b, scale_a, scale_b, torch.bfloat16, False, None, offs)
    ends = offs.tolist()
    runs = list(zip([0, *ends[:-1]], ends))
    want = torch.zeros(t, n, dtype=torch.bfloat16)
    for (start, end), out in zip(runs, _loop_reference(a, b, scale_a, scale_b, torch.bfloat16, None, runs)):
        want[start:end] = out
    assert torch.equal(got, want)
    assert not got[ends[-1]:].any()


def test_grouped_gemm_op_traces_with_changing_offsets_and_under_vmap():
    """The op's fake impl (torch.library.opcheck); compiled fullgraph, new offsets make
    no new graph; vmapped over an outer batch (an ensemble's per-sample GEMMs), one call a sample."""
    from te_func.gemm import _grouped_scaled_mm
    torch.manual_seed(2)
    a, b = (torch.randn(40, 32) * 8).to(E4M3), (torch.randn(3, 16, 32) * 8).to(E4M3)
    scales = torch.rand(3) + 0.5, torch.rand(3) + 0.5
    offs = torch.tensor([10, 30, 40], dtype=torch.int32)
    checks = ("test_faketensor", "test_aot_dispatch_dynamic")    # (its schema check multiplies FP8 on CPU)
    torch.library.opcheck(_grouped_scaled_mm, (a, b, *scales, torch.bfloat16, True, None, offs), test_utils=checks)
    torch.library.opcheck(_grouped_scaled_mm, (a.view(2, 20, 32), b[:2], *(s[:2] for s in scales), torch.float32,
                                               False, torch.randn(2, 16), None), test_utils=checks)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_grouped_scaled_mm, fullgraph=True, backend=counter)
    for ends in ([10, 30, 40], [0, 35, 40], [40, 40, 40]):
        offs = torch.tensor(ends, dtype=torch.int32)
        assert torch.equal(compiled(a, b, *scales, torch.bfloat16, True, None, offs),
                           _grouped_scaled_mm(a, b, *scales, torch.bfloat16, True, None, offs))
    assert counter.frame_count == 1
    stacked = torch.stack([a.view(2, 20, 32), a.flip(0).view(2, 20, 32)])       # 2 outer samples
    got = torch.func.vmap(_grouped_scaled_mm, in_dims=(0, None, None, None, None, None))(
        stacked, b[:2], scales[0][:2], scales[1][:2], torch.float32, False)
    want = torch.stack([_grouped_scaled_mm(s, b[:2], scales[0][:2], scales[1][:2], torch.float32, False)
                        for s in stacked])
    assert torch.equal(got, want)


@pytest.mark.parametrize("counts", [[16, 0, 48, 32], [96, 0, 0, 0], [0, 0, 0, 0], [7, 33, 20, 36]], ids=str)
def test_grouped_gemm_over_runs_along_k_is_a_weight_gradient_a_run(counts):
    """The MoE weight-gradient layout: a (M, T), b (N, T) with device offsets along T -> one product
    a run (G, M, N), an empty run zeros; equal to one GEMM a run bit for bit, runs whose length
    torch._scaled_mm takes or not; no bias there."""
    from te_func.gemm import _grouped_scaled_mm
    torch.manual_seed(3)
    t, m, n = 96, 32, 48
    from te_func.quant import Quantized
    a, b = (torch.randn(m, t) * 8).to(E5M2), (torch.randn(n, t) * 8).to(E4M3)
    scale_a, scale_b = torch.rand(len(counts)) + 0.5, torch.tensor(0.5)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = _grouped_scaled_mm(a, b, scale_a, scale_b, torch.float32, False, None, offs)
    ends = offs.tolist()
    for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        want = torch.zeros(m, n) if end == start else gemm(
            Quantized.tensorwise(a[:, start:end], scale_a[g]), Quantized.tensorwise(b[:, start:end], scale_b),
            torch.float32, fast_accum=False)
        assert torch.equal(got[g], want), g
    torch.library.opcheck(_grouped_scaled_mm, (a, b, scale_a, scale_b, torch.float32, False, None, offs),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match="take no bias"):
        _grouped_scaled_mm(a, b, scale_a, scale_b, torch.float32, False, torch.randn(n), offs)
