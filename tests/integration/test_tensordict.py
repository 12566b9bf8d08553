"""tensordict on te_func models, as its docs drive a plain model: parameters gathered with
from_module / from_modules, an ensemble vmapped over them with the members' workspaces stacked,
and a shell's weights and workspaces copied into another with to_module (the workspaces are the
buffers of the shell's `workspaces` submodule)."""
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


def trained(recipe, steps=3):
    shell = tef.Stateful(mlp(), recipe)
    for _ in range(steps):
        shell(torch.randn(8, 32), is_first_microbatch=True).square().mean().backward()
    return shell


def state(shell):
    return {k: bits(v) for k, v in shell.state_dict().items()}


@pytest.mark.parametrize("recipe", RECIPES)
def test_from_module_holds_the_workspaces_under_their_state_dict_keys(recipe):
    shell = trained(recipe)
    td = TensorDict.from_module(shell).flatten_keys(".")
    sd = shell.state_dict()
    assert set(td.keys()) == set(sd)
    assert all(td[k] is shell.workspaces[k.removeprefix("workspaces.")] for k in sd if k.startswith("workspaces."))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("from_state_dict,to_state_dict", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["modules", "from-state-dict", "to-state-dict", "state-dicts"])
def test_to_module_copies_weights_and_workspaces_so_the_copy_steps_as_the_source(recipe, from_state_dict,
                                                                                  to_state_dict):
    source, target = trained(recipe), tef.Stateful(mlp(), recipe)
    TensorDict.from_module(source, use_state_dict=from_state_dict).to_module(target, use_state_dict=to_state_dict)
    assert state(target).keys() == state(source).keys()
    assert all(torch.equal(v, state(source)[k]) for k, v in state(target).items())
    x = torch.randn(8, 32)
    for shell in (source, target):          # one more step each: outputs and new state agree
        shell(x, is_first_microbatch=True).square().mean().backward()
    assert torch.equal(source(x, is_first_microbatch=False), target(x, is_first_microbatch=False))
    assert all(torch.equal(v, state(source)[k]) for k, v in state(target).items())


def test_to_module_as_a_context_gives_back_the_targets_own_state():
    recipe = DelayedScaling(amax_history_len=4)
    source, target = trained(recipe), trained(recipe, steps=1)
    before = state(target)
    x = torch.randn(8, 32)
    with torch.no_grad(), TensorDict.from_module(source).to_module(target):
        assert torch.equal(target(x, is_first_microbatch=False), source(x, is_first_microbatch=False))
    after = state(target)
    assert after.keys() == before.keys() and all(torch.equal(v, before[k]) for k, v in after.items())


def test_a_shell_unpickled_from_before_the_state_dict_hooks_copies_with_use_state_dict():
    """A shell pickled by a te_func whose shell had no state_dict hooks gets them back, once."""
    import collections
    recipe = DelayedScaling(amax_history_len=4)
    source = trained(recipe)
    pickled = source.__getstate__()
    pickled["_load_state_dict_pre_hooks"], pickled["_state_dict_pre_hooks"] = (collections.OrderedDict(),
                                                                           collections.OrderedDict())
    unpickled = tef.Stateful.__new__(tef.Stateful)
    unpickled.__setstate__(pickled)
    assert len(unpickled._load_state_dict_pre_hooks) == len(unpickled._state_dict_pre_hooks) == 1
    target = tef.Stateful(mlp(), recipe)
    TensorDict.from_module(unpickled, use_state_dict=True).to_module(target, use_state_dict=True)
    assert state(target).keys() == state(unpickled).keys()
    assert all(torch.equal(v, state(unpickled)[k]) for k, v in state(target).items())
