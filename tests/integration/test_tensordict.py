"""tensordict on te_func models, as its docs drive a plain model: parameters gathered with
from_module / from_modules, an ensemble vmapped over them with the members' workspaces stacked,
and weights copied between shells with to_module (the workspaces follow by reset_workspaces)."""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import te_func as tef
from cases import bits
from te_func.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = [pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(DelayedScaling(amax_history_len=4), id="delayed")]


def mlp():
    return torch.nn.Sequential(tef.nn.Linear(32, 32), torch.nn.GELU(), tef.nn.Linear(32, 16))


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_ensemble_over_from_modules_runs_each_member_as_itself(recipe):
    models = [mlp() for _ in range(3)]
    params = TensorDict.from_modules(*models).flatten_keys(".")
    ws = tef.stack_workspaces([tef.init_workspaces(m, recipe) for m in models])
    x = torch.randn(8, 32)

    def member(p, w):
        return tef.functional_call(models[0], dict(p.items()), w, (x,), recipe=recipe)

    outs, new_ws = torch.func.vmap(member)(params, ws)
    for i, m in enumerate(models):
        out, member_ws = tef.functional_call(m, dict(m.named_parameters()), tef.init_workspaces(m, recipe), (x,),
                                             recipe=recipe)
        assert torch.equal(outs[i], out)
        assert all(torch.equal(bits(new_ws[k][i]), bits(v)) for k, v in member_ws.items())


def test_weights_copied_with_to_module_then_reset_workspaces_compute_as_the_source():
    recipe = Float8CurrentScaling()
    source, target = tef.Stateful(mlp(), recipe), tef.Stateful(mlp(), recipe)
    TensorDict.from_module(source).to_module(target)
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters()))
    target.reset_workspaces()       # the casts of the weights it now holds
    x = torch.randn(8, 32)
    with torch.no_grad():
        assert torch.equal(source(x, is_first_microbatch=False), target(x, is_first_microbatch=False))
