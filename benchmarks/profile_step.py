"""Where a benchmark step's GPU time goes: its kernels, grouped, against the step's time.

    python3 benchmarks/profile_step.py mlp_16384x4096x14336/te-current [more workload/variant ...] [--out DIR]

Builds each named case as `benchmarks/run.py` does (compiled, warmed up), then
records a few calls with torch.profiler and writes, per case, the kernels by
total GPU time (name, calls per step, us per step, share) to DIR/profile_<case>.txt
and a summary (GEMM time, the rest, the step's wall time, its peak memory as run.py takes it) to DIR/profile.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_cases import Inputs, build, workloads  # noqa: E402
from run import _peak_bytes, time_ms  # noqa: E402

STEPS = 5
# cuBLAS / CUTLASS GEMM kernels (bf16 and FP8 alike) and inductor's Triton GEMM templates.
# (Inductor names its pointwise kernels by the ops they feed too: "triton_poi_fused__scaled_mm_..."
# is a cast, not a GEMM.)
GEMM_MARKS = ("gemm", "sm90_xmma", "cutlass", "nvjet", "triton_tem")


def is_gemm(name: str) -> bool:
    return not name.startswith(("triton_poi", "triton_red", "triton_per")) and any(m in name.lower() for m in GEMM_MARKS)


def kernels_per_call(fn, calls: int) -> list[tuple[str, float, float]]:
    """`calls` calls of fn() under torch.profiler: (kernel name, launches per call, us per call),
    by GPU time, largest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time
    return sorted(((n, c / calls, us / calls) for n, (c, us) in kernels.items()), key=lambda r: -r[2])


def profile_case(case: str, device, keep_weight_cache: bool = False) -> dict:
    wname, variant = case.split("/")
    w = next(w for w in workloads(False) if w.name == wname)
    step = build(variant, w, Inputs(device), compile_ok=True, keep_weight_cache=keep_weight_cache)
    for _ in range(3):
        step.fn()
    torch.cuda.synchronize()
    ms = time_ms(step.fn, device)
    peak = _peak_bytes(step, device)
    rows = kernels_per_call(step.fn, STEPS)
    total = sum(r[2] for r in rows)
    gemm = sum(r[2] for r in rows if is_gemm(r[0]))
    lines = [f"{case}: step {ms * 1e3:.0f} us (do_bench median), kernels {total:.0f} us, "
             f"GEMMs {gemm:.0f} us, other {total - gemm:.0f} us, peak {peak / 2**30:.2f} GiB", ""]
    lines += [f"{us:9.1f} us {100 * us / total:5.1f}% x{calls:<4g} {'GEMM ' if is_gemm(n) else ''}{n[:160]}"
              for n, calls, us in rows]
    return {"case": case, "step_us": ms * 1e3, "kernel_us": total, "gemm_us": gemm, "other_us": total - gemm,
            "peak_gib": round(peak / 2**30, 3), "table": "\n".join(lines)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="+", help="workload/variant, as in benchmarks/run.py's results")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="a torch._inductor.config setting for every case (e.g. triton.prefer_nd_tiling=True)")
    p.add_argument("--keep-weight-cache", action="store_true", help="as benchmarks/run.py's")
    args = p.parse_args()
    import torch._inductor.config as inductor_config
    for setting in args.inductor:
        key, value = setting.split("=", 1)
        *path, name = key.split(".")
        owner = inductor_config
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, {"True": True, "False": False}.get(value, int(value) if value.isdigit() else value))
    device = torch.device("cuda")
    each_case(args.cases, args.out, "profile", lambda case: profile_case(case, device, args.keep_weight_cache))


def each_case(cases: list[str], out: Path, name: str, measure) -> None:
    """measure(case) -> a dict with a "table" for each case: the table to out/{name}_<case>.txt,
    the rest to out/{name}.json. A case that fails is recorded there; the others go on."""
    out.mkdir(parents=True, exist_ok=True)
    summary = []
    for case in cases:
        try:
            r = measure(case)
        except Exception as e:     # one case failing must not lose the others'
            summary.append({"case": case, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(case, "failed:", summary[-1]["error"], flush=True)
            continue
        (out / f"{name}_{case.replace('/', '__')}.txt").write_text(r.pop("table") + "\n")
        summary.append(r)
        print(json.dumps(r), flush=True)
        torch.compiler.reset()
        torch.cuda.empty_cache()
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
