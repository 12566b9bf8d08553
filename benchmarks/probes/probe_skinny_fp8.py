"""Probe: a Triton FP8 x FP8 GEMM for 16 / 64 tokens against torch._scaled_mm and bf16.

    python3 benchmarks/probes/probe_skinny_fp8.py     # on the GPU; writes $OUT/skinny.json (default /tmp)

Three layouts of one kernel (the weight as the MMA's left operand with pointer loads or
TMA descriptors, or as the right one), a sweep of tiles, stages and K splits; each config
is checked against _scaled_mm (max error <= 1% of max |out|) and timed as six calls on six
distinct weights captured in one CUDA graph (weights do not stay in L2), median of 20
replays, per call. Not used by te_func: it measures whether such a kernel beats cuBLAS's
skinny FP8 GEMMs (docs/benchmarks.md, "Decode kernels probed").
"""
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def swapped(x_ptr, w_ptr, sx_ptr, sw_ptr, out_ptr, M, N, K, K_PER_SPLIT,
            SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        k = k0 + ks
        w = tl.load(w_ptr + rows[:, None] * K + k[None, :])
        xt = tl.load(x_ptr + toks[None, :] * K + k[:, None], mask=toks[None, :] < M, other=0.0)
        acc = tl.dot(w, xt, acc)
    where = toks[None, :] < M
    if SPLIT == 1:
        acc = acc * (tl.load(sx_ptr) * tl.load(sw_ptr))
        tl.store(out_ptr + toks[None, :] * N + rows[:, None], acc.to(tl.bfloat16), mask=where)
    else:
        tl.store(out_ptr + (pid_k * M + toks[None, :]) * N + rows[:, None], acc, mask=where)


@triton.jit
def swapped_tma(x_desc, w_desc, sx_ptr, sw_ptr, out_ptr, M, N, K, K_PER_SPLIT,
                SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                STAGES: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in tl.range(k_start, k_start + K_PER_SPLIT, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([pid_n * BLOCK_N, k0])
        x = x_desc.load([0, k0])
        acc = tl.dot(w, x.T, acc)
    where = toks[None, :] < M
    if SPLIT == 1:
        acc = acc * (tl.load(sx_ptr) * tl.load(sw_ptr))
        tl.store(out_ptr + toks[None, :] * N + rows[:, None], acc.to(tl.bfloat16), mask=where)
    else:
        tl.store(out_ptr + (pid_k * M + toks[None, :]) * N + rows[:, None], acc, mask=where)


@triton.jit
def plain(x_ptr, w_ptr, sx_ptr, sw_ptr, out_ptr, M, N, K, K_PER_SPLIT,
          SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + toks[:, None] * K + k[None, :], mask=toks[:, None] < M, other=0.0)
        wt = tl.load(w_ptr + rows[None, :] * K + k[:, None])
        acc = tl.dot(x, wt, acc)
    where = toks[:, None] < M
    if SPLIT == 1:
        acc = acc * (tl.load(sx_ptr) * tl.load(sw_ptr))
        tl.store(out_ptr + toks[:, None] * N + rows[None, :], acc.to(tl.bfloat16), mask=where)
    else:
        tl.store(out_ptr + (pid_k * M + toks[:, None]) * N + rows[None, :], acc, mask=where)


@triton.jit
def sum_splits(partial_ptr, sx_ptr, sw_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(partial_ptr + i, mask=i < numel, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(partial_ptr + s * numel + i, mask=i < numel, other=0.0)
    acc = acc * (tl.load(sx_ptr) * tl.load(sw_ptr))
    tl.store(out_ptr + i, acc.to(tl.bfloat16), mask=i < numel)


def make_call(kind, x, w, sx, sw, cfg):
    m, k = x.shape
    n = w.shape[0]
    bt, bn, bk, split, warps, stages = cfg
    kps = k // split
    out = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    part = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else out
    grid = (n // bn, split)
    if kind == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor
        xd = TensorDescriptor.from_tensor(x, [bt, bk])
        wd = TensorDescriptor.from_tensor(w, [bn, bk])

        def launch():
            swapped_tma[grid](xd, wd, sx, sw, part, m, n, k, kps, SPLIT=split, BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk,
                              STAGES=stages, num_warps=warps)
    else:
        kern = swapped if kind == "swapped" else plain

        def launch():
            kern[grid](x, w, sx, sw, part, m, n, k, kps, SPLIT=split, BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk,
                       num_warps=warps, num_stages=stages)

    def call():
        launch()
        if split > 1:
            sum_splits[(triton.cdiv(m * n, 1024),)](part, sx, sw, out, m * n, SPLIT=split, BLOCK=1024)
        return out
    return call


def graph_us(calls, reps=20):
    """calls: list of closures on distinct weights; capture them all in one graph, replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    times.sort()
    return times[len(times) // 2]


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    copies = 6
    results = []
    for (n, k) in ((14336, 4096), (4096, 14336)):
        ws = [(torch.randn(n, k, device=dev) * 0.05).to(torch.float8_e4m3fn) for _ in range(copies)]
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        sw = torch.tensor(0.01, device=dev)
        sx = torch.tensor(0.02, device=dev)
        for m in (16, 64):
            x = (torch.randn(m, k, device=dev)).to(torch.float8_e4m3fn)
            xb = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = torch._scaled_mm(x, ws[0].t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True)
            row = {"m": m, "n": n, "k": k}
            row["bf16"] = graph_us([lambda w=w: xb @ w.t() for w in wb])
            row["scaled_mm"] = graph_us([lambda w=w: torch._scaled_mm(x, w.t(), scale_a=sx, scale_b=sw,
                                                                       out_dtype=torch.bfloat16, use_fast_accum=True)
                                         for w in ws])
            best = {}
            bts = [max(16, m)] if m <= 64 else [64, 128]
            for kind in ("swapped", "tma", "plain"):
                for bt, bn, bk, split, stages in itertools.product(
                        bts, (64, 128, 256), (128, 256), (1, 2, 4, 8, 16), (3, 5)):
                    warps = 8 if bn == 256 else 4
                    if n % bn or k % (bk * split):
                        continue
                    if kind == "plain" and bt > 64:
                        continue
                    if not 96 <= n // bn * split <= 528:
                        continue
                    cfg = (bt, bn, bk, split, warps, stages)
                    try:
                        calls = [make_call(kind, x, w, sx, sw, cfg) for w in ws]
                        got = calls[0]()
                        torch.cuda.synchronize()
                        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                        if err > 1e-2:
                            print("bad", kind, cfg, err, flush=True)
                            continue
                        us = graph_us(calls)
                    except Exception as e:
                        print("fail", kind, cfg, type(e).__name__, str(e)[:200], flush=True)
                        continue
                    if kind not in best or us < best[kind][0]:
                        best[kind] = (us, cfg)
            row["best"] = best
            print(json.dumps(row), flush=True)
            results.append(row)
    with open(f"{OUT}/skinny.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
