"""Eager (not compiled) forward+backward with te_func's fused cast kernels off and on, in one process.

    python3 benchmarks/eager_cast.py [--out results.json] [--quick]

Times the steps of bench_cases.py (Workload compiled=False) for torch-bf16, te-bf16 and
te-current (te-delayed for the Linear), with te_func.kernels.set_cast_kernels(False / True),
checks that both settings give bit-identical losses and gradients, and times one
quantize_with_transpose (current scaling, bf16 input) of activation-sized tensors.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # te_func from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_cases as cases  # noqa: E402
import te_func.kernels as kernels  # noqa: E402
from run import time_ms  # noqa: E402
from te_func.kernels import dispatch  # noqa: E402
from te_func.quant import quantize_with_transpose, scheme_for  # noqa: E402
from te_func.recipe import Float8CurrentScaling  # noqa: E402


def _workloads(quick: bool):
    shapes = [((64, 32, 64), "mlp")] if quick else \
        [((16384, 4096, 14336), "mlp"), ((8192, 8192, 28672), "mlp"), ((8192, 8192, 8192), "linear")]
    return [cases.Workload(f"eager_{kind}_{'x'.join(map(str, s))}", kind, s, compiled=False) for s, kind in shapes]


def _leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _same(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                           y.view(torch.uint8) if y.element_size() == 1 else y) for x, y in zip(_leaves(a), _leaves(b)))


def _time_setting(step, device, quick, on: bool, soft: bool = False):
    kernels.set_cast_kernels(on)
    cast_module = dispatch._cast_module()
    if cast_module is not None:
        cast_module.SOFT_ROUND = soft
    before = dispatch.calls["fused"]
    out = step.fn()
    return time_ms(step.fn, device, quick), dispatch.calls["fused"] - before, out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs, rows = cases.Inputs(device), []
    soft_default = getattr(dispatch._cast_module(), "SOFT_ROUND", False)
    for w in _workloads(args.quick):
        base = time_ms(cases.build("torch-bf16", w, inputs, compile_ok=False).fn, device, args.quick)
        rows.append({"workload": w.name, "variant": "torch-bf16", "ms": base, "vs bf16": 1.0})
        for variant in ["te-bf16", "te-current"] + (["te-delayed"] if w.kind == "linear" else []):
            step = cases.build(variant, w, inputs, compile_ok=False)
            settings = [("off", False, False), ("on", True, soft_default)]
            if variant == "te-current" and not args.quick:
                settings.append(("on, soft rounding", True, True))
            outs = {}
            for name, on, soft in settings:
                ms, fused, outs[name] = _time_setting(step, device, args.quick, on, soft)
                rows.append({"workload": w.name, "variant": variant, "kernels": name, "ms": ms,
                             "vs bf16": base / ms, "fused casts per step": fused,
                             "bit-identical to off": _same(outs[name], outs["off"])})
                print(rows[-1], flush=True)
            del step, outs
            torch.cuda.empty_cache() if device.type == "cuda" else None
    scheme = scheme_for(Float8CurrentScaling(), "input")
    for shape in [(64, 32)] if args.quick else [(16384, 4096), (16384, 14336), (8192, 28672)]:
        x = torch.randn(shape, device=device, dtype=torch.bfloat16)
        for name, on in [("off", False), ("on", True)]:
            kernels.set_cast_kernels(on)
            ms = time_ms(lambda: quantize_with_transpose(x, scheme), device, args.quick)
            gbytes = x.numel() * 4 / 1e9                 # bf16 read once + two FP8 copies written
            rows.append({"workload": f"cast_with_transpose_{'x'.join(map(str, shape))}", "kernels": name,
                         "ms": ms, "GB/s (4 B/element)": gbytes / (ms / 1e3)})
            print(rows[-1], flush=True)
    kernels.set_cast_kernels(False)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda"
                                              else "cpu", "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
