"""te_func.nn.Linear: what a user switching from TransformerEngine or torch.nn relies on."""
from __future__ import annotations

import copy

import pytest
import torch

import te_func as tef
import te_func.quant.workspace as workspace_module
from cases import RECIPES, detached_params, needs_state
from te_func.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, QParams

FP8_RECIPES = [pytest.param(r, id=rid) for rid, r in RECIPES if r is not None]
ALL_RECIPES = [pytest.param(r, id=rid) for rid, r in RECIPES]
CURRENT = Float8CurrentScaling()
DELAYED = DelayedScaling(amax_history_len=4)


def snapshot(tensors: dict) -> dict:
    """Identity and bytes of each tensor, to check that nothing was mutated."""
    return {k: (v, v.detach().reshape(-1).view(torch.uint8).clone()) for k, v in tensors.items()}


def assert_unchanged(tensors: dict, snap: dict):
    assert tensors.keys() == snap.keys()
    for k, (obj, data) in snap.items():
        assert tensors[k] is obj, k
        assert torch.equal(obj.detach().reshape(-1).view(torch.uint8), data), k


# --- parameters and state_dict ------------------------------------------------------------------

def test_parameter_names_and_shapes_are_transformer_engines():
    layer = tef.nn.Linear(32, 16)
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == {"weight": (16, 32), "bias": (16,)}
    assert tef.nn.Linear(32, 16, bias=False).bias is None
    assert list(dict(tef.nn.Linear(32, 16, bias=False).named_parameters())) == ["weight"]


