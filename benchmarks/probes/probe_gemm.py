"""GPU facts the benchmark's analysis rests on: the two ceilings and what `_scaled_mm` accepts.

    python3 benchmarks/probes/probe_gemm.py [--out DIR]

Measures the device-to-device copy bandwidth, bf16 and FP8 (tensor-wise)
GEMM rates at 8192^3, whether torch's scaled GEMM takes Float8BlockScaling's
1x128 / 128x128 block scales on this GPU (checked against te_func's exact
emulation), the time of te_func's compiled current-scaling cast of a
(16384, 4096) activation against its byte floor, and decode-sized (1-64 token) FP8
and bf16 GEMMs replayed from CUDA graphs, and what a decode-sized FP8 GEMM's output dtype and bias
epilogue cost (`--parts decode_epilogues`), and the same GEMMs with the weight as the first
operand (`--parts decode_swap`), neither run by default. `--parts` picks some. Writes probe.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from run import time_ms  # noqa: E402
from te_func.quant import dequantize, quantize_scheme, quantize_with_transpose, scheme_for  # noqa: E402
from te_func.recipe import Float8BlockScaling, Float8CurrentScaling  # noqa: E402


def bench_ms(fn):
    return time_ms(fn, torch.device("cuda"))


def ceilings(res):
    n = 8192
    src = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    res["copy_TBps"] = round(2 * src.numel() * 2 / ms / 1e9, 2)
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    res["bf16_mm_TFLOPs"] = round(2 * n**3 / bench_ms(lambda: a @ b.t()) / 1e9, 1)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    for fast in (True, False):
        ms = bench_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                               use_fast_accum=fast))
        res[f"fp8_mm_TFLOPs_fast_accum_{fast}"] = round(2 * n**3 / ms / 1e9, 1)


def blockwise(res):
    """Does the scaled GEMM take 1x128 x 128x128 (fprop/dgrad) and 1x128 x 1x128 (wgrad) block scales?"""
    import torch.nn.functional as F
    m, k, n = 1024, 2048, 768
    r = Float8BlockScaling()
    s_in, s_w = scheme_for(r, "input"), scheme_for(r, "weight")
    x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    for name, sb in (("1x128_x_128x128", s_w), ("1x128_x_1x128", s_in)):
        xq, _ = quantize_scheme(x, s_in)
        wq, _ = quantize_scheme(w, sb)
        ref = dequantize(xq) @ dequantize(wq).t()
        rb = F.ScalingType.BlockWise128x128 if sb.block == (128, 128) else F.ScalingType.BlockWise1x128
        # 1x128 scales must be outer-dim-major (column-major (rows, K/128)) for cuBLAS.
        sa = xq.scale_inv.t().contiguous().t()
        sbs = wq.scale_inv.t().contiguous().t() if sb.block == (1, 128) else wq.scale_inv
        tries = {
            "F.scaled_mm": lambda: F.scaled_mm(xq.data, wq.data.t(), sa, F.ScalingType.BlockWise1x128, sbs, rb,
                                               output_dtype=torch.float32),
            "F.scaled_mm_scale_b_t": lambda: F.scaled_mm(xq.data, wq.data.t(), sa, F.ScalingType.BlockWise1x128,
                                                         sbs.t(), rb, output_dtype=torch.float32),
            "_scaled_mm": lambda: torch._scaled_mm(xq.data, wq.data.t(), scale_a=sa, scale_b=sbs.t(),
                                                   out_dtype=torch.float32),
        }
        for tname, fn in tries.items():
            key = f"blockwise_{name}_{tname}"
            try:
                out = fn()
                torch.cuda.synchronize()
                err = ((out - ref).norm() / ref.norm()).item()
                res[key] = f"ok rel_err={err:.2e}"
            except Exception as e:
                res[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def quantize_cost(res):
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    s = scheme_for(Float8CurrentScaling(), "input")
    cast = torch.compile(lambda x: quantize_with_transpose(x, s, None)[:2], fullgraph=True)
    ms = bench_ms(lambda: cast(x))
    floor_bytes = x.numel() * (2 + 1 + 1)          # read bf16 once, write two FP8 layouts
    res["current_cast_with_transpose_16384x4096_ms"] = round(ms, 4)
    res["current_cast_floor_ms_at_copy_bw"] = round(floor_bytes / (res["copy_TBps"] * 1e12) * 1e3, 4)
    cast1 = torch.compile(lambda x: quantize_scheme(x, s, None)[0], fullgraph=True)
    res["current_cast_rowwise_only_16384x4096_ms"] = round(bench_ms(lambda: cast1(x)), 4)


def graph_us(fn, reps: int = 50) -> float:
    """Microseconds of one call replayed from a CUDA graph of `reps` calls: no launch overhead,
    as a decode step under mode="reduce-overhead" runs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return bench_ms(g.replay) * 1e3 / reps


