"""tef.per_sample_grad, fold_workspaces and the ensemble helpers beyond the transform matrix:
what the workspace format declares for them, nested ensembles of per-sample gradients, and
the clear errors for each misuse they can see."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

import te_func as tef
from cases import LAYERS, RECIPES, bits, detached_params
from te_func.quant.workspace import KINDS
from te_func.recipe import DelayedScaling, Float8CurrentScaling

RECIPE = Float8CurrentScaling()


def make_model():
    return torch.nn.Sequential(tef.nn.Linear(32, 16), torch.nn.GELU(), tef.nn.LayerNormMLP(16, 32))


def sum_loss(model, recipe, reduce=torch.sum):
    def loss_fn(params, ws, x, y):
        out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe)
        return reduce((out - y) ** 2), new_ws
    return loss_fn


def data(batch=4, tokens=5):
    return torch.randn(batch, tokens, 32), torch.randn(batch, tokens, 16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, FP8 entries too."""
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


# --- the format's declarations ------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [pytest.param(r, id=rid) for rid, r in RECIPES])
@pytest.mark.parametrize("case", LAYERS, ids=lambda c: c.name)
def test_every_entry_declares_how_per_sample_copies_fold(case, recipe):
    """Each entry has a kind; the histories (and only they, with the batch amaxes) fold by max,
    and batch-scope entries exist exactly for tensor-wise current scaling, one per input and
    (unless backward_override keeps it in high precision) per output gradient of each GEMM."""
    model = case.make(torch.float32)
    spec = tef.workspace_spec(model, recipe)
    batch = tef.frame.batch_scope_spec(model, recipe)
    assert all(e.kind in KINDS for e in {**spec, **batch}.values())
    assert {k for k, e in spec.items() if e.records_amax} == {k for k, e in spec.items() if e.kind == "amax_history"}
    gemms = len(model.gemms())
    if isinstance(recipe, Float8CurrentScaling):
        roles = 1 if recipe.backward_override else 2
        assert len(batch) == roles * gemms and all(e.shape == () and e.records_amax for e in batch.values())
        assert sum(e.backward for e in batch.values()) == (roles - 1) * gemms
    else:
        assert batch == {}


# --- behaviour ----------------------------------------------------------------------------------

@pytest.mark.parametrize("scope", ["sample", "batch"])
def test_an_ensemble_of_per_sample_gradients(scope):
    """vmap over 3 stacked members of per_sample_grad: member i's per-sample gradients and
    workspaces are those of model i alone."""
    members = [make_model() for _ in range(3)]
    params, buffers, ws = tef.stack_module_state(members, RECIPE)
    x, y = data()
    per_sample = tef.per_sample_grad(sum_loss(members[0], RECIPE), (0, 0), scope=scope)
    grads, new_ws = torch.func.vmap(per_sample, in_dims=(0, 0, None, None))(params, ws, x, y)
    for i, m in enumerate(members):
        alone, alone_ws = tef.per_sample_grad(sum_loss(m, RECIPE), (0, 0), scope=scope)(
            detached_params(m), tef.init_workspaces(m, RECIPE), x, y)
        assert all(torch.equal(grads[k][i], alone[k]) for k in alone)
        assert all(same(v, alone_ws[k]) for k, v in tef.unstack_workspaces(new_ws)[i].items())


def test_batch_scope_shares_the_batchs_scale_where_sample_scope_does_not():
    """Current scaling: a sample scaled 100x quantizes with its own scale in sample scope, so
    the other samples' gradients are as if it were not there; in batch scope its amax sets the
    scale every sample shares, and the others' gradients change."""
    model = make_model()
    params, ws = detached_params(model), tef.init_workspaces(model, RECIPE)
    x, y = data()
    loud = x.clone()
    loud[0] *= 100
    for scope, unchanged in (("sample", True), ("batch", False)):
        per_sample = tef.per_sample_grad(sum_loss(model, RECIPE), (0, 0), scope=scope)
        quiet, _ = per_sample(params, ws, x, y)
        mixed, _ = per_sample(params, ws, loud, y)
        assert torch.equal(quiet["0.weight"][1:], mixed["0.weight"][1:]) == unchanged, scope