def test_loads_a_transformer_engine_state_dict_with_strict_false():
    te_sd = {"weight": torch.randn(16, 32), "bias": torch.randn(16),
             "_extra_state": torch.tensor([1, 2, 3], dtype=torch.uint8)}     # TE's pickled FP8 metadata
    layer = tef.nn.Linear(32, 16)
    result = layer.load_state_dict(te_sd, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["_extra_state"]
    assert torch.equal(layer.weight, te_sd["weight"]) and torch.equal(layer.bias, te_sd["bias"])
    model = torch.nn.Sequential(tef.nn.Linear(32, 16))
    model.load_state_dict({f"0.{k}": v for k, v in te_sd.items()}, strict=False)
    assert torch.equal(model[0].weight, te_sd["weight"])


def test_without_bias_equals_torch_linear():
    layer = tef.nn.Linear(32, 16, bias=False)
    x = torch.randn(3, 5, 32)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_return_bias_returns_the_unadded_bias(recipe):
    layer = tef.nn.Linear(32, 16, return_bias=True)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(4, 32)
    plain = copy.deepcopy(layer)
    plain.return_bias = False
    ws = tef.init_workspaces(layer, recipe)
    (out, bias), _ = tef.functional_call(layer, detached_params(layer), ws, (x,), recipe=recipe)
    full, _ = tef.functional_call(plain, detached_params(plain), ws, (x,), recipe=recipe)
    assert torch.equal(bias, layer.bias)
    assert torch.allclose(out + bias, full, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out, full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_params_dtype_sets_parameters_and_output_dtype(dtype, recipe):
    layer = tef.nn.Linear(32, 16, params_dtype=dtype)
    assert layer.weight.dtype == layer.bias.dtype == dtype
    x = torch.randn(4, 32, dtype=dtype)
    params = detached_params(layer)
    grads, _ = tef.grad(lambda p, w: (tef.functional_call(layer, p, w, (x,), recipe=recipe)[0].float().sum(),
                                      w))(params, tef.init_workspaces(layer, recipe))
    out, _ = tef.functional_call(layer, params, tef.init_workspaces(layer, recipe), (x,), recipe=recipe)
    assert out.dtype == dtype and out.shape == (4, 16)
    assert all(grads[k].dtype == dtype for k in params)
    ref = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert torch.isfinite(out).all() and torch.allclose(out.double(), ref, rtol=0.125, atol=0.0675)   # TE's


# --- the weight cache ---------------------------------------------------------------------------

@pytest.fixture
def weight_casts(monkeypatch):
    """Counts weight quantizations (every weight cast is made by te_func.quant.workspace.make_cast)."""
    calls = []
    real = workspace_module.quantize_with_transpose

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(workspace_module, "quantize_with_transpose", counting)
    return calls


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_weight_is_quantized_once_per_step_of_four_microbatches(recipe, weight_casts):
    model = torch.nn.Sequential(tef.nn.Linear(32, 48), torch.nn.ReLU(), tef.nn.Linear(48, 16))
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)

    def loss_fn(p, w, x, first):
        out, new_w = tef.functional_call(model, p, w, (x,), recipe=recipe, is_first_microbatch=first)
        return out.square().mean(), new_w

    for step in range(2):
        weight_casts.clear()
        for i in range(4):
            _, ws = tef.grad(loss_fn)(params, ws, torch.randn(8, 32), i == 0)
        assert weight_casts == [(48, 32), (16, 48)], f"step {step}"   # once per layer, at microbatch 0


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_first_microbatch_after_an_update_uses_the_new_weights(recipe):
    """After an optimizer step, is_first_microbatch=True recasts: the output changes and equals
    an uncached call; False would (as in TE) keep the stale cast of the old weights."""
    layer = tef.nn.Linear(64, 32)
    params, ws = detached_params(layer), tef.init_workspaces(layer, recipe)
    x = torch.randn(8, 64)
    run = lambda p, w, first: tef.functional_call(layer, p, w, (x,), recipe=recipe, is_first_microbatch=first)
    before, ws = run(params, ws, True)
    new_params = {k: v + 0.05 * torch.randn_like(v) for k, v in params.items()}
    after, ws_after = run(new_params, ws, True)
    fresh, _ = run(new_params, ws, None)      # same workspaces: delayed scaling's state counts
    assert not torch.allclose(after, before, rtol=1e-3, atol=1e-3)
    assert torch.equal(after, fresh)
    stale, _ = run(new_params, ws, False)
    if not isinstance(recipe, DelayedScaling):   # delayed moves its scales at step starts anyway
        assert not torch.equal(stale, fresh)
    again, _ = run(new_params, ws_after, False)
    assert torch.equal(again, fresh)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_first_microbatch_none_quantizes_every_call_and_leaves_no_stale_cast(recipe, weight_casts):
    """None never reuses a cast, and no later False call picks up a cast of older weights."""
    layer = tef.nn.Linear(64, 32)
    params, ws = detached_params(layer), tef.init_workspaces(layer, recipe)
    x = torch.randn(8, 64)
    run = lambda p, w, first: tef.functional_call(layer, p, w, (x,), recipe=recipe, is_first_microbatch=first)
    weight_casts.clear()
    for _ in range(3):
        out, ws_none = run(params, ws, None)
    assert len(weight_casts) == 3 and ws_none.keys() == ws.keys()
    new_params = {k: v + 0.05 * torch.randn_like(v) for k, v in params.items()}
    fresh, ws_new = run(new_params, ws, None)
    later, _ = run(new_params, ws_new, False)
    if not isinstance(recipe, DelayedScaling):    # delayed scaling's state moved with the first call
        assert torch.equal(later, fresh)


# --- purity -------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_functional_call_and_grad_mutate_nothing(recipe):
    model = torch.nn.Sequential(tef.nn.Linear(32, 32), torch.nn.GELU(), tef.nn.Linear(32, 8))
    params = {k: v.clone() for k, v in detached_params(model).items()}
    ws = tef.init_workspaces(model, recipe)
    x = torch.randn(4, 32)
    own = dict(model.named_parameters())
    snaps = [snapshot(params), snapshot(ws), snapshot(own)]
    ws_keys = list(ws)

    def loss_fn(p, w, first):
        out, new_w = tef.functional_call(model, p, w, (x,), recipe=recipe, is_first_microbatch=first)
        return out.square().sum(), new_w

    for first in (True, False, None):
        out1, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=first)
        grads, _ = tef.grad(loss_fn)(params, ws, first)
        out2, _ = tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=first)
        assert torch.equal(out1, out2)                  # the same inputs give the same outputs
        assert new_ws is not ws and all(own[k].grad is None for k in own)
    assert list(ws) == ws_keys
    for tensors, snap in zip((params, ws, own), snaps):
        assert_unchanged(tensors, snap)


# --- inside user models -------------------------------------------------------------------------

class TwoTower(torch.nn.Module):
    """A user model: te_func layers in a ModuleDict, one of them called twice in a custom forward."""

    def __init__(self):
        super().__init__()
        self.towers = torch.nn.ModuleDict({"a": tef.nn.Linear(32, 32), "b": tef.nn.Linear(32, 32)})
        self.head = tef.nn.Linear(32, 4, bias=False)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        h = torch.relu(self.towers["a"](self.norm(x))) + self.towers["b"](x)
        return self.head(self.towers["a"](h))


