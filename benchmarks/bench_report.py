"""The benchmark's outputs: results.json, results.md (tables) and speedup.png (bars)."""
from __future__ import annotations

import json
from pathlib import Path

from bench_cases import BASELINE, VARIANTS


def with_ratios(results: list[dict]) -> list[dict]:
    """Adds `vs_bf16`: the plain-torch bf16 time of the same workload over this time."""
    base = {r["workload"]: r["median_ms"] for r in results
            if r["variant"] == BASELINE and r.get("status") == "ok"}
    for r in results:
        b = base.get(r["workload"])
        r["vs_bf16"] = round(b / r["median_ms"], 3) if b and r.get("status") == "ok" else None
    return results


def _order(results):
    names = list(dict.fromkeys(r["workload"] for r in results))
    return sorted(results, key=lambda r: (names.index(r["workload"]),
                                          VARIANTS.index(r["variant"]) if r["variant"] in VARIANTS else 99))


def _cell(v, fmt="{}"):
    return "" if v is None else fmt.format(v)


def markdown(env: dict, results: list[dict]) -> str:
    lines = ["# te_func benchmark", "", ", ".join(f"{k}: {v}" for k, v in env.items()), "",
             "Speed-up over plain torch bf16 (compiled; eager rows eager), higher is better:", ""]
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in results)]
    lines += ["| workload | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    cell = {(r["workload"], r["variant"]): r for r in results}
    for w in workloads:
        row = []
        for v in variants:
            r = cell.get((w, v), {})
            row.append(_cell(r.get("vs_bf16"), "{:.2f}x") if r.get("status") == "ok" else r.get("status", ""))
        lines.append(f"| {w} | " + " | ".join(row) + " |")
    lines += ["", "| workload | variant | status | median ms | vs bf16 | TFLOP/s | peak GiB | first call s | note / error |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in _order(results):
        lines.append(f"| {r['workload']} | {r['variant']} | {r.get('status', '')} | {_cell(r.get('median_ms'))} | "
                     f"{_cell(r.get('vs_bf16'), '{:.2f}x')} | {_cell(r.get('tflops'))} | {_cell(r.get('peak_gib'))} | "
                     f"{_cell(r.get('first_call_s'))} | {(r.get('error') or r.get('note') or '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def summary(results: list[dict]) -> str:
    lines = [f"{'workload':34s} {'variant':14s} {'ms':>9s} {'x bf16':>7s} {'TFLOP/s':>8s} {'GiB':>7s}"]
    for r in _order(results):
        if r.get("status") == "ok":
            lines.append(f"{r['workload']:34s} {r['variant']:14s} {r['median_ms']:9.3f} "
                         f"{_cell(r.get('vs_bf16'), '{:.2f}'):>7s} {_cell(r.get('tflops')):>8s} "
                         f"{_cell(r.get('peak_gib')):>7s}")
        else:
            lines.append(f"{r['workload']:34s} {r['variant']:14s} {r.get('status')}: "
                         f"{(r.get('error') or r.get('note') or '')[:120]}")
    return "\n".join(lines)


def plot(path: Path, results: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in dict.fromkeys(r["workload"] for r in results)
                 if any(r["workload"] == w and r.get("vs_bf16") for r in results)]
    variants = [v for v in VARIANTS if any(r["variant"] == v and r.get("vs_bf16") for r in results)]
    cell = {(r["workload"], r["variant"]): r.get("vs_bf16") or 0.0 for r in results}
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(workloads)), 5))
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(workloads))]
        ax.bar(xs, [cell.get((w, v), 0.0) for w in workloads], width, label=v)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(workloads)), workloads, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speed-up over torch bf16 (higher is better)")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, env: dict, results: list[dict]) -> None:
    results = with_ratios(results)
    (out / "results.json").write_text(json.dumps({"environment": env, "results": _order(results)}, indent=1))
    (out / "results.md").write_text(markdown(env, results))
    try:
        plot(out / "speedup.png", results)
    except ImportError as e:    # matplotlib is optional (the `bench` extra)
        (out / "speedup.png.missing").write_text(f"no plot: {e}\n")
