"""The grouped FP8 kernels' autotune candidates, and a few tiles beside them, one by one at a MoE
layer's GEMM shapes, against torch bf16 `_grouped_mm` on the same shape: ms and TFLOP/s (CUDA
events via triton's do_bench), printed as a table, so that the candidates can be chosen from figures.

    python3 benchmarks/probes/grouped_configs.py [8|128] [--quick] [--fast-backward]

Rows: the forward GEMM (runs of rows by device offsets, b (G, N, K)) with fast accumulation, the
input-gradient GEMM (the same layout, split accumulation, as TE's dgrad) and the weight-gradient
GEMM (runs along K, split accumulation), for gate_up and down. --fast-backward: the two backward
GEMMs with fast accumulation instead (what split accumulation costs; TE splits them by default).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from te_func.kernels import grouped_gemm as gg  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LAYERS = {8: (8, 4096, 14336, 2), 128: (128, 2048, 768, 8)}     # experts, hidden, intermediate, top-k
TOKENS = 16384


def _tile(c) -> tuple:
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a triton.Config
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages


AUTOTUNED = [_tile(c) for c in gg._configs()]      # the kernels' own candidates
# Tiles the autotuner does not try, measured beside its own.
EXTRA = [(128, 256, 64, 8, 4), (128, 128, 128, 4, 3), (128, 256, 128, 8, 4), (256, 128, 64, 8, 4),
         (128, 128, 256, 8, 2)]
CANDIDATES = AUTOTUNED + [t for t in EXTRA if t not in AUTOTUNED]


def offsets(g: int, rows: int, dev) -> torch.Tensor:
    # A fixed uneven routing: counts drawn once, summing to rows; multiples of 16, which torch's
    # bf16 grouped GEMM needs along K (the FP8 kernels take any).
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(g, generator=gen) + 0.5
    counts = (w / w.sum() * rows / 16).floor().long() * 16
    counts[-1] += rows - counts.sum()
    return counts.cumsum(0).to(torch.int32).to(dev)


def time_config(kernel, grid_of, args, meta, cfg):
    m, n, k, w, s = cfg
    try:
        fn = kernel.fn
        run = lambda: fn[grid_of(m, n)](*args, **meta, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k,  # noqa: E731
                                        num_warps=w, num_stages=s)
        run()
        return do_bench(run, warmup=10, rep=40)
    except Exception as e:      # noqa: BLE001 (a probe: out of shared memory says so)
        return f"{type(e).__name__}"


def offsets_rows(g, t, k, n, fast, dev, quick, e5m2=False):
    a = torch.randn(t, k, device=dev).to(E5M2 if e5m2 else E4M3)
    b = torch.randn(g, n, k, device=dev).to(E4M3)
    sa, sb = torch.rand(g, device=dev) + 0.5, torch.rand(g, device=dev) + 0.5
    offs = offsets(g, t, dev)
    out = torch.zeros(t, n, device=dev, dtype=torch.bfloat16)
    args = (a, b, sa, sb, sa, offs, out, t, n, k, g, 0, b.stride(0), 1, 1, 0)
    meta = dict(OFFSETS=True, HAS_BIAS=False, FAST_ACCUM=fast)

    def grid_of(bm, bn):
        return ((triton.cdiv(t, bm) + g) * triton.cdiv(n, bn), 1)
    a16, b16 = torch.randn(t, k, device=dev, dtype=torch.bfloat16), torch.randn(g, n, k, device=dev,
                                                                                   dtype=torch.bfloat16)
    bf16 = do_bench(lambda: torch._grouped_mm(a16, b16.transpose(1, 2), offs=offs), warmup=10, rep=40)
    return bf16, {c: time_config(gg._grouped_kernel, grid_of, args, meta, c) for c in (CANDIDATES[:3] if quick
                                                                                        else CANDIDATES)}


def k_runs_rows(g, t, m, n, dev, quick, fast=False):
    a = torch.randn(m, t, device=dev).to(E5M2)      # dY.T: the gradient, E5M2 under HYBRID
    b = torch.randn(n, t, device=dev).to(E4M3)      # X.T
    sa, sb = torch.rand(g, device=dev) + 0.5, torch.rand(g, device=dev) + 0.5
    offs = offsets(g, t, dev)
    out = torch.empty(g, m, n, device=dev, dtype=torch.bfloat16)
    args = (a, b, sa, sb, offs, out, m, n, t, g, a.stride(0), b.stride(0), 1, 1)
    meta = dict(FAST_ACCUM=fast)

    def grid_of(bm, bn):
        return (triton.cdiv(m, bm) * triton.cdiv(n, bn), g)
    a16, b16 = torch.randn(m, t, device=dev, dtype=torch.bfloat16), torch.randn(n, t, device=dev,
                                                                               dtype=torch.bfloat16)
    bf16 = do_bench(lambda: torch._grouped_mm(a16, b16.t(), offs=offs), warmup=10, rep=40)
    return bf16, {c: time_config(gg._k_runs_kernel, grid_of, args, meta, c) for c in (CANDIDATES[:3] if quick
                                                                                       else CANDIDATES)}


def report(name, flops, bf16, times):
    print(f"\n{name}: bf16 _grouped_mm {bf16:.3f} ms ({flops / bf16 / 1e9:.0f} TFLOP/s)")
    print("| BLOCK_M, BLOCK_N, BLOCK_K, warps, stages (* autotuned) | ms | TFLOP/s | x bf16 |")
    print("|---|---|---|---|")
    for c, t in times.items():
        mark = " *" if c in AUTOTUNED else ""
        print(f"| {c}{mark} | {t:.3f} | {flops / t / 1e9:.0f} | {bf16 / t:.2f} |" if isinstance(t, float)
              else f"| {c}{mark} | {t} | | |")
    ok = {c: t for c, t in times.items() if isinstance(t, float)}
    for label, pool in (("best", ok), ("best autotuned", {c: t for c, t in ok.items() if c in AUTOTUNED})):
        if pool:
            best = min(pool, key=pool.get)
            print(f"{label} {best}: {pool[best]:.3f} ms, {bf16 / pool[best]:.2f}x bf16", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experts", type=int, nargs="?", default=8, choices=sorted(LAYERS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--fast-backward", action="store_true")
    args = p.parse_args(argv)
    acc = "fast" if args.fast_backward else "split"
    dev = torch.device("cuda")
    g, hidden, inter, top_k = LAYERS[args.experts]
    t = TOKENS * top_k
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{g} experts, {hidden}/{inter}, {t} routed rows")
    for name, k, n in (("gate_up", hidden, 2 * inter), ("down", inter, hidden)):
        flops = 2 * t * k * n
        report(f"{name} forward (offsets, fast accumulation)", flops, *offsets_rows(g, t, k, n, True, dev, args.quick))
        report(f"{name} input gradient (offsets, {acc} accumulation, E5M2 x E4M3)", flops,
               *offsets_rows(g, t, n, k, args.fast_backward, dev, args.quick, e5m2=True))
        report(f"{name} weight gradient (runs along K, {acc} accumulation)", flops,
               *k_runs_rows(g, t, n, k, dev, args.quick, args.fast_backward))


if __name__ == "__main__":
    main()
