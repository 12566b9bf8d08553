"""Decode-sized forwards of te_func's training layers, compiled, with and without CUDA graphs.

    python3 benchmarks/cuda_graphs.py [--tokens 16] [--out results.json]

Two LayerNormMLP 4096x14336 in bf16 with cached FP8 weights (is_first_microbatch=False),
under torch.no_grad, compiled whole with mode "default" and "reduce-overhead": through
tef.functional_call (workspaces from tef.init_workspaces, whose CUDA entries are static
addresses) and through tef.Stateful, against torch's bf16 block with the same mode. Times
are triton.testing.do_bench medians in one process, one case after another.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # te_func from this checkout

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import te_func as tef  # noqa: E402
from te_func.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

H, F = 4096, 14336


def torch_block():
    layer = lambda: [torch.nn.LayerNorm(H), torch.nn.Linear(H, F), torch.nn.GELU("tanh"), torch.nn.Linear(F, H)]  # noqa: E731
    return torch.nn.Sequential(*layer(), *layer()).to("cuda", torch.bfloat16)


def te_block():
    return torch.nn.Sequential(*(tef.nn.LayerNormMLP(H, F, activation="gelu", params_dtype=torch.bfloat16,
                                                     device="cuda") for _ in range(2)))


def cases(x):
    yield "torch-bf16", lambda mode: torch.compile(torch_block(), mode=mode, fullgraph=True)
    for name, recipe in [("current", Float8CurrentScaling()), ("delayed", DelayedScaling())]:
        def functional(mode, recipe=recipe):
            model = te_block()
            params = {k: v.detach() for k, v in model.named_parameters()}
            _, ws = tef.functional_call(model, params, tef.init_workspaces(model, recipe), (x,), recipe=recipe,
                                        is_first_microbatch=True)
            tef.frame.mark_static(ws.values())
            fwd = torch.compile(lambda x: tef.functional_call(model, params, ws, (x,), recipe=recipe,
                                                              is_first_microbatch=False)[0],
                                mode=mode, fullgraph=True)
            return fwd

        def stateful(mode, recipe=recipe):
            shell = tef.Stateful(te_block(), recipe)
            shell(x, is_first_microbatch=True)
            fwd = torch.compile(shell, mode=mode, fullgraph=True)
            return lambda x: fwd(x, is_first_microbatch=False)
        yield f"te-{name}-functional", functional
        yield f"te-{name}-stateful", stateful


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    x = torch.randn(args.tokens, H, device="cuda", dtype=torch.bfloat16)
    rows = []
    with torch.no_grad():
        for name, make in cases(x):
            for mode in ("default", "reduce-overhead"):
                fn = make(mode)
                for _ in range(3):
                    fn(x)
                torch.cuda.synchronize()
                ms = do_bench(lambda: fn(x), warmup=200, rep=1000, return_mode="median")
                rows.append({"case": name, "mode": mode, "tokens": args.tokens, "ms": ms})
                print(f"{name:<24}{mode:<16}{ms:8.4f} ms", flush=True)
                del fn
                torch._dynamo.reset()
    base = {r["mode"]: r["ms"] for r in rows if r["case"] == "torch-bf16"}
    for r in rows:
        r["x_bf16_same_mode"] = base[r["mode"]] / r["ms"]
    print("\n".join(f"{r['case']:<24}{r['mode']:<16}{r['x_bf16_same_mode']:6.2f}x bf16" for r in rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
