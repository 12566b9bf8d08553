"""te_func vs bf16 torch vs torchao float8 on one GPU: speed, TFLOP/s and peak memory.

    python3 benchmarks/run.py [--quick] [--only NAME[,NAME...]] [--out DIR] [--jobs N]

What is timed: one call of each case's step (benchmarks/bench_cases.py), after
warm-up (the first call compiles), median of CUDA-event timings over repeated
calls. Forward+backward steps compute the gradients of every parameter and of
the input from loss = sum(out * dy), dy random; te_func's step is
`torch.compile(tef.value_and_grad(loss_fn), fullgraph=True)`, plain torch's
and torchao's a compiled `sum(module(x) * dy)` followed by `.backward()`.
Peak memory = the bytes the case keeps resident (parameters, workspaces,
inputs) + the largest allocation growth during one call.

Compiling ~80 graphs one after the other takes longer than the timing, so on
a GPU with --jobs > 1 the variants compile in parallel processes, then time
one process at a time (a shared lock) so that no timing overlaps other work.
`--quick` runs tiny shapes eagerly on any device (the CPU smoke test).
"""
from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # te_func from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_cases as cases  # noqa: E402
import bench_report as report  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, quick: bool = False) -> float:
    """Median milliseconds of one call; enough repeats for ~0.4 s (5 to 50); 2 with --quick on CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(2 if quick else 5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    estimate = (time.perf_counter() - t0) * 1e3
    reps = 5 if quick else int(min(50, max(5, 400 / max(estimate, 1e-3))))
    for _ in range(2):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _peak_bytes(step, device) -> int | None:
    if device.type != "cuda":
        return None
    step.reset()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = step.fn()
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - base
    del out
    return step.resident_bytes + growth


def _record(variant, w, **fields):
    return {"workload": w.name, "kind": w.kind, "shape": list(w.shape), "compiled": w.compiled,
            "variant": variant, **fields}


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def _error_detail(e: BaseException) -> str:
    """The end of the message: dynamo puts the user-code stack there."""
    return str(e)[-1500:]


def _warm(variant, w, inputs, args, device):
    """Build and call once (compiles). Returns (step or None, partial record)."""
    try:
        step = cases.build(variant, w, inputs, compile_ok=not args.quick)
        t0 = time.perf_counter()
        step.fn()
        _sync(device)
        return step, {"first_call_s": round(time.perf_counter() - t0, 2), "note": step.note}
    except cases.NotApplicable as e:
        return None, {"status": "n/a", "note": str(e)}
    except Exception as e:  # a variant that cannot run is a result, not a crash
        if args.verbose:
            traceback.print_exc()
        return None, {"status": "error", "error": _error_text(e), "detail": _error_detail(e)}


def _measure(step, w, args, device):
    try:
        ms = time_ms(step.fn, device, args.quick)
        peak = _peak_bytes(step, device)
    except Exception as e:
        return {"status": "error", "error": _error_text(e)}
    flops = w.gemm_flops
    return {"status": "ok", "median_ms": round(ms, 4),
            "tflops": round(flops / ms / 1e9, 1) if flops else None,
            "peak_gib": None if peak is None else round(peak / 2**30, 3)}


def run_variants(variants, selected, args, device, barrier=None, lock=None):
    """Warm every case of `variants`, wait for the other processes, then time under `lock`."""
    torch._dynamo.config.cache_size_limit = 256          # one step function, many models and shapes
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    inputs = cases.Inputs(device)
    warmed = []
    for w in selected:
        for v in variants:
            if (w, v) not in selected[w]:
                continue
            if time.monotonic() > args.warm_deadline:
                warmed.append((v, w, None, {"status": "skipped", "note": "--compile-budget-s ran out"}))
                continue
            step, rec = _warm(v, w, inputs, args, device)
            warmed.append((v, w, step, rec))
            print(f"[warm] {w.name:32s} {v:14s} {rec.get('first_call_s', rec.get('status'))}", flush=True)
    if barrier is not None:
        try:
            barrier.wait()
        except Exception:   # another process died: time what is here anyway
            pass
    results = []
    with lock if lock is not None else _nullcontext():
        for v, w, step, rec in warmed:
            if step is not None:
                rec.update(_measure(step, w, args, device))
            results.append(_record(v, w, **rec))
            print(f"[time] {w.name:32s} {v:14s} {rec.get('median_ms', rec.get('status'))} ms", flush=True)
    del warmed
    gc.collect()
    return results


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _worker(variants, selected, args, barrier, lock, queue):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        queue.put(run_variants(variants, selected, args, device, barrier, lock))
    except BaseException as e:
        barrier.abort()
        queue.put([{"variant": v, "workload": "*", "status": "error", "error": _error_text(e)} for v in variants])


def _selection(args):
    only = [s for s in (args.only or "").split(",") if s]
    selected = {}
    for w in cases.workloads(args.quick):
        keep = {(w, v) for v in cases.VARIANTS if not only or any(s in f"{w.name}/{v}" for s in only)}
        if keep:
            selected[w] = keep
    return selected


def _groups(jobs: int):
    """Variants split over `jobs` processes, the compile-heavy te_func ones spread out."""
    groups = [[] for _ in range(max(1, min(jobs, len(cases.VARIANTS))))]
    for i, v in enumerate(cases.VARIANTS):
        groups[i % len(groups)].append(v)
    return groups


def environment(device) -> dict:
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device),
           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "command": "python3 benchmarks/run.py " + " ".join(sys.argv[1:])}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    for mod in ("triton", "torchao"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:
            env[mod] = f"not importable ({_error_text(e)})"
    return env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, eager, few repeats (runs on CPU)")
    ap.add_argument("--only", help="comma-separated substrings of 'workload/variant' to run")
    ap.add_argument("--out", default="bench_out", help="directory for results.json, results.md, speedup.png")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: 8 on a GPU, 1 with --quick or on CPU)")
    ap.add_argument("--compile-budget-s", type=float, default=1e9,
                    help="stop building and compiling new cases after this many seconds (they are reported skipped)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing variants")
    args = ap.parse_args(argv)
    args.warm_deadline = time.monotonic() + args.compile_budget_s

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    selected = _selection(args)
    jobs = args.jobs or (8 if device.type == "cuda" and not args.quick else 1)
    t0 = time.perf_counter()
    if jobs == 1:
        results = run_variants(cases.VARIANTS, selected, args, device)
    else:
        # Each process compiles with its own pool of workers: keep the sum near the core count.
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 8) // jobs)))
        ctx = mp.get_context("spawn")
        groups = _groups(jobs)
        barrier, lock, queue = ctx.Barrier(len(groups)), ctx.Lock(), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(g, selected, args, barrier, lock, queue)) for g in groups]
        for p in procs:
            p.start()
        results, pending = [], len(procs)
        while pending:
            try:
                results += queue.get(timeout=5)
                pending -= 1
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and len(dead) >= pending:
                    break
                if dead:
                    barrier.abort()   # a crashed process never reaches the barrier
        for p in procs:
            p.join(timeout=30)
    env = environment(device)
    env["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write(out, env, results)
    print(report.summary(results))
    print(f"wrote {out}/results.json, results.md, speedup.png in {env['wall_s']} s")


if __name__ == "__main__":
    main()
