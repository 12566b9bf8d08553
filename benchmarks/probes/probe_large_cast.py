"""Probe: the GELU output's current-scaling cast at prefill sizes, kernel by kernel.

    python3 benchmarks/probes/probe_large_cast.py [--tokens 8192] [--out DIR]    # on the GPU

A frozen LayerNormMLP under Float8CurrentScaling casts v = GELU(fc1 out + bias) with the scale of
max |v|. Compiled, inductor runs that as a reduction that computes the GELU for its amax, then a
pass that computes the GELU again and casts it: the tanh, which sets the pace of any pass that
computes it, runs twice. Compared at (tokens, 14336) bf16, `do_bench` medians:
  inductor      te_func's torch code compiled (te_func.kernels off);
  given scale   the same GELU and cast with a scale given (DelayedScaling's one pass, the floor);
  kernels       te_func.kernels' GELU writing v with its tiles' maxes (or one max, by an atomic
                max per tile), their max, and the cast reading v (`cast_from_partials`'s kernel
                with one partial), for several tiles.
The kernels' bits are checked against the torch path.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import te_func.kernels as kernels  # noqa: E402
from te_func.kernels import cast as K  # noqa: E402
from te_func.ops.activations import activation_forward, activation_spec  # noqa: E402
from te_func.quant import quantize_scheme, scheme_for  # noqa: E402
from te_func.quant.tensor import cast_with_scale  # noqa: E402
from te_func.recipe import Float8CurrentScaling  # noqa: E402

FFN = 14336
GELU_TILES = [(16, 64, 4), (32, 128, 4), (32, 64, 4), (64, 64, 8), (64, 128, 8), (32, 64, 2)]
CAST_TILES = [(16, 64, 4), (32, 128, 4), (64, 128, 8), (128, 64, 8)]


def gelu_tiles(h, b, tile_m, tile_n, warps, atomic=False):
    """The GELU kernel: each tile's max into its own slot, or (atomic) into one word by atomic max."""
    m, n = h.shape
    v = torch.empty_like(h)
    grid = (triton.cdiv(m, tile_m), triton.cdiv(n, tile_n))
    partials = torch.zeros(1, dtype=torch.int32, device=h.device) if atomic else \
        torch.empty(grid[0] * grid[1], dtype=torch.float32, device=h.device)
    K._activation_kernel[grid](h, h, b, v, partials, h, m, n, ACT=K.ACT_GELU.value, HAS_BIAS=True, COLSUM=False,
                               BLOCK_M=tile_m, BLOCK_N=tile_n, PARTIALS=not atomic, num_warps=warps,
                               enable_fp_fusion=False)
    return v, partials.view(torch.float32) if atomic else partials


def cast_tiles(v, amax, s, tile_m, tile_n, warps):
    m, n = v.shape
    data = torch.empty((m, n), dtype=s.dtype, device=v.device)
    scale_inv = torch.empty((1,), dtype=torch.float32, device=v.device)
    fp8, mantissa, bias = K._FP8[s.dtype]
    grid = (triton.cdiv(m, tile_m), triton.cdiv(n, tile_n))
    K._partials_cast_kernel[grid](v, data, scale_inv, amax, amax.numel(), m, n, s.fp8_max, s.amax_epsilon, FP8=fp8,
                                  POW2=s.power_2_scale, SOFT_ROUND=K.SOFT_ROUND, MANTISSA=mantissa, BIAS=bias,
                                  BLOCK_M=tile_m, BLOCK_N=tile_n, BLOCK_P=K.PARTIALS_BLOCK, num_warps=warps)
    return data, scale_inv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, gelu, s = torch.device("cuda"), activation_spec("gelu"), scheme_for(Float8CurrentScaling(), "input")
    rows = []

    def bench(name, fn):
        us = do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
        rows.append({"case": name, "tokens": tokens, "us": us})
        print(f"{tokens:6d} tokens  {name:40s} {us:8.1f} us", flush=True)

    for tokens in map(int, args.tokens.split(",")):
        torch.manual_seed(0)
        h = torch.randn(tokens, FFN, device=dev, dtype=torch.bfloat16) * 3
        b = torch.randn(FFN, device=dev, dtype=torch.bfloat16)
        kernels.set_cast_kernels(False)
        torch._dynamo.reset()
        chain = torch.compile(lambda h, b: quantize_scheme(activation_forward(gelu, h + b), s)[0], fullgraph=True)
        chain(h, b)
        bench("inductor: amax pass, then cast pass", lambda: chain(h, b))
        scale = torch.tensor(2.0, device=dev)
        given = torch.compile(lambda h, b: cast_with_scale(activation_forward(gelu, h + b), scale, s), fullgraph=True)
        bench("inductor: given scale (one pass)", lambda: given(h, b))
        kernels.set_cast_kernels(True)
        for gt in GELU_TILES:
            v, partials = gelu_tiles(h, b, *gt)
            bench(f"gelu kernel {gt}", lambda: gelu_tiles(h, b, *gt))
            bench(f"  partials ({partials.numel()}) max", lambda: partials.amax(0, keepdim=True))
            bench(f"gelu kernel {gt}, one atomic max", lambda: gelu_tiles(h, b, *gt, atomic=True))
            assert torch.equal(gelu_tiles(h, b, *gt, atomic=True)[1], partials.amax(0, keepdim=True))
        amax = partials.amax(0, keepdim=True)
        kernels.set_cast_kernels(False)
        want = quantize_scheme(v, s)[0]         # the torch path's cast of the kernel's v
        kernels.set_cast_kernels(True)
        for ct in CAST_TILES:
            data, scale_inv = cast_tiles(v, amax, s, *ct)
            same = torch.equal(data.view(torch.uint8), want.data.view(torch.uint8)) and \
                torch.equal(scale_inv.reshape(()), want.scale_inv)
            bench(f"cast kernel {ct} (bits equal: {same})", lambda: cast_tiles(v, amax, s, *ct))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe_large_cast.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
