"""What the installed torch compiles of te_func, probed on a tiny Linear before the real cases.

Older torch releases (2.11 on the GPU machine) refuse two things that torch
2.13 compiles: `torch.compiler.assume_constant_result` on a frozen-dataclass
argument (te_func.frame.recipe_key), and possibly parts of tef.value_and_grad.
Rather than report no te_func numbers, the benchmark probes each and, where
one fails, times the nearest equivalent and says so in every affected row:
- `recipe_key`: replaced by a lookup of the same string, stored on the recipe
  object beforehand (the key only names the workspace's recipe; no math);
- `tef.value_and_grad`: replaced by `torch.func.grad_and_value` over the same
  loss (identical for recipes without backward-time state; not for DelayedScaling).
"""
from __future__ import annotations

import torch

import te_func as tef
import te_func.frame as frame
from te_func.recipe import Float8CurrentScaling

_ORIGINAL_KEY = frame.recipe_key


def _keyed_recipe_key(recipe):
    if recipe is None:
        return frame._RECIPE_PREFIX + "None"
    return recipe._bench_recipe_key


def patch_recipe_key(recipes):
    for r in recipes:
        if r is not None:
            object.__setattr__(r, "_bench_recipe_key", frame._RECIPE_PREFIX + repr(r))
    frame.recipe_key = _keyed_recipe_key


def _error(e):
    return f"{type(e).__name__}: {str(e)[-1200:]}"


def _try(fn):
    try:
        fn()
        return None
    except Exception as e:
        return _error(e)


def probe(device, recipes) -> dict:
    """Returns {"recipe_key_shim": bool, "grad": "tef" | "torch.func", "errors": {...}}."""
    torch._dynamo.reset()
    recipe = Float8CurrentScaling()
    model = tef.nn.Linear(256, 256, params_dtype=torch.bfloat16, device=device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    out = {"recipe_key_shim": False, "grad": "tef", "errors": {}}

    def loss_fn(params, ws, x):
        y, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe)
        return y.float().square().sum(), new_ws

    def infer():
        ws = tef.init_workspaces(model, recipe)
        torch.compile(lambda p, w, x: tef.functional_call(model, p, w, (x,), recipe=recipe)[0],
                      fullgraph=True)(params, ws, x)

    def grad_tef():
        torch.compile(tef.value_and_grad(loss_fn), fullgraph=True)(params, tef.init_workspaces(model, recipe), x)

    def grad_func():
        torch.compile(torch.func.grad_and_value(loss_fn, has_aux=True), fullgraph=True)(
            params, tef.init_workspaces(model, recipe), x)

    err = _try(infer)
    if err:
        out["errors"]["functional_call"] = err
        patch_recipe_key([*recipes, recipe])
        out["recipe_key_shim"] = True
        err = _try(infer)
        if err:
            out["errors"]["functional_call_with_shim"] = err
    err = _try(grad_tef)
    if err:
        out["errors"]["tef.value_and_grad"] = err
        err = _try(grad_func)
        if err:
            out["errors"]["torch.func.grad_and_value"] = err
        else:
            out["grad"] = "torch.func"
    torch._dynamo.reset()
    return out
