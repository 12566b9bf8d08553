"""Frozen FP8 inference (tef.freeze) vs torch bf16 on one GPU: two LayerNormMLP blocks.

    python3 benchmarks/inference.py --out inference.json [--hidden 4096 --ffn 14336]

Two LayerNormMLP(hidden, ffn) blocks in bf16, at 8192 tokens (prefill) and 1 / 16 / 64
tokens (decode). Each variant is torch.compile'd with the same mode as the bf16 torch
baseline and timed with triton.testing.do_bench (median) in this one process. Modes:
"default"; "reduce-overhead" (inductor's CUDA graph trees: each call still runs dynamo's
guards and the trees' bookkeeping in Python); "graph" (the default-mode compiled call
captured once into a torch.cuda.CUDAGraph and replayed, as a serving loop captures its
decode step: no Python per call, so the figure is the GPU's time). Variants: frozen
Float8CurrentScaling and DelayedScaling, FP8 x FP8, and the same with weight-only FP8 for
calls of at most 64 tokens. Prints each time and its ratio to bf16 (speed-up: > 1 is faster)
and the resident bytes of each model, and under reduce-overhead each model's host time per
call (where it exceeds the GPU's time, Python sets the pace); writes everything as JSON to --out.
`--skip-guards` times the compiled modes with dynamo's guard check off
(`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`, after warm-up calls), as a serving
loop whose shapes are all warmed up may run them (docs/inference.md). `--static-input` marks
the input a static address, which reduce-overhead's CUDA graphs then read in place (a loop
that writes each step's input into one buffer) instead of copying it in before each replay.

`--quick` runs tiny shapes with host timing on any device (a CPU smoke test), eagerly unless
`--modes` says otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # te_func from this checkout

import torch  # noqa: E402

import te_func as tef  # noqa: E402
from te_func.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402


class TorchMLP(torch.nn.Module):
    """The bf16 baseline: LayerNorm -> Linear -> GELU(tanh) -> Linear, plain torch."""

    def __init__(self, hidden, ffn, device):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden, device=device, dtype=torch.bfloat16)
        self.fc1 = torch.nn.Linear(hidden, ffn, device=device, dtype=torch.bfloat16)
        self.fc2 = torch.nn.Linear(ffn, hidden, device=device, dtype=torch.bfloat16)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)), approximate="tanh"))


def te_blocks(hidden, ffn, device):
    return torch.nn.Sequential(*(tef.nn.LayerNormMLP(hidden, ffn, params_dtype=torch.bfloat16, device=device)
                                 for _ in range(2)))


def frozen_blocks(recipe, hidden, ffn, device, weight_only_tokens):
    model = te_blocks(hidden, ffn, "cpu")       # frozen onto the device: only FP8 casts move
    ws = None
    if isinstance(recipe, DelayedScaling):
        # One training step's worth of amaxes, so the scales are real ones.
        ws = tef.init_workspaces(model, recipe)
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss_fn(p, w, x):
            out, new_w = tef.functional_call(model, p, w, (x,), recipe=recipe, is_first_microbatch=True)
            return out.float().square().mean(), new_w
        for _ in range(2):
            _, ws = tef.grad(loss_fn)(params, ws, torch.randn(256, hidden, dtype=torch.bfloat16))
    return tef.freeze(model, recipe, workspaces=ws, device=device, weight_only_tokens=weight_only_tokens)


def resident_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def time_ms(fn, device, quick) -> float:
    if device.type == "cuda" and not quick:
        from triton.testing import do_bench
        return do_bench(fn, warmup=200, rep=1000, return_mode="median")
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 3 * 1e3


def host_us_per_call(fn, x, calls: int = 200) -> float:
    """The host's time per call of fn(x): where it exceeds the GPU's time per call, the calls are
    paced by Python (dynamo's guards, CUDA graph trees' bookkeeping), not by their kernels. On
    CUDA the median of `host_and_gpu_us`, the GPU held busy while the host issues each call; else
    the mean of `calls` calls."""
    if x.is_cuda:
        return host_and_gpu_us(fn, x)[0]
    fn(x)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t0) / calls * 1e6


SLEEP_CYCLES = 3_000_000        # ~1.5 ms of GPU: longer than any host call measured here


def host_and_gpu_us(fn, x, calls: int = 60, skip: int = 10) -> tuple[float, float]:
    """Median host time and median GPU time of fn(x) on CUDA, in us (the first `skip` calls
    dropped). A sleep kernel holds the GPU while the host issues each call, so the host's time
    is its own (never blocked behind earlier work) and CUDA events around the call time only
    its GPU work."""
    host, gpu = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(calls):
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        t0 = time.perf_counter()
        fn(x)
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    return statistics.median(host[skip:]), statistics.median(gpu[skip:])


def captured(fn, x):
    """fn(x) recorded once into a CUDA graph (after warm-up calls on a side stream, as
    torch.cuda.graph needs); the returned callable replays it (x's values are read from
    the captured input, which the caller keeps fixed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)

    def replay(_x):
        graph.replay()
        return out
    return replay


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--tokens", default="8192,1,16,64")
    parser.add_argument("--modes", default=None,
                        help="default,reduce-overhead,graph (the default), or eager; --quick: eager unless given")
    parser.add_argument("--weight-only-tokens", type=int, default=64)
    parser.add_argument("--skip-guards", action="store_true",
                        help="time the compiled modes (not graph) under torch.compiler.set_stance("
                             "skip_guard_eval_unsafe=True), entered after warm-up calls, for every model alike")
    parser.add_argument("--static-input", action="store_true",
                        help="mark each token count's input a static address (torch._dynamo.mark_static_address), "
                             "so that reduce-overhead's CUDA graphs read it in place instead of copying it")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, host timing (any device)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hidden, ffn = (64, 128) if args.quick else (args.hidden, args.ffn)
    tokens = [int(t) for t in args.tokens.split(",")]
    modes = (args.modes or ("eager" if args.quick else "default,reduce-overhead,graph")).split(",")
    if "graph" in modes and device.type != "cuda":
        raise SystemExit("mode graph captures a CUDA graph: it needs a GPU")

    torch.manual_seed(0)
    models = {"bf16": torch.nn.Sequential(TorchMLP(hidden, ffn, device), TorchMLP(hidden, ffn, device))}
    for name, recipe in (("current", Float8CurrentScaling()), ("delayed", DelayedScaling())):
        models[f"fp8 {name}"] = frozen_blocks(recipe, hidden, ffn, device, 0)
        if args.weight_only_tokens > 0:        # 0: no weight-only variants
            models[f"fp8 {name} weight-only<={args.weight_only_tokens}"] = frozen_blocks(
                recipe, hidden, ffn, device, args.weight_only_tokens)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": datetime.date.today().isoformat(), "hidden": hidden, "ffn": ffn,
              "command": " ".join(sys.argv), "skip_guards": args.skip_guards,
              "static_input": args.static_input, "resident_bytes": {k: resident_bytes(m) for k, m in models.items()},
              "ms": {}, "host_us": {}}
    print(f"two LayerNormMLP {hidden}x{ffn} blocks, bf16, on {result['device']}")
    for name, b in result["resident_bytes"].items():
        print(f"  resident {name:<32}{b / 2**20:10.1f} MiB  {b / result['resident_bytes']['bf16']:.3f}x bf16")
    with torch.no_grad():
        for mode in modes:
            for n in tokens:
                x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16)
                if args.static_input and mode != "eager":
                    torch._dynamo.mark_static_address(x)
                row, host = {}, {}
                for name, model in models.items():
                    torch._dynamo.reset()
                    fn = model if mode == "eager" else torch.compile(
                        model, mode=None if mode in ("default", "graph") else mode, fullgraph=True)
                    if mode == "graph":
                        fn = captured(fn, x)
                    stance = contextlib.nullcontext()
                    if args.skip_guards and mode in ("default", "reduce-overhead"):
                        for _ in range(3):      # compiled and recorded before the guards are skipped
                            fn(x)
                        stance = torch.compiler.set_stance(skip_guard_eval_unsafe=True)
                    with stance:
                        row[name] = time_ms(lambda: fn(x), device, args.quick)
                        if mode == "reduce-overhead":
                            host[name] = host_us_per_call(fn, x)
                result["ms"][f"{mode}/{n}"] = row
                print(f"{mode:>16} {n:>5} tokens: " + "  ".join(
                    f"{k} {v:.3f} ms ({row['bf16'] / v:.2f}x)" for k, v in row.items()))
                if host:
                    result["host_us"][f"{mode}/{n}"] = dict(host)
                    print(f"{'':>16} {'':>5} host per call: " + "  ".join(f"{k} {v:.0f} us" for k, v in host.items()))
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
