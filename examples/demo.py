"""Train a small te_func MLP with high precision and with each FP8 recipe.

A 3-layer MLP regresses a fixed random "teacher" MLP on synthetic data. The
training loop is purely functional: `tef.value_and_grad` over 4 microbatches
per step (the weights are cast to FP8 once per step, at the first
microbatch), then an Adam update written as a function of dicts. The same
seed and data for every recipe, so the final losses compare directly.

    python examples/demo.py [--steps 20]

Runs on CUDA when available (high precision in bf16), else on CPU (float32,
as CPU bf16 GEMMs are slow).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import te_func as tef
from te_func.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling)

MICROBATCHES = 4
TOKENS = 64            # per microbatch
IN, HIDDEN, OUT = 64, 128, 16


def recipes(high_precision: str):
    return [(high_precision, None),
            ("current", Float8CurrentScaling()),
            ("mxfp8", MXFP8BlockScaling()),
            ("block", Float8BlockScaling()),
            ("delayed", DelayedScaling(amax_history_len=16))]


def make_model(device, dtype):
    return torch.nn.Sequential(
        tef.nn.Linear(IN, HIDDEN, params_dtype=dtype, device=device), torch.nn.GELU(),
        tef.nn.Linear(HIDDEN, HIDDEN, params_dtype=dtype, device=device), torch.nn.GELU(),
        tef.nn.Linear(HIDDEN, OUT, params_dtype=dtype, device=device),
    )


def make_data(steps, device, dtype):
    """(steps, microbatches, tokens, IN) inputs and the teacher's (.., OUT) targets."""
    g = torch.Generator().manual_seed(1)
    teacher = [torch.randn(IN, HIDDEN, generator=g) / IN ** 0.5, torch.randn(HIDDEN, OUT, generator=g) / HIDDEN ** 0.5]
    x = torch.randn(steps, MICROBATCHES, TOKENS, IN, generator=g)
    y = torch.tanh(x @ teacher[0]) @ teacher[1]
    return x.to(device, dtype), y.to(device, dtype)


def adam(params, grads, state, step, lr=3e-3, betas=(0.9, 0.999), eps=1e-8):
    """One Adam update as a function: returns (new_params, new_state)."""
    m = {k: betas[0] * state["m"][k] + (1 - betas[0]) * g for k, g in grads.items()}
    v = {k: betas[1] * state["v"][k] + (1 - betas[1]) * g * g for k, g in grads.items()}
    c1, c2 = 1 - betas[0] ** step, 1 - betas[1] ** step
    new = {k: p - lr * (m[k] / c1) / ((v[k] / c2).sqrt() + eps) for k, p in params.items()}
    return new, {"m": m, "v": v}


def train(recipe, steps, device, dtype, log):
    torch.manual_seed(0)
    model = make_model(device, dtype)
    x, y = make_data(steps, device, dtype)
    # Parameters and optimizer state in fp32; the layers cast the weights they read.
    params = {k: v.detach().float() for k, v in model.named_parameters()}
    opt = {"m": {k: torch.zeros_like(p) for k, p in params.items()},
           "v": {k: torch.zeros_like(p) for k, p in params.items()}}
    ws = tef.init_workspaces(model, recipe)

    def loss_fn(params, ws, x, y, first):
        out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=first)
        return F.mse_loss(out.float(), y.float()), new_ws

    step_fn = tef.value_and_grad(loss_fn)
    losses = []
    for step in range(steps):
        grads, total = {k: torch.zeros_like(p) for k, p in params.items()}, 0.0
        for i in range(MICROBATCHES):
            # The first microbatch casts the (new) weights to FP8 and caches them in ws;
            # the next three reuse that cast.
            loss, g, ws = step_fn(params, ws, x[step, i], y[step, i], i == 0)
            grads = {k: grads[k] + g[k].float() / MICROBATCHES for k in grads}
            total += loss.item() / MICROBATCHES
        params, opt = adam(params, grads, opt, step + 1)
        losses.append(total)
        log(f"  step {step + 1:3d}  loss {total:.5f}")
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    high = "bf16" if dtype == torch.bfloat16 else "fp32"
    print(f"te_func demo: {IN}-{HIDDEN}-{HIDDEN}-{OUT} MLP, {MICROBATCHES} microbatches x {TOKENS} tokens, "
          f"{args.steps} steps, on {device} ({high} activations)")
    results = []
    for name, recipe in recipes(high):
        print(f"{name}: {type(recipe).__name__ if recipe is not None else 'high precision'}")
        start = time.perf_counter()
        losses = train(recipe, args.steps, device, dtype, print)
        results.append((name, losses[0], losses[-1], time.perf_counter() - start))
    print(f"\n{'recipe':<10}{'first loss':>12}{'final loss':>12}{'seconds':>10}")
    for name, first, last, seconds in results:
        print(f"{name:<10}{first:>12.5f}{last:>12.5f}{seconds:>10.1f}")


if __name__ == "__main__":
    main()
