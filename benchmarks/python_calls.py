"""Python calls per eager training step, counted by cProfile (any device; CPU by default).

    python3 benchmarks/python_calls.py [--layers 8] [--show "tef.grad delayed"]

One forward+backward of `layers` x `tef.nn.Linear(64, 64)` (32 tokens), after three warm-up
steps, through `tef.Stateful` and through `tef.grad` over `tef.functional_call`, under
DelayedScaling and current scaling; beside it torch's `nn.Linear` and plain `torch.func.grad`
over `torch.func.functional_call` of the same torch layers. At these sizes the step's time is
its Python: the count is what te_func adds on the host per step. --show prints one row's
functions by call count.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import te_func as tef  # noqa: E402
from te_func.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

WARM_UP = 3


def counted(step) -> pstats.Stats:
    for _ in range(WARM_UP):
        step()
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    return pstats.Stats(profiler)


def steps(layers: int, device: torch.device) -> dict:
    """Row name -> one training step."""
    x = torch.randn(32, 64, device=device)

    def stack(layer):
        torch.manual_seed(0)
        return nn.Sequential(*[layer(64, 64, device=device) for _ in range(layers)])

    rows = {}
    for name, recipe in (("delayed", DelayedScaling()), ("current", Float8CurrentScaling())):
        shell = tef.Stateful(stack(tef.nn.Linear), recipe)
        rows[f"tef.Stateful {name}"] = lambda shell=shell: shell(x).square().mean().backward()
        model = stack(tef.nn.Linear)
        params = {k: v.detach() for k, v in model.named_parameters()}
        ws = [tef.init_workspaces(model, recipe)]

        def loss(p, w, model=model, recipe=recipe):
            out, new_ws = tef.functional_call(model, p, w, (x,), recipe=recipe)
            return out.square().mean(), new_ws

        def grad_step(loss=loss, params=params, ws=ws):
            _, ws[0] = tef.grad(loss)(params, ws[0])
        rows[f"tef.grad {name}"] = grad_step
    torch_model = stack(nn.Linear)
    rows["torch nn.Linear"] = lambda: torch_model(x).square().mean().backward()
    torch_params = {k: v.detach() for k, v in torch_model.named_parameters()}
    rows["torch.func.grad"] = lambda: torch.func.grad(
        lambda p: torch.func.functional_call(torch_model, p, (x,)).square().mean())(torch_params)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--show", help="a row whose functions to print, by call count")
    args = parser.parse_args(argv)
    stats = {name: counted(step) for name, step in steps(args.layers, torch.device(args.device)).items()}
    print(f"Python calls per eager step, {args.layers} x Linear(64, 64), {args.device}:")
    for name, s in stats.items():
        print(f"| {name} | {s.total_calls} |")
    if args.show:
        stats[args.show].sort_stats("ncalls").print_stats(40)


if __name__ == "__main__":
    main()