def test_per_sample_value_and_grad_returns_each_samples_loss():
    model = make_model()
    params, ws = detached_params(model), tef.init_workspaces(model, RECIPE)
    x, y = data()
    losses, grads, _ = tef.per_sample_value_and_grad(sum_loss(model, RECIPE), (0, 0))(params, ws, x, y)
    assert losses.shape == (4,) and grads["0.weight"].shape == (4, 16, 32)
    for i in range(4):
        loss_i, _ = sum_loss(model, RECIPE)(params, ws, x[i], y[i])
        assert torch.equal(losses[i], loss_i)


@pytest.mark.parametrize("scope", ["sample", "batch"])
def test_keepdim_passes_each_sample_as_a_batch_of_one(scope):
    """keepdim=True: fn sees each sample as (1, tokens, features), as a model that needs its
    batch dim wants it; a model that takes either shape gives the same gradients and
    workspaces, bit for bit, as without keepdim."""
    model = make_model()
    params, ws = detached_params(model), tef.init_workspaces(model, RECIPE)
    x, y = data()
    shapes = []

    def loss_fn(params, ws, x, y):
        shapes.append(tuple(x.shape))
        return sum_loss(model, RECIPE)(params, ws, x, y)

    grads, new_ws = tef.per_sample_grad(loss_fn, (0, 0), scope=scope, keepdim=True)(params, ws, x, y)
    want, want_ws = tef.per_sample_grad(sum_loss(model, RECIPE), (0, 0), scope=scope)(params, ws, x, y)
    assert (1, 5, 32) in shapes and (5, 32) not in shapes
    assert all(torch.equal(grads[k], want[k]) for k in want)
    assert new_ws.keys() == want_ws.keys() and all(same(new_ws[k], want_ws[k]) for k in want_ws)


# --- misuse -------------------------------------------------------------------------------------

def test_a_scope_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match=r"scope must be one of \('sample', 'batch'\), got 'token'"):
        tef.per_sample_grad(sum_loss(make_model(), RECIPE), scope="token")


def test_in_dims_over_params_and_workspaces_is_refused():
    model = make_model()
    params, ws = detached_params(model), tef.init_workspaces(model, RECIPE)
    x, y = data()
    with pytest.raises(ValueError, match="params and ws take none, every sample shares them"):
        tef.per_sample_grad(sum_loss(model, RECIPE), (None, None, 0, 0))(params, ws, x, y)
    with pytest.raises(ValueError, match="no argument is batched"):
        tef.per_sample_grad(sum_loss(model, RECIPE), (None, None))(params, ws, x, y)
    with pytest.raises(TypeError, match="one entry per argument after params and ws"):
        tef.per_sample_grad(sum_loss(model, RECIPE), {"x": 0})(params, ws, x, y)


