"""torch's modes around a te_func model: inference_mode evaluations, models built on the meta
device and loaded with assign=True, and refused calls: none of them changes a training run."""
from __future__ import annotations

import copy

import pytest
import torch

import te_func as tef
from cases import assert_dicts_equal, tiny_llama
from te_func.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = [pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(DelayedScaling(amax_history_len=4), id="delayed")]


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tef.convert(torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                           torch.nn.Linear(32, 16)))


def train_step(shell, opt, x, first=True):
    shell(x, is_first_microbatch=first).square().sum().backward()
    opt.step()
    opt.zero_grad()


def assert_same_run(a, b):
    assert_dicts_equal(a.workspaces, b.workspaces)
    for (k, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), k


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_inference_mode_evaluation_leaves_training_as_a_no_grad_one_does(recipe):
    """Between two training steps, an evaluation under inference_mode leaves the shell's state
    exactly as one under no_grad (the forward's amaxes recorded, no scale updated, no history
    rolled), and the next step trains on."""
    a = tef.Stateful(mlp(), recipe)
    b = copy.deepcopy(a)
    opts = [torch.optim.SGD(s.parameters(), lr=0.05) for s in (a, b)]
    xs = torch.randn(3, 4, 16)
    for s, opt in zip((a, b), opts):
        train_step(s, opt, xs[0])
    with torch.no_grad():
        ev_a = a(xs[1])
    with torch.inference_mode():
        ev_b = b(xs[1])
    assert torch.equal(ev_a, ev_b)
    assert_same_run(a, b)
    assert not any(v.is_inference() for v in b.workspaces.values())
    for s, opt in zip((a, b), opts):
        train_step(s, opt, xs[2])
    assert_same_run(a, b)


def test_a_shell_built_under_inference_mode_serves_inference_and_says_so_when_trained():
    with torch.inference_mode():
        shell = tef.Stateful(mlp(), DelayedScaling(amax_history_len=4))
        out = shell(torch.randn(4, 16))
    normal = tef.Stateful(mlp(), DelayedScaling(amax_history_len=4))
    with torch.inference_mode():
        assert torch.equal(shell(torch.ones(4, 16)), normal(torch.ones(4, 16)))
    assert torch.isfinite(out).all()
    with pytest.raises(tef.errors.TransformError, match="made under torch.inference_mode"):
        shell(torch.randn(4, 16))


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_shell_built_on_the_meta_device_loads_and_trains_bit_identically(recipe):
    """Built under torch.device("meta") (accelerate's init_empty_weights), then
    load_state_dict(sd, assign=True): the same outputs, workspaces and next steps as the shell
    it was saved from."""
    shell = tef.Stateful(mlp(), recipe)
    opt = torch.optim.SGD(shell.parameters(), lr=0.05)
    xs = torch.randn(3, 4, 16)
    train_step(shell, opt, xs[0])
    with torch.device("meta"):
        loaded = tef.Stateful(mlp(), recipe)
    loaded.load_state_dict(copy.deepcopy(shell.state_dict()), assign=True)      # no storage shared
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    assert_same_run(shell, loaded)
    opt2 = torch.optim.SGD(loaded.parameters(), lr=0.05)
    for x in xs[1:]:
        train_step(shell, opt, x, first=True)
        train_step(loaded, opt2, x, first=True)
    assert_same_run(shell, loaded)


def test_a_converted_hf_model_built_on_meta_computes_what_the_original_does():
    original = tef.convert(tiny_llama())
    with torch.device("meta"):
        empty = tef.convert(tiny_llama())
    # As from_pretrained does, the buffers a state_dict leaves out (the rotary frequencies) are
    # made again: here taken from the original.
    empty.load_state_dict(original.state_dict(), assign=True)
    for name, buffer in original.named_buffers():
        owner, _, leaf = name.rpartition(".")
        setattr(empty.get_submodule(owner), leaf, buffer.clone())
    ids = torch.randint(0, 128, (2, 8))
    recipe = Float8CurrentScaling()
    for model in (original, empty):
        model.eval()
    params = [{k: v.detach() for k, v in m.named_parameters()} for m in (original, empty)]
    outs = [tef.functional_call(m, p, tef.init_workspaces(m, recipe), (ids,), recipe=recipe)[0].logits
            for m, p in zip((original, empty), params)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("recipe", RECIPES)
def test_refused_calls_evaluations_and_meta_reloads_leave_the_run_bit_identical(recipe):
    """A run with refused calls (a workspace dict of another model, an input of the wrong
    width), inference_mode evaluations and a reload through a meta-device shell ends
    bit-identical to the plain run. Under DelayedScaling an evaluation records its amaxes, as
    TE's does under no_grad: there the plain run evaluates under no_grad at the same points."""
    xs = torch.randn(5, 4, 16)
    evaluates = isinstance(recipe, DelayedScaling)
    plain = tef.Stateful(mlp(), recipe)
    opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    for x in xs:
        if evaluates:
            with torch.no_grad():
                plain(x)
        train_step(plain, opt, x)

    busy = tef.Stateful(mlp(), recipe)
    opt = torch.optim.SGD(busy.parameters(), lr=0.05)
    for i, x in enumerate(xs):
        if i == 2:
            with torch.device("meta"):
                reloaded = tef.Stateful(mlp(), recipe)
            reloaded.load_state_dict(busy.state_dict(), assign=True)
            busy, opt = reloaded, torch.optim.SGD(reloaded.parameters(), lr=0.05)
        with pytest.raises((KeyError, ValueError)):
            busy.workspaces = tef.init_workspaces(torch.nn.Sequential(tef.nn.Linear(16, 16)), recipe)
        with pytest.raises(ValueError, match="in_features"):
            busy(torch.randn(4, 17))
        with torch.inference_mode():
            busy(x)
        train_step(busy, opt, x)
    assert_same_run(plain, busy)


def test_a_frozen_model_handed_to_stateful_is_told_what_it_is():
    frozen = tef.freeze(mlp(), Float8CurrentScaling())
    with pytest.raises(tef.errors.FrozenModelError, match=r"is frozen \(tef.freeze\)"):
        tef.Stateful(frozen, Float8CurrentScaling())