@pytest.mark.parametrize("recipe", ALL_RECIPES)
@pytest.mark.parametrize("make", [
    lambda: torch.nn.Sequential(tef.nn.Linear(32, 64), torch.nn.GELU(), tef.nn.Linear(64, 4)),
    TwoTower,
], ids=["Sequential", "user-module"])
def test_works_inside_user_models(make, recipe):
    """Workspaces keyed by module path; functional_call, tef.grad and the eager model agree."""
    model = make()
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)
    te_paths = [p for p, m in model.named_modules() if isinstance(m, tef.nn.Linear)]
    if recipe is not None:
        assert {k.split(".weight_cast.")[0] for k in ws if ".weight_cast." in k} == set(te_paths)
    x = torch.randn(2, 8, 32)
    if isinstance(recipe, DelayedScaling) and isinstance(model, TwoTower):
        # towers.a is used twice: under DelayedScaling that is refused (tests/transforms/test_shared_layer.py).
        with pytest.raises(tef.errors.TransformError, match="called twice in one call under DelayedScaling"):
            tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=True)
        return
    out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=True)
    assert out.shape == (2, 8, 4) and new_ws.keys() == ws.keys()
    grads, _ = tef.grad(lambda p, w: (tef.functional_call(model, p, w, (x,), recipe=recipe)[0].sum(), w))(
        params, ws)
    assert grads.keys() == params.keys() and all(g.abs().sum() > 0 for g in grads.values())
    if recipe is None or needs_state(recipe):     # no tef.autocast for recipes that keep state
        return
    with tef.autocast(recipe):
        eager = model(x)
    assert torch.equal(eager, out)


# --- bad input ----------------------------------------------------------------------------------

def test_wrong_in_features_says_which_layer_and_what_to_do():
    layer = tef.nn.Linear(32, 16)
    with pytest.raises(ValueError, match=r"Linear: input's last dim must be in_features=32.*shape \(4, 31\)"):
        layer(torch.randn(4, 31))
    with pytest.raises(ValueError, match="in_features=32"):
        tef.functional_call(layer, detached_params(layer), tef.init_workspaces(layer, CURRENT),
                            (torch.randn(4, 31),), recipe=CURRENT)


def test_unsupported_input_dtypes_are_refused():
    layer = tef.nn.Linear(32, 16)
    with pytest.raises(TypeError, match="Linear: input dtype torch.int64 is not supported"):
        layer(torch.ones(4, 32, dtype=torch.int64))
    with pytest.raises(TypeError, match="Linear: input dtype torch.float64 is not supported"):
        with tef.autocast(CURRENT):
            layer(torch.randn(4, 32, dtype=torch.float64))
    layer(torch.randn(4, 32, dtype=torch.float64).float())            # float32 is fine
    with pytest.raises(TypeError, match="params_dtype must be"):
        tef.nn.Linear(32, 16, params_dtype=torch.int32)


def test_workspaces_of_another_model_are_refused():
    model = torch.nn.Sequential(tef.nn.Linear(32, 16), tef.nn.Linear(16, 8))
    params = detached_params(model)
    x = torch.randn(4, 32)
    other_sizes = torch.nn.Sequential(tef.nn.Linear(32, 24), tef.nn.Linear(24, 8))
    with pytest.raises(tef.errors.EntryMismatchError,
                       match=r"workspace entry '0\.weight_cast\.data' has shape \(24, 32\)"):
        tef.functional_call(model, params, tef.init_workspaces(other_sizes, CURRENT), (x,), recipe=CURRENT)
    other_names = torch.nn.ModuleDict({"fc1": tef.nn.Linear(32, 16), "fc2": tef.nn.Linear(16, 8)})
    with pytest.raises(tef.errors.MissingEntryError,
                       match=r"'0\.weight_cast\.data' is missing.*not made for this model"):
        tef.functional_call(model, params, tef.init_workspaces(other_names, CURRENT), (x,), recipe=CURRENT)
    bigger = torch.nn.Sequential(*model, tef.nn.Linear(8, 8))
    with pytest.raises(tef.errors.UnknownEntryError, match=r"belong to no te_func layer of this model"):
        tef.functional_call(model, params, tef.init_workspaces(bigger, CURRENT), (x,), recipe=CURRENT)
    with pytest.raises(TypeError, match="workspaces must be the dict from tef.init_workspaces"):
        tef.functional_call(model, params, [1], (x,), recipe=CURRENT)


def test_a_workspace_entry_of_the_wrong_dtype_or_stacked_is_told_which():
    model = torch.nn.Sequential(tef.nn.Linear(32, 16))
    params, x = detached_params(model), torch.randn(4, 32)
    ws = tef.init_workspaces(model, DELAYED)
    scale = ws["0.grad_scale"]
    assert scale.shape == () and scale.dtype == torch.float32
    with pytest.raises(tef.errors.EntryMismatchError,
                       match=r"'0\.grad_scale' has shape \(\) and dtype torch.float64.*keeps this "
                             r"entry in torch.float32; convert it"):
        tef.functional_call(model, params, {**ws, "0.grad_scale": scale.double()}, (x,), recipe=DELAYED)
    with pytest.raises(tef.errors.EntryMismatchError, match=r"'0\.grad_scale' has shape \(3,\).*it is stacked"):
        tef.functional_call(model, params, {**ws, "0.grad_scale": scale.expand(3)}, (x,), recipe=DELAYED)


