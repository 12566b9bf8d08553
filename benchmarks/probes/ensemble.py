"""An ensemble vmapped over stacked weights, forward and backward: te_func's FP8 against torch bf16.

    python3 benchmarks/probes/ensemble.py [--members 8] [--tokens 4096] [--width 4096] [--eager] [--quick]

Each of `members` MLPs (Linear(width, width), GELU(tanh), Linear(width, width)) gets its own
`tokens` x `width` input and output gradient: the gradient of every parameter of every member,
one `torch.func.vmap` over the stacked members. torch: `torch.func.stack_module_state` and
`vmap(grad)` over `torch.func.functional_call` of nn.Linear members in bf16. te_func:
`tef.stack_module_state` and `vmap(tef.grad)` over `tef.functional_call` of tef.nn.Linear members,
under current and delayed scaling: both operands of every GEMM are batched, so every GEMM runs as
one grouped FP8 GEMM. Both compiled fullgraph (unless --eager); ms by triton's do_bench on a GPU,
by wall-clock medians elsewhere; --quick: tiny sizes, for a check on any machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import te_func as tef  # noqa: E402
from te_func.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402


def mlp(linear, width: int, device, dtype) -> nn.Module:
    return nn.Sequential(linear(width, width, device=device, dtype=dtype), nn.GELU(approximate="tanh"),
                         linear(width, width, device=device, dtype=dtype))


def te_linear(i, o, device, dtype):
    return tef.nn.Linear(i, o, params_dtype=dtype, device=device)


def time_ms(fn, device) -> float:
    fn()
    if device.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn)
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (any device)")
    ap.add_argument("--profile", action="store_true", help="then the kernels of 3 te_func current steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.members, args.tokens, args.width = 3, 32, 64
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    wrap = (lambda f: f) if args.eager else (lambda f: torch.compile(f, fullgraph=True))
    torch.manual_seed(0)
    n, t, w = args.members, args.tokens, args.width
    xs = torch.randn(n, t, w, device=device, dtype=dtype)
    dys = torch.randn(n, t, w, device=device, dtype=dtype)

    members = [mlp(nn.Linear, w, device, dtype) for _ in range(n)]
    params, _ = torch.func.stack_module_state(members)

    def torch_loss(p, x, dy):
        return (torch.func.functional_call(members[0], p, (x,)) * dy).sum()
    torch_step = wrap(torch.func.vmap(torch.func.grad(torch_loss)))
    base = time_ms(lambda: torch_step(params, xs, dys), device)
    print(f"{'compiled (fullgraph)' if not args.eager else 'eager'}, {n} members, {t} tokens each, "
          f"{w}->{w}->{w}, {device.type}; ms of one fwd+bwd of every member")
    print("| variant | ms | x torch |")
    print("|---|---|---|")
    print(f"| torch {str(dtype).removeprefix('torch.')} vmap(grad) | {base:.3f} | 1.00 |", flush=True)
    for name, recipe in (("current", Float8CurrentScaling()), ("delayed", DelayedScaling())):
        te_members = [mlp(te_linear, w, device, dtype) for _ in range(n)]
        te_params, _, ws = tef.stack_module_state(te_members, recipe)

        def te_loss(p, ws, x, dy, recipe=recipe, model=te_members[0]):
            out, new_ws = tef.functional_call(model, p, ws, (x,), recipe=recipe)
            return (out * dy).sum(), new_ws
        te_step = wrap(torch.func.vmap(tef.grad(te_loss)))
        try:
            ms = time_ms(lambda te_step=te_step, te_params=te_params, ws=ws: te_step(te_params, ws, xs, dys), device)
            print(f"| te_func {name} | {ms:.3f} | {base / ms:.2f} |", flush=True)
        except Exception as err:      # noqa: BLE001 (a probe: say why)
            print(f"| te_func {name} | {type(err).__name__}: {str(err)[:100]} | |", flush=True)
            continue
        if name == "current":
            # tef.stack_module_state's parameters require grad (as torch's): te_func then keeps each
            # op's linearization, which a derivative of the backward taken outside would need.
            plain = {k: v.detach() for k, v in te_params.items()}
            ms = time_ms(lambda te_step=te_step, plain=plain, ws=ws: te_step(plain, ws, xs, dys), device)
            print(f"| te_func {name}, parameters detached | {ms:.3f} | {base / ms:.2f} |", flush=True)
        if args.profile and name == "current":
            profile(lambda te_step=te_step, te_params=te_params, ws=ws: te_step(te_params, ws, xs, dys), device)


def profile(step, device) -> None:
    """The kernels of 3 steps by their total device time (ms, calls)."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=70), flush=True)


if __name__ == "__main__":
    main()