def test_a_compiled_ensemble_under_delayed_scaling_records_the_members_amaxes_without_a_fallback():
    """torch.compile of vmap(tef.grad) over stacked members under DelayedScaling: equal to eager bit
    for bit, every member's gradient amaxes recorded, and no op of te_func falls back to torch's
    per-sample loop (which warns of a missing batching rule)."""
    torch._dynamo.reset()
    recipe = DelayedScaling(amax_history_len=4)
    members = [make_model() for _ in range(3)]
    model = members[0]
    params, _, ws = tef.stack_module_state(members, recipe)
    x, y = (torch.stack(t) for t in zip(*(data() for _ in members)))
    step = torch.func.vmap(tef.grad(sum_loss(model, recipe)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got, got_ws = torch.compile(step, fullgraph=True, backend="aot_eager")(params, ws, x, y)
    assert not [w for w in seen if "batching rule" in str(w.message)]
    want, want_ws = step(params, ws, x, y)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(same(got_ws[k], want_ws[k]) for k in want_ws)
    histories = [k for k in want_ws if k.endswith("grad_amax_history")]
    assert histories and all((want_ws[k][:, 0] > 0).all() for k in histories)


def test_stacked_and_single_workspaces_are_not_mixed():
    members = [make_model() for _ in range(2)]
    params, _, ws = tef.stack_module_state(members, RECIPE)
    x, y = data()
    with pytest.raises(ValueError, match="these workspaces are stacked"):
        tef.per_sample_grad(sum_loss(members[0], RECIPE), (0, 0))(detached_params(members[0]), ws, x, y)
    with pytest.raises(tef.errors.EntryMismatchError, match="these workspaces are stacked .* under torch.func.vmap"):
        tef.functional_call(members[0], detached_params(members[0]), ws, (x,), recipe=RECIPE)
    single = tef.unstack_workspaces(ws)[0]
    with pytest.raises(ValueError, match="stacked and single entries are mixed"):
        tef.unstack_workspaces({**ws, "0.weight_cast.data": single["0.weight_cast.data"]})
    with pytest.raises(tef.errors.EntryMismatchError, match="it is stacked .* among entries that are not"):
        tef.functional_call(members[0], detached_params(members[0]),
                            {**single, "0.weight_cast.data": ws["0.weight_cast.data"]}, (x,), recipe=RECIPE)
    with pytest.raises(ValueError, match="set 1 is stacked already"):
        tef.stack_workspaces([single, ws])
    with pytest.raises(ValueError, match="set 1 was made for another recipe"):
        tef.stack_workspaces([tef.init_workspaces(members[0], DelayedScaling()),
                              tef.init_workspaces(members[0], DelayedScaling(margin=1))])
    with pytest.raises(ValueError, match="2 models but 1 workspace sets"):
        tef.stack_module_state(members, RECIPE, [single])


def test_fold_workspaces_refuses_what_is_not_per_sample():
    members = [make_model() for _ in range(2)]
    _, _, ws = tef.stack_module_state(members, RECIPE)
    with pytest.raises(ValueError, match="differs between samples.*tef.unstack_workspaces"):
        tef.fold_workspaces(members[0], ws, RECIPE)           # an ensemble's: two members' casts
    with pytest.raises(ValueError, match="no leading sample dim"):
        tef.fold_workspaces(members[0], tef.unstack_workspaces(ws)[0], RECIPE)


def test_batch_scope_refuses_a_loss_that_is_not_a_sum_over_samples():
    """A mean over the batch makes the pass over the batch see 1/batch of every sample's
    gradient: the samples' amaxes exceed the batch's, which the eager check reports."""
    model = make_model()
    params, ws = detached_params(model), tef.init_workspaces(model, RECIPE)
    x, y = data()
    per_sample = tef.per_sample_grad(sum_loss(model, RECIPE, reduce=torch.mean), (0, 0), scope="batch")
    with pytest.raises(ValueError, match="sum the samples' losses, not a mean over the batch"):
        per_sample(params, ws, x, y)


class Mixed(torch.nn.Module):
    """Plain torch layers around te_func ones, and a te_func layer forward never calls."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(32, 32)
        self.block = tef.nn.LayerNormLinear(32, 48)
        self.idle = tef.nn.Linear(48, 48)
        self.out = torch.nn.Linear(48, 16)

    def forward(self, x):
        return self.out(torch.relu(self.block(self.inp(x))))


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_batch_scope_on_a_model_with_torch_layers_and_an_idle_layer(recipe):
    """Every parameter gets per-sample gradients, the plain torch ones too; they add up to the
    batch gradient; the idle layer's entries come back as they went in."""
    model = Mixed()
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)
    x, y = data()
    loss_fn = sum_loss(model, recipe)
    grads, new_ws = tef.per_sample_grad(loss_fn, (0, 0), scope="batch")(params, ws, x, y)
    batch, batch_ws = tef.grad(loss_fn)(params, ws, x, y)
    assert grads.keys() == params.keys()
    for k in params:
        torch.testing.assert_close(grads[k].sum(0), batch[k], rtol=1e-5, atol=1e-5)
    assert new_ws.keys() == ws.keys()
    for k in ws:
        assert same(new_ws[k], batch_ws[k]), k
        assert not k.startswith("idle.") or same(new_ws[k], ws[k]), k


def test_two_threads_take_per_sample_gradients_of_one_model_at_once():
    """The call scopes that collect what the calls read live on each thread's own stack."""
    model = make_model()
    params, ws = detached_params(model), tef.init_workspaces(model, RECIPE)
    inputs = [data(), data()]
    per_sample = tef.per_sample_grad(sum_loss(model, RECIPE), (0, 0), scope="batch")
    want = [per_sample(params, ws, *xy) for xy in inputs]
    got = [None, None]

    def run(i):
        got[i] = per_sample(params, ws, *inputs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (g, w), (g_want, w_want) in zip(got, want):
        assert all(torch.equal(g[k], g_want[k]) for k in g_want)
        assert all(same(w[k], w_want[k]) for k in w_want)
