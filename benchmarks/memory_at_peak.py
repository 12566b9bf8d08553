"""What a benchmark step holds at its memory peak: the tensors it allocated, alive at the peak.

    python3 benchmarks/memory_at_peak.py mlp_16384x4096x14336/te-current [more workload/variant ...] [--out DIR]

Builds each named case as `benchmarks/run.py` does (compiled, warmed up), records one call with
torch.cuda.memory's allocation history, replays the allocations and frees in order to find the
moment the step held the most, and writes, per case, the allocations alive then, largest first,
with the line that made each (the generated code's line for a compiled step, te_func's or
torch's for an eager one) to DIR/memory_<case>.txt. What the case keeps between calls
(parameters, workspaces, inputs) was allocated before the recording and is counted apart.
"""
from __future__ import annotations

import argparse
import linecache
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_cases import Inputs, build, workloads  # noqa: E402
from profile_step import each_case  # noqa: E402

MiB = 2**20
# The frame that says who made a tensor: generated code first, then te_func, then the benchmark.
MARKS = ("torchinductor", "te_func", "benchmarks")


def _maker(frames: list[dict]) -> str:
    f = next((f for mark in MARKS for f in frames if mark in f["filename"]), frames[0] if frames else None)
    if f is None:
        return "?"
    where = f"{Path(f['filename']).name}:{f['line']} {f['name']}"
    if "torchinductor" not in f["filename"]:
        return where
    # Generated code: the allocation and the lines after it say what fills the buffer (a kernel
    # named after its ops, or an extern GEMM), and inductor's comments name the source ops.
    text = [t[:110] for t in (linecache.getline(f["filename"], f["line"] + i).strip() for i in range(4)) if t]
    return " | ".join([where, *text])


def alive_at_peak(events: list[dict]) -> tuple[int, list[tuple[int, str]]]:
    """(peak bytes above the start, [(bytes, maker)] of the allocations alive at the peak)."""
    live, total, peak, at = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
        if total > peak:
            peak, at = total, i
    live = {}
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _maker(e.get("frames", [])))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return peak, sorted(live.values(), key=lambda r: -r[0])


def memory_case(case: str, device, keep_weight_cache: bool) -> dict:
    wname, variant = case.split("/")
    w = next(w for w in workloads(False) if w.name == wname)
    step = build(variant, w, Inputs(device), compile_ok=True, keep_weight_cache=keep_weight_cache)
    for _ in range(3):
        step.fn()
    step.reset()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        step.fn()
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][device.index or 0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, alive = alive_at_peak(events)
    lines = [f"{case}: kept between calls {step.resident_bytes / 2**30:.3f} GiB, the call's peak above that "
             f"{peak / 2**30:.3f} GiB, {len(alive)} allocations alive at the peak:", ""]
    lines += [f"{size / MiB:9.1f} MiB  {maker}" for size, maker in alive]
    return {"case": case, "resident_gib": round(step.resident_bytes / 2**30, 3),
            "peak_above_gib": round(peak / 2**30, 3), "table": "\n".join(lines)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="+", help="workload/variant, as in benchmarks/run.py's results")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--keep-weight-cache", action="store_true", help="as benchmarks/run.py's")
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    each_case(args.cases, args.out, "memory", lambda case: memory_case(case, device, args.keep_weight_cache))


if __name__ == "__main__":
    main()
