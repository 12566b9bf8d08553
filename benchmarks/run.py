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

On a GPU each workload runs in a process of its own, one after the other: its
variants compile, warm up and are timed there, so nothing else runs on the
machine while it times (compiling many processes at once skewed a figure by
15% before; --jobs N brings that mode back for quick looks). `--quick` runs tiny
shapes eagerly on any device (the CPU smoke test).
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
    """Median milliseconds of one call: triton.testing.do_bench on a GPU (it flushes L2 between
    calls; ~0.6 s of calls, at least 5), else a few host-timed calls."""
    if device.type == "cuda" and not quick:
        from triton.testing import do_bench
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        estimate = (time.perf_counter() - t0) * 1e3
        return do_bench(fn, warmup=max(100, 2 * estimate), rep=max(600, 5 * estimate), return_mode="median")
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
        step = cases.build(variant, w, inputs, compile_ok=not args.quick, keep_weight_cache=args.keep_weight_cache)
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
    """Warm every case of `variants`, wait for the other processes, then time under `lock`.
    Alone (no barrier), each case is timed as soon as it is warm and freed before the next."""
    torch._dynamo.config.cache_size_limit = 256          # one step function, many models and shapes
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    inputs = cases.Inputs(device)
    if barrier is None:
        return _run_one_by_one(variants, selected, args, device, inputs)
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


def _run_one_by_one(variants, selected, args, device, inputs):
    results = []
    for w in selected:
        for v in variants:
            if (w, v) not in selected[w]:
                continue
            if time.monotonic() > args.warm_deadline:
                results.append(_record(v, w, status="skipped", note="--compile-budget-s ran out"))
                continue
            step, rec = _warm(v, w, inputs, args, device)
            if step is not None:
                rec.update(_measure(step, w, args, device))
            results.append(_record(v, w, **rec))
            print(f"[time] {w.name:32s} {v:20s} first {rec.get('first_call_s')} s, "
                  f"{rec.get('median_ms', rec.get('status'))} ms, {rec.get('peak_gib')} GiB", flush=True)
            del step
            if device.type == "cuda":     # the next variant's peak memory starts from what this one left
                gc.collect()
                torch.cuda.empty_cache()
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


def _one_workload(selected, args, queue):
    device = torch.device("cuda")
    try:
        queue.put(run_variants(cases.VARIANTS, selected, args, device))
    except BaseException as e:
        queue.put([{"variant": "*", "workload": next(iter(selected)).name, "status": "error",
                    "error": _error_text(e)}])


def _per_workload(selected, args) -> list[dict]:
    """Each workload in a fresh process, one after the other."""
    ctx = mp.get_context("spawn")
    results = []
    for w, keep in selected.items():
        queue = ctx.Queue()
        proc = ctx.Process(target=_one_workload, args=({w: keep}, args, queue))
        proc.start()
        try:
            results += queue.get(timeout=args.workload_timeout_s)
        except Exception:
            results.append({"workload": w.name, "variant": "*", "status": "error",
                            "error": f"no result within {args.workload_timeout_s} s (exit code {proc.exitcode})"})
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return results


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
    ap.add_argument("--jobs", type=int, default=None,
                    help="compile in N parallel processes, then time one at a time (default: one process per "
                         "workload, in sequence, on a GPU; all in this process with --quick or on CPU)")
    ap.add_argument("--compile-budget-s", type=float, default=1e9,
                    help="stop building and compiling new cases after this many seconds (they are reported skipped)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing variants")
    ap.add_argument("--workload-timeout-s", type=float, default=900, help="per-workload process time limit")
    ap.add_argument("--keep-weight-cache", action="store_true",
                    help="te_func's workspaces keep the weight casts on every workload (default: only where a call "
                         "reads them again, train8_cache and infer)")
    args = ap.parse_args(argv)
    args.warm_deadline = time.monotonic() + args.compile_budget_s

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    selected = _selection(args)
    jobs = args.jobs or 1
    t0 = time.perf_counter()
    if args.jobs is None and device.type == "cuda" and not args.quick:
        results = _per_workload(selected, args)
    elif jobs == 1:
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
