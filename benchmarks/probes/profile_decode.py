"""Where a frozen decode call's GPU time goes: its kernels, per call, replayed from a CUDA graph.

    python3 benchmarks/probes/profile_decode.py --tokens 16,64 [--recipes current,delayed] [--out DIR]

The two LayerNormMLP 4096x14336 blocks of benchmarks/inference.py, frozen (`tef.freeze`) and
compiled (`fullgraph=True`), and torch's bf16 blocks, each captured once into a CUDA graph as
inference.py's mode `graph` does; torch.profiler records REPLAYS replays. Prints, per case, the
kernels by GPU time per call and writes them to DIR/profile_decode.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from inference import TorchMLP, captured, frozen_blocks  # noqa: E402
from profile_step import kernels_per_call  # noqa: E402
from te_func.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

REPLAYS = 50
HIDDEN, FFN = 4096, 14336
RECIPES = {"current": Float8CurrentScaling, "delayed": DelayedScaling}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,64")
    ap.add_argument("--recipes", default="current,delayed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    models = {"bf16": torch.nn.Sequential(TorchMLP(HIDDEN, FFN, dev), TorchMLP(HIDDEN, FFN, dev))}
    for name in args.recipes.split(","):
        models[name] = frozen_blocks(RECIPES[name](), HIDDEN, FFN, dev, 0)
    result = []
    with torch.no_grad():
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
            for name, model in models.items():
                replay = captured(torch.compile(model, fullgraph=True), x)
                ms = do_bench(lambda: replay(x), warmup=100, rep=500, return_mode="median")
                rows = kernels_per_call(lambda: replay(x), REPLAYS)
                total = sum(r[2] for r in rows)
                print(f"\n{name}, {tokens} tokens: replay {ms * 1e3:.1f} us, kernels {total:.1f} us per call")
                for n, calls, us in rows:
                    print(f"  {us:7.1f} us x{calls:<3g} {n[:150]}")
                result.append({"case": name, "tokens": tokens, "replay_us": ms * 1e3, "kernel_us": total,
                               "kernels": [{"name": n, "calls": c, "us": us} for n, c, us in rows]})
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_decode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
