"""A reduce-overhead decode call split into the host's time and the GPU's, per model.

    python3 benchmarks/probes/decode_host.py [--tokens 1,16,64] [--out FILE]
    python3 benchmarks/probes/decode_host.py --tokens 16 --kernels

The two LayerNormMLP 4096x14336 blocks of benchmarks/inference.py (torch bf16, frozen
Float8CurrentScaling and DelayedScaling), compiled with mode="reduce-overhead". Under that mode a
call costs the host (dynamo's guard check, the CUDA graph trees' bookkeeping) about as much as
the GPU's work, and a loop of calls measures whichever is slower. Here a sleep kernel holds the
GPU while the host issues each call: the host's time is then its own (never blocked by a full
launch queue), and CUDA events around the call time only its GPU work. Each model is measured
with the guard check on and off (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`), and
the same compiled model captured whole into one CUDA graph (inference.py's mode "graph") gives
the GPU time without the trees. Medians of 50 calls, in us.

`--kernels` instead prints, per model, the kernels of one call in both modes, from torch.profiler;
it times nothing: a run that profiled bf16's kernels before timing the frozen models found their
calls at 180-370 us of host time, against 80-126 us in runs that profiled nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from inference import TorchMLP, captured, frozen_blocks, host_and_gpu_us  # noqa: E402
from profile_step import kernels_per_call  # noqa: E402
from te_func.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

HIDDEN, FFN = 4096, 14336


def print_kernels(title: str, fn, x):
    kernels = kernels_per_call(lambda: fn(x), 50)
    print(f"{title}: kernels {sum(k[2] for k in kernels):.1f} us per call")
    for name, launches, us in kernels:
        print(f"    {us:7.2f} us x{launches:<3g} {name[:110]}")


def build(name: str, device):
    torch.manual_seed(0)
    if name == "bf16":
        return torch.nn.Sequential(TorchMLP(HIDDEN, FFN, device), TorchMLP(HIDDEN, FFN, device))
    recipe = {"current": Float8CurrentScaling(), "delayed": DelayedScaling()}[name]
    return frozen_blocks(recipe, HIDDEN, FFN, device, 0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    with torch.no_grad():
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
            for name in ("bf16", "current", "delayed"):
                model = build(name, device)
                torch._dynamo.reset()
                compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
                for _ in range(5):      # compiled, recorded, replayed
                    compiled(x)
                if args.kernels:
                    print_kernels(f"{tokens} tokens {name}, reduce-overhead", compiled, x)
                    torch._dynamo.reset()
                    print_kernels(f"{tokens} tokens {name}, one CUDA graph",
                                  captured(torch.compile(model, fullgraph=True), x), x)
                    continue
                host, gpu = host_and_gpu_us(compiled, x)
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    host_skip, gpu_skip = host_and_gpu_us(compiled, x)
                torch._dynamo.reset()
                replay = captured(torch.compile(model, fullgraph=True), x)
                _, graph_gpu = host_and_gpu_us(replay, x)
                row = {"tokens": tokens, "model": name, "host_us": host, "gpu_us": gpu,
                       "host_skip_guards_us": host_skip, "gpu_skip_guards_us": gpu_skip, "graph_gpu_us": graph_gpu}
                rows.append(row)
                print(f"{tokens:>3} tokens {name:<8} reduce-overhead: host {host:6.1f} us, GPU {gpu:6.1f} us; "
                      f"guards skipped: host {host_skip:6.1f}, GPU {gpu_skip:6.1f}; "
                      f"one CUDA graph: GPU {graph_gpu:6.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
