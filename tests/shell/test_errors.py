"""Each misuse te_func detects raises its own class (te_func.errors), which still is the builtin
exception it always was, and carries what it is about as attributes: code can catch a
workspace that does not fit, or a transform te_func refuses, without reading the message."""
from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import te_func as tef
from te_func import errors
from te_func.quant.workspace import RECIPE_KEY
from te_func.recipe import DelayedScaling, Float8CurrentScaling


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(tef.nn.Linear(32, 32), torch.nn.GELU(), tef.nn.Linear(32, 16))


def call(m, ws, recipe, x=None):
    x = torch.randn(4, 32) if x is None else x
    return tef.functional_call(m, dict(m.named_parameters()), ws, (x,), recipe=recipe)


def test_a_missing_entry_names_it_and_is_a_key_error():
    m, recipe = model(), DelayedScaling(amax_history_len=4)
    ws = tef.init_workspaces(m, recipe)
    del ws["2.grad_amax_history"]
    with pytest.raises(errors.MissingEntryError) as e:
        call(m, ws, recipe)
    assert isinstance(e.value, KeyError) and isinstance(e.value, tef.Error)
    assert (e.value.entry, e.value.layer) == ("2.grad_amax_history", "2")
    assert str(e.value).startswith("workspace entry '2.grad_amax_history' is missing")   # not quoted as KeyError's


def test_entries_of_another_model_are_listed():
    m, recipe = model(), Float8CurrentScaling()
    ws = {**tef.init_workspaces(m, recipe), "5.weight_cast.data": torch.zeros(1)}
    with pytest.raises(errors.UnknownEntryError) as e:
        call(m, ws, recipe)
    assert isinstance(e.value, KeyError) and e.value.entries == ["5.weight_cast.data"]


def test_an_entry_of_the_wrong_shape_says_what_it_expected_and_got():
    m, recipe = model(), DelayedScaling(amax_history_len=4)
    ws = tef.init_workspaces(m, recipe)
    ws["0.input_amax_history"] = torch.zeros(8)
    with pytest.raises(errors.EntryMismatchError) as e:
        call(m, ws, recipe)
    assert isinstance(e.value, ValueError)
    assert e.value.entry == "0.input_amax_history"
    assert e.value.expected == ((4,), torch.float32) and e.value.got == ((8,), torch.float32)


def test_stacked_workspaces_outside_vmap_are_a_layout_mismatch():
    m, recipe = model(), Float8CurrentScaling()
    ws = tef.stack_workspaces([tef.init_workspaces(m, recipe)] * 2)
    with pytest.raises(errors.EntryMismatchError, match="stacked") as e:
        call(m, ws, recipe)
    assert e.value.entry == RECIPE_KEY and e.value.got == (2, 2)


def test_workspaces_of_another_recipe_name_the_recipe_run_with():
    m, recipe = model(), Float8CurrentScaling()
    ws = tef.init_workspaces(m, DelayedScaling())
    with pytest.raises(errors.RecipeMismatchError) as e:
        call(m, ws, recipe)
    assert isinstance(e.value, ValueError) and isinstance(e.value, errors.WorkspaceError)
    assert e.value.recipe == recipe


def test_refused_transforms_and_modes_are_transform_errors():
    recipe = DelayedScaling(amax_history_len=4)
    layer = tef.nn.Linear(32, 32)
    shared = torch.nn.Sequential(layer, layer)
    with pytest.raises(errors.TransformError) as e:
        call(shared, tef.init_workspaces(shared, recipe), recipe)
    assert isinstance(e.value, RuntimeError) and e.value.layer == "0"
    with tef.autocast(recipe), pytest.raises(errors.TransformError, match="nowhere to keep"):
        layer(torch.randn(4, 32))
    m, stateless = model(), Float8CurrentScaling()
    ws = tef.init_workspaces(m, stateless)
    x = torch.randn(4, 32, requires_grad=True)
    out, _ = call(m, ws, stateless, x)
    with pytest.raises(errors.TransformError, match="higher_order"):
        torch.autograd.grad(out.sum(), x, create_graph=True)
    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.randn(4, 32), torch.randn(4, 32))
        with pytest.raises(errors.DerivativeError) as e:
            call(m, ws, stateless, dual)
    assert isinstance(e.value, NotImplementedError) and isinstance(e.value, errors.TransformError)


def test_a_frozen_model_used_to_train_is_a_frozen_model_error():
    recipe = Float8CurrentScaling()
    frozen = tef.freeze(model(), recipe)
    with pytest.raises(errors.FrozenModelError) as e:
        tef.Stateful(frozen, recipe)
    assert isinstance(e.value, ValueError)
    with pytest.raises(errors.FrozenModelError) as e:
        frozen(torch.randn(4, 32, requires_grad=True))
    assert isinstance(e.value, RuntimeError)


def test_every_error_class_is_a_te_func_error_and_a_builtin():
    for name in errors.__all__:
        cls = getattr(errors, name)
        if issubclass(cls, Warning):
            continue
        assert issubclass(cls, tef.Error)
        if cls not in (errors.Error, errors.WorkspaceError):
            assert any(issubclass(cls, b) for b in (KeyError, ValueError, RuntimeError)), name
