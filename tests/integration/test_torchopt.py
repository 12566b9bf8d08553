"""torchopt's functional optimizers over tef.value_and_grad, as torchopt's docs drive a plain
functional model, and optree (torchopt's pytree library) over te_func's workspaces."""
from __future__ import annotations

import optree
import pytest
import torch
import torchopt

import te_func as tef
from te_func.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = [pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(DelayedScaling(amax_history_len=4), id="delayed")]


@pytest.mark.parametrize("recipe", RECIPES)
def test_functional_adam_trains_over_value_and_grad(recipe):
    model = torch.nn.Sequential(tef.nn.Linear(32, 32), torch.nn.GELU(), tef.nn.Linear(32, 16))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ws = tef.init_workspaces(model, recipe)
    opt = torchopt.adam(lr=1e-2)
    state = opt.init(params)
    x, y = torch.randn(8, 32), torch.randn(8, 16)

    def loss_fn(p, w):
        out, new_ws = tef.functional_call(model, p, w, (x,), recipe=recipe)
        return torch.nn.functional.mse_loss(out, y), new_ws

    losses = []
    for _ in range(5):
        loss, grads, ws = tef.value_and_grad(loss_fn)(params, ws)
        updates, state = opt.update(grads, state)
        params = torchopt.apply_updates(params, updates)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    if isinstance(recipe, DelayedScaling):       # the backward's amaxes came back with the workspaces
        assert ws["2.grad_amax_history"].abs().sum() > 0


def test_optree_maps_over_workspaces():
    model = torch.nn.Sequential(tef.nn.Linear(32, 32))
    ws = tef.init_workspaces(model, DelayedScaling(amax_history_len=4))
    copied = optree.tree_map(torch.clone, ws)
    assert copied.keys() == ws.keys() and all(copied[k] is not ws[k] for k in ws)
    tef.validate_workspaces(model, copied, DelayedScaling(amax_history_len=4))