def test_workspaces_made_for_another_recipe_are_refused():
    layer = tef.nn.Linear(32, 16)
    x = torch.randn(4, 32)
    # Another layout, and the same layout made with other options (power-of-2 scales): the
    # workspace's te_func_recipe entry tells them apart, read once per call.
    for other in (MXFP8BlockScaling(), Float8CurrentScaling(fp8_quant_fwd_weight=QParams(power_2_scale=True))):
        ws = tef.init_workspaces(layer, other)
        with pytest.raises(tef.errors.RecipeMismatchError,
                           match=r"made for another recipe: (made for MXFP8BlockScaling\(\), run with "
                                 r"Float8CurrentScaling\(\)|Float8CurrentScaling with fp8_quant_fwd_weight=)"):
            tef.functional_call(layer, detached_params(layer), ws, (x,), recipe=CURRENT)
    with pytest.raises(TypeError, match="recipe must be None or a te_func.recipe recipe"):
        tef.init_workspaces(layer, "fp8")


def test_delayed_scaling_under_autocast_is_refused():
    layer = tef.nn.Linear(32, 16)
    with pytest.raises(tef.errors.TransformError, match=r"Linear: DelayedScaling .* tef.autocast has nowhere to keep.*"
                                           r"tef.init_workspaces"):
        with tef.autocast(DelayedScaling()):
            layer(torch.randn(4, 32))


def test_a_module_outside_the_model_is_refused_inside_functional_call():
    stray = tef.nn.Linear(16, 16)

    class UsesStray(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = tef.nn.Linear(32, 16)

        def forward(self, x):
            return stray(self.fc(x))       # not registered as a submodule

    model = UsesStray()
    with pytest.raises(RuntimeError, match="Linear: this module is not a submodule of the model passed to "
                                           "tef.functional_call"):
        tef.functional_call(model, detached_params(model), tef.init_workspaces(model, CURRENT),
                            (torch.randn(4, 32),), recipe=CURRENT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_gives_a_clear_error():
    with pytest.raises(RuntimeError, match=r"device='cuda' was asked for, but torch.cuda.is_available\(\) "
                                           r"is False.*use device='cpu'"):
        tef.nn.Linear(32, 16, device="cuda")


@pytest.mark.parametrize("recipe", [pytest.param(r, id=rid) for rid, r in RECIPES if r is not None])
def test_non_contiguous_input_and_gradient_give_the_contiguous_result(recipe):
    model = torch.nn.Sequential(tef.nn.Linear(64, 32))
    ws = tef.init_workspaces(model, recipe)
    x_t, g_t = torch.randn(64, 16).t(), torch.randn(32, 16).t()     # column-major

    def loss_fn(params, ws, x, g):
        out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe)
        return (out * g).sum(), new_ws

    params = {k: v.detach() for k, v in model.named_parameters()}
    (grads, dx), _ = tef.grad(loss_fn, argnums=(0, 2))(params, ws, x_t, g_t)
    (want, want_dx), _ = tef.grad(loss_fn, argnums=(0, 2))(params, ws, x_t.contiguous(), g_t.contiguous())
    assert torch.equal(dx, want_dx) and torch.equal(grads["0.weight"], want["0.weight"])
    assert torch.allclose(grads["0.bias"], want["0.bias"], rtol=1e-5, atol=1e-5)   # sum order differs


def test_workspace_entry_on_another_device_is_refused_naming_it():
    model, recipe = torch.nn.Sequential(tef.nn.Linear(16, 8)), Float8CurrentScaling()
    ws = tef.init_workspaces(model, recipe)
    moved = {k: (v.to("meta") if k == "0.weight_cast.data_t" else v) for k, v in ws.items()}
    with pytest.raises(tef.errors.EntryMismatchError,
                       match=r"'0.weight_cast.data_t' is on meta but Linear at '0' is on cpu"):
        tef.functional_call(model, dict(model.named_parameters()), moved, (torch.randn(2, 16),), recipe=recipe)


def test_stateful_loads_a_weights_only_checkpoint_with_strict_false():
    recipe = Float8CurrentScaling()
    source = torch.nn.Sequential(tef.nn.Linear(16, 8))
    shell = tef.Stateful(torch.nn.Sequential(tef.nn.Linear(16, 8)), recipe)
    weights_only = {f"model.{k}": v for k, v in source.state_dict().items()}
    with pytest.raises(KeyError, match=r"no workspace entries .*weights only.*strict=False"):
        shell.load_state_dict(weights_only)                     # strict: the workspaces are missing
    shell.load_state_dict(weights_only, strict=False)
    assert torch.equal(shell.model[0].weight, source[0].weight)
    fresh = tef.init_workspaces(source, recipe)
    assert all(torch.equal(shell.workspaces[k].view(torch.uint8) if v.element_size() == 1 else shell.workspaces[k],
                           v.view(torch.uint8) if v.element_size() == 1 else v) for k, v in fresh.items())
