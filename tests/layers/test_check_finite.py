"""Opt-in finiteness checks: a NaN or inf reaching a layer is named, not saturated away."""
import pytest
import torch

import te_func as tef
from te_func.recipe import Float8CurrentScaling


@pytest.fixture
def checking():
    previous = tef.set_check_finite(True)
    yield
    tef.set_check_finite(previous)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_input_is_refused_with_the_layer_and_tensor_named(checking, bad):
    layer = tef.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    x[1, 3] = bad
    with pytest.raises(ValueError, match=r"Linear: input holds 1 non-finite value"):
        with tef.autocast(Float8CurrentScaling()):
            layer(x)


def test_non_finite_parameter_is_refused_inside_tef_grad(checking):
    model = torch.nn.Sequential(tef.nn.Linear(16, 8))
    recipe = Float8CurrentScaling()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params["0.weight"][0, 0] = float("nan")
    ws = tef.init_workspaces(model, recipe)

    def loss_fn(p, ws, x):
        out, new_ws = tef.functional_call(model, p, ws, (x,), recipe=recipe)
        return out.sum(), new_ws

    with pytest.raises(ValueError, match=r"Linear: weight holds 1 non-finite value"):
        tef.grad(loss_fn)(params, ws, torch.randn(4, 16))


def test_check_is_off_by_default_and_saturates_inf_as_te_does():
    assert tef.set_check_finite(False) is False
    layer = tef.nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16)
    x[0, 0] = float("inf")
    with tef.autocast(Float8CurrentScaling()):
        out = layer(x)
    # amax is inf, so the scale is 1 and the inf saturates to E4M3's max: finite output.
    assert torch.isfinite(out).all()


def test_vmapped_calls_skip_the_check(checking):
    layer = tef.nn.Linear(16, 8)
    x = torch.randn(3, 4, 16)
    x[1, 0, 0] = float("nan")                  # a batched tensor has no single truth value to check
    out = torch.func.vmap(layer)(x)
    assert out.shape == (3, 4, 8)
    assert torch.isnan(out[1, 0]).all() and torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
    with pytest.raises(ValueError, match="non-finite"):
        layer(x)                               # the same input unbatched is caught