def decode_gemms(res):
    """Decode-sized GEMMs (M tokens of a 4096 x 14336 MLP's two weights), replayed from CUDA
    graphs: bf16, FP8 x FP8 with the tokens as the first operand (te_func's layout), FP8 with
    the weight first (out^T = w x^T, M padded to 16 as _scaled_mm needs), and a per-tensor
    cast of the tokens (amax, then the cast) alone."""
    one = torch.ones((), device="cuda")
    for n, k in ((14336, 4096), (4096, 14336)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        w8 = w.to(torch.float8_e4m3fn)
        for m in (1, 16, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            mp = max(16, -(-m // 16) * 16)
            x8 = torch.randn(mp, k, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)   # random: a GEMM of zeros runs cooler
            key = f"decode_m{m}_n{n}_k{k}"
            res[f"{key}_bf16_us"] = round(graph_us(lambda: x @ w.t()), 2)
            for fast in (True, False):
                res[f"{key}_fp8_tokens_first_fast{fast}_us"] = round(graph_us(
                    lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                             use_fast_accum=fast)), 2)
                res[f"{key}_fp8_weight_first_fast{fast}_us"] = round(graph_us(
                    lambda: torch._scaled_mm(w8, x8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                             use_fast_accum=fast)), 2)
            s = scheme_for(Float8CurrentScaling(), "input")
            cast = torch.compile(lambda x: quantize_scheme(x, s, None)[0].data, fullgraph=True)
            res[f"{key}_current_cast_us"] = round(graph_us(lambda: cast(x)), 2)
        res[f"decode_weight_bytes_n{n}_k{k}_floor_us_fp8"] = round(n * k / (4.25e12) * 1e6, 2)


def kernel_names(fn) -> list[str]:
    """The GPU kernels one call of fn launches, in order."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def decode_epilogues(res):
    """Decode-sized FP8 x FP8 GEMMs (tokens first, fast accumulation, as a frozen forward runs
    them), replayed from CUDA graphs, by what the GEMM writes: a bf16 output (where cuBLAS splits
    K it adds a reduction kernel), an fp32 output (then rounded to bf16, or not), and a bf16
    output with the bias added in the epilogue; the kernels each launches, and whether the fp32
    route gives the bf16 route's bits."""
    one = torch.ones((), device="cuda")
    for n, k in ((14336, 4096), (4096, 14336)):
        w8 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in (16, 64):
            x8 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            key = f"epilogue_m{m}_n{n}_k{k}"

            def mm(dtype, **kw):
                return torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=dtype, use_fast_accum=True,
                                        **kw)
            variants = {"bf16": lambda: mm(torch.bfloat16), "fp32": lambda: mm(torch.float32),
                        "fp32_then_bf16": lambda: mm(torch.float32).to(torch.bfloat16),
                        "bf16_bias": lambda: mm(torch.bfloat16, bias=bias)}
            for name, fn in variants.items():
                res[f"{key}_{name}_us"] = round(graph_us(fn), 2)
                res[f"{key}_{name}_kernels"] = kernel_names(fn)
            res[f"{key}_fp32_route_same_bits"] = torch.equal(variants["fp32_then_bf16"](), variants["bf16"]())


def decode_swap(res):
    """Decode-sized FP8 x FP8 GEMMs both ways round, replayed from CUDA graphs: tokens first
    (out = x w^T, as te_func calls `_scaled_mm`) and weight first (out^T = w x^T, the weight's rows
    as the GEMM's long side; the tokens then must be a multiple of 16), fast accumulation, bf16 out;
    over the projections of 8B- and 70B-sized Llamas. For each: the time, whether cuBLAS splits K
    (a second, reducing kernel), and whether the two give the same bits."""
    one = torch.ones((), device="cuda")
    shapes = ((14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096), (6144, 4096),
              (28672, 8192), (8192, 28672), (8192, 8192), (1024, 8192))
    for n, k in shapes:
        w8 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        for m in (16, 32, 64):
            x8 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            key = f"swap_m{m}_n{n}_k{k}"
            variants = {
                "tokens_first": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                         use_fast_accum=True),
                "weight_first": lambda: torch._scaled_mm(w8, x8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                         use_fast_accum=True)}
            for name, fn in variants.items():
                res[f"{key}_{name}_us"] = round(graph_us(fn), 2)
                res[f"{key}_{name}_kernels"] = len(kernel_names(fn))
            res[f"{key}_same_bits"] = torch.equal(variants["weight_first"]().t(), variants["tokens_first"]())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--parts", default="ceilings,blockwise,quantize_cost,decode_gemms")
    args = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    parts = {f.__name__: f for f in (ceilings, blockwise, quantize_cost, decode_gemms, decode_epilogues,
                                                 decode_swap)}
    for part in (parts[name] for name in args.parts.split(",")):
        try:
            part(res)
        except Exception as e:
            res[part.__name__] = f"{type(e).__name__}: {str(e)[:300]}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "probe.json").write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
