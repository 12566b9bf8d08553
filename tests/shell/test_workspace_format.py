"""The workspace format as data, and the frame that routes it.

The key list and shapes of every layer x recipe are pinned in
tests/golden_workspaces.json: a format change must update that file on
purpose (TE_FUNC_UPDATE_GOLDEN=1 rewrites it). Keys are plain names, entries
never share storage (safetensors saves them), a cached-weight forward exports
with torch.export, the frame is per thread and refuses a transform opened
inside a model's forward, and checkpoints of te_func 0.1 still load.
"""
from __future__ import annotations

import copy
import json
import os
import re
import threading
from pathlib import Path

import pytest
import torch

import te_func as tef
from cases import LAYERS, RECIPES, detached_params, needs_state
from te_func.quant.workspace import RECIPE_KEY
from te_func.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, QParams, fingerprint

GOLDEN = Path(__file__).parents[1] / "golden_workspaces.json"
DATA = Path(__file__).parents[1] / "data"
KEY = re.compile(r"[A-Za-z0-9_.]+")
FP8 = [pytest.param(r, id=rid) for rid, r in RECIPES if r is not None]
ALL = [pytest.param(r, id=rid) for rid, r in RECIPES]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t (torch.equal has no CPU kernel for the float8 dtypes)."""
    return t.reshape(-1).view(torch.uint8)


def _spec_as_json(recipe, make):
    spec = tef.workspace_spec(make(torch.float32), recipe)
    return {k: [list(e.shape), str(e.dtype).removeprefix("torch."), e.backward] for k, e in spec.items()}


def _current_format():
    # One row per layer: a row that calls a layer of another row with other inputs
    # ("GroupedLinear-counts") has that row's workspaces.
    rows = {case.name: case for case in LAYERS if case.name.removesuffix("-counts") == case.name}
    return {"fingerprints": {rid: fingerprint(r) for rid, r in RECIPES},
            "layers": {name: {rid: _spec_as_json(r, case.make) for rid, r in RECIPES} for name, case in rows.items()}}


def test_key_lists_and_shapes_of_every_layer_and_recipe_are_pinned():
    current = _current_format()
    if os.environ.get("TE_FUNC_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    assert current == json.loads(GOLDEN.read_text()), \
        "the workspace format changed: if on purpose, rerun with TE_FUNC_UPDATE_GOLDEN=1 and bump FORMAT_VERSION"


def test_every_entry_a_backward_writes_is_named_as_tef_grad_expects():
    """tef.grad differentiates only the entries whose names can carry backward state (gradient
    amax histories, batch amaxes): every entry any layer declares backward-written is among them."""
    from te_func.quant.workspace import may_carry_backward_state
    seen = set()
    for case in LAYERS:
        model = case.make(torch.float32)
        for _, recipe in RECIPES:
            spec = {**tef.workspace_spec(model, recipe), **tef.frame.batch_scope_spec(model, recipe)}
            backward = [k for k, e in spec.items() if e.backward]
            assert all(may_carry_backward_state(k) for k in backward), (case.name, backward)
            seen.update(k.rsplit("_", 2)[-2] for k in backward)
    assert seen == {"amax", "batch"}      # histories (DelayedScaling) and batch amaxes (batch scope) both met


@pytest.mark.parametrize("recipe", ALL)
@pytest.mark.parametrize("case", LAYERS, ids=lambda c: c.name)
def test_keys_are_plain_names_and_no_two_entries_share_storage(case, recipe):
    model = case.make(torch.float32)
    shell = tef.Stateful(model, recipe)
    # after a training step too: the entries a call returns are as separate as fresh ones
    out = shell(*case.inputs(2, torch.float32), is_first_microbatch=True, **case.kwargs)
    case.output(out).float().square().sum().backward()
    for ws in (tef.init_workspaces(model, recipe), shell.workspaces):
        assert all(KEY.fullmatch(k) for k in ws), [k for k in ws if not KEY.fullmatch(k)]
        pointers = [t.untyped_storage().data_ptr() for t in ws.values() if t.numel()]
        assert len(pointers) == len(set(pointers))


@pytest.mark.parametrize("recipe", ALL)
def test_safetensors_saves_a_stateful_checkpoint_and_the_round_trip_is_bit_identical(recipe, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    model = torch.nn.Sequential(tef.nn.LayerNormLinear(32, 48), torch.nn.GELU(), tef.nn.LayerNormMLP(48, 64))
    shell = tef.Stateful(model, recipe)
    opt = torch.optim.SGD(shell.parameters(), lr=0.1)
    for i in range(2):
        shell(torch.randn(8, 32), is_first_microbatch=True).square().mean().backward()
        opt.step()
        opt.zero_grad()
    safetensors.save_file(shell.state_dict(), tmp_path / "shell.safetensors")
    resumed = tef.Stateful(copy.deepcopy(model), recipe)
    resumed.load_state_dict(safetensors.load_file(tmp_path / "shell.safetensors"))
    x = torch.randn(8, 32)
    assert torch.equal(resumed(x, is_first_microbatch=False), shell(x, is_first_microbatch=False))
    for k, v in shell.state_dict().items():
        got = resumed.state_dict()[k]
        assert got.dtype == v.dtype and torch.equal(bits(got), bits(v)), k


def _no_casts(ws: dict) -> bool:
    return not any("_cast." in k for k in ws)


def test_workspaces_without_weight_cache_keep_no_cast_anywhere_between_calls():
    """Nothing holds a cast after a call: not the workspaces, not the record kept for an
    activation checkpoint's recompute (te_func.nn.context), not the shell's state_dict."""
    from te_func.nn import context
    recipe = DelayedScaling(amax_history_len=4)
    model = torch.nn.Sequential(tef.nn.LayerNormLinear(32, 48), torch.nn.GELU(), tef.nn.LayerNormMLP(48, 64))
    shell = tef.Stateful(model, recipe, weight_cache=False)
    for _ in range(2):
        shell(torch.randn(8, 32)).square().mean().backward()
    assert _no_casts(shell.workspaces) and _no_casts(shell.state_dict())
    assert all(_no_casts(context._last_calls[m].workspace) for m in (model[0], model[2]))
    assert "weight_cache=False" in repr(shell)
    with pytest.raises(ValueError, match="is_first_microbatch=True reads or stores cached weight casts"):
        shell(torch.randn(8, 32), is_first_microbatch=True)


def test_a_layers_own_is_first_microbatch_is_refused_without_the_cache():
    class Calls(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = tef.nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x, is_first_microbatch=False)
    model, recipe = Calls(), Float8CurrentScaling()
    ws = tef.init_workspaces(model, recipe, weight_cache=False)
    with pytest.raises(ValueError, match="Linear at 'fc': is_first_microbatch=False"):
        tef.functional_call(model, detached_params(model), ws, (torch.randn(4, 16),), recipe=recipe)
    tef.functional_call(model, detached_params(model), tef.init_workspaces(model, recipe), (torch.randn(4, 16),),
                        recipe=recipe)


def test_some_casts_missing_is_an_error_naming_the_option():
    model, recipe = tef.nn.LayerNormMLP(32, 64), Float8CurrentScaling()
    ws = tef.init_workspaces(model, recipe)
    ws.pop("fc2_weight_cast.data_t")
    with pytest.raises(tef.errors.MissingEntryError, match="fc2_weight_cast.data_t' is missing: .*weight casts come all together"):
        tef.functional_call(model, detached_params(model), ws, (torch.randn(4, 32),), recipe=recipe)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=lambda r: type(r).__name__)
def test_checkpoints_move_between_shells_with_and_without_the_cache(recipe):
    """A cached shell's checkpoint loads into one without the cache (its casts are dropped: they
    are made from the weights); the other way round is refused, naming the option."""
    model = tef.nn.LayerNormMLP(32, 64)
    cached = tef.Stateful(model, recipe)
    cached(torch.randn(8, 32)).square().mean().backward()
    bare = tef.Stateful(copy.deepcopy(model), recipe, weight_cache=False)
    bare.load_state_dict(cached.state_dict())
    assert _no_casts(bare.workspaces)
    x = torch.randn(8, 32)
    assert torch.equal(bare(x), cached(x))
    assert all(torch.equal(v, cached.workspaces[k]) for k, v in bare.workspaces.items())
    with pytest.raises(ValueError, match="keep no weight casts .* weight_cache=False"):
        tef.Stateful(copy.deepcopy(model), recipe).load_state_dict(bare.state_dict())


def test_a_shell_pickled_before_the_option_existed_keeps_its_cache():
    shell = tef.Stateful(tef.nn.Linear(16, 16), Float8CurrentScaling())
    state = shell.__getstate__()
    del state["weight_cache"]           # what an earlier te_func's pickle holds
    old = tef.Stateful.__new__(tef.Stateful)
    old.__setstate__(state)
    assert old.weight_cache and "weight_cache" not in repr(old)
    old.reset_workspaces()
    assert any("_cast." in k for k in old.workspaces)


class CachedForward(torch.nn.Module):
    """A model's forward with its cached weight casts, as a module of (params, ws, x)."""

    def __init__(self, model, recipe):
        super().__init__()
        self.model, self.recipe = model, recipe

    def forward(self, params, ws, x):
        out, _ = tef.functional_call(self.model, params, ws, (x,), recipe=self.recipe, is_first_microbatch=False)
        return out


@pytest.mark.parametrize("recipe", ALL)
def test_torch_export_of_a_cached_weight_forward_equals_eager(recipe):
    model = torch.nn.Sequential(tef.nn.Linear(32, 48), torch.nn.GELU(), tef.nn.LayerNormMLP(48, 64))
    params = detached_params(model)
    x = torch.randn(16, 32)
    _, ws = tef.functional_call(model, params, tef.init_workspaces(model, recipe), (x,), recipe=recipe,
                                is_first_microbatch=True)
    fwd = CachedForward(model, recipe)
    exported = torch.export.export(fwd, (params, ws, x))
    x2 = torch.randn(16, 32)
    assert torch.equal(exported.module()(params, ws, x2), fwd(params, ws, x2))


def test_backward_keys_come_from_the_layers_declaration():
    model = torch.nn.Sequential(tef.nn.Linear(32, 16), tef.nn.LayerNormMLP(16, 32), tef.nn.GroupedLinear(2, 16, 8))
    recipe = DelayedScaling(amax_history_len=4)
    assert tef.frame.backward_keys(model, recipe) == [
        "0.grad_amax_history", "1.fc1_grad_amax_history", "1.fc2_grad_amax_history",
        "2.gemm0_grad_amax_history", "2.gemm1_grad_amax_history"]
    assert tef.frame.backward_keys(model, Float8CurrentScaling()) == []


def test_fingerprint_names_a_recipe_by_value():
    assert fingerprint(DelayedScaling(margin=1)) == fingerprint(DelayedScaling(margin=1))
    assert fingerprint(DelayedScaling(margin=1)) != fingerprint(DelayedScaling())
    pow2 = Float8CurrentScaling(fp8_quant_fwd_inp=QParams(power_2_scale=True))
    assert fingerprint(pow2) != fingerprint(Float8CurrentScaling())
    # a field left at its default does not enter it: stating the default changes nothing
    assert fingerprint(DelayedScaling(amax_history_len=1024)) == fingerprint(DelayedScaling())


@pytest.mark.parametrize("recipe", FP8)
def test_the_recipe_entry_is_on_the_models_device_and_read_once(recipe):
    model = torch.nn.Sequential(tef.nn.Linear(16, 16))
    ws = tef.init_workspaces(model, recipe)
    assert ws[RECIPE_KEY].device == model[0].weight.device and ws[RECIPE_KEY].dtype == torch.int64
    forged = {**ws, RECIPE_KEY: ws[RECIPE_KEY].clone()}
    forged[RECIPE_KEY][1] += 1              # an in-place change is seen (the entry's version moved)
    params = detached_params(model)
    tef.functional_call(model, params, ws, (torch.randn(2, 16),), recipe=recipe)
    with pytest.raises(tef.errors.RecipeMismatchError, match="made for another recipe"):
        tef.functional_call(model, params, forged, (torch.randn(2, 16),), recipe=recipe)


# --- the frame ------------------------------------------------------------------------------------

def test_two_threads_on_one_model_each_get_their_own_results():
    model = torch.nn.Sequential(tef.nn.Linear(64, 64), torch.nn.ReLU(), tef.nn.Linear(64, 32))
    recipe = DelayedScaling(amax_history_len=4)
    runs = []
    for seed in range(2):
        torch.manual_seed(seed)
        params = {k: torch.randn_like(v) for k, v in model.named_parameters()}
        runs.append((params, tef.init_workspaces(model, recipe), torch.randn(16, 64) * (seed + 1)))
    want = [tef.functional_call(model, p, w, (x,), recipe=recipe) for p, w, x in runs]
    wrong = []

    def worker(i):
        p, w, x = runs[i]
        for _ in range(40):
            out, new_ws = tef.functional_call(model, p, w, (x,), recipe=recipe)
            if not (torch.equal(out, want[i][0]) and all(torch.equal(new_ws[k].view(torch.uint8),
                                                                     want[i][1][k].view(torch.uint8))
                                                         for k in new_ws if new_ws[k].element_size() == 1)
                    and torch.equal(new_ws["0.input_amax_history"], want[i][1]["0.input_amax_history"])):
                wrong.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


class VmapInside(torch.nn.Module):
    """A model whose forward runs a te_func layer under its own torch.func.vmap."""

    def __init__(self):
        super().__init__()
        self.proj = tef.nn.Linear(16, 16)

    def forward(self, x):                       # x: (groups, tokens, 16)
        return torch.func.vmap(self.proj)(x)


def test_a_transform_inside_the_forward_is_refused_under_delayed_scaling():
    model, recipe = VmapInside(), DelayedScaling(amax_history_len=4)
    with pytest.raises(tef.errors.TransformError, match=r"proj.*ran inside a torch.func transform .* around tef.functional_call"):
        tef.functional_call(model, detached_params(model), tef.init_workspaces(model, recipe),
                            (torch.randn(3, 4, 16),), recipe=recipe)


def test_a_transform_inside_the_forward_runs_where_nothing_batched_is_stored():
    """Under a stateless recipe the layer stores only its weight's cast, made outside the
    vmap's batch: nothing escapes, and each group gets what the layer gives it alone."""
    model, recipe = VmapInside(), Float8CurrentScaling()
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)
    x = torch.randn(3, 4, 16)
    out, _ = tef.functional_call(model, params, ws, (x,), recipe=recipe)
    alone, _ = tef.functional_call(model.proj, {k.removeprefix("proj."): v for k, v in params.items()},
                                   tef.init_workspaces(model.proj, recipe), (x[1],), recipe=recipe)
    assert torch.equal(out[1], alone)


class Fails(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = tef.nn.Linear(16, 16), tef.nn.Linear(16, 16)

    def forward(self, x, fail=False):
        y = self.first(x)
        if fail:
            raise ArithmeticError("raised inside the forward")
        return self.second(y)


def test_an_exception_inside_a_forward_leaves_the_frame_clean():
    model, recipe = Fails(), Float8CurrentScaling()
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)
    x = torch.randn(4, 16)
    with pytest.raises(ArithmeticError):
        tef.functional_call(model, params, ws, (x,), {"fail": True}, recipe=recipe)
    assert torch.equal(model(x), torch.nn.functional.linear(model.first(x), model.second.weight, model.second.bias))
    out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe)
    assert new_ws.keys() == ws.keys() and out.shape == (4, 16)


@pytest.mark.parametrize("first", [True, False, None])
def test_is_first_microbatch_takes_any_truth_value_a_user_sends(first):
    np = pytest.importorskip("numpy")
    model, recipe = torch.nn.Sequential(tef.nn.Linear(16, 16)), DelayedScaling(amax_history_len=4)
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)
    _, ws = tef.functional_call(model, params, ws, (torch.randn(4, 16),), recipe=recipe, is_first_microbatch=True)
    x = torch.randn(4, 16)
    want = tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=first)
    sent = [first] if first is None else [np.bool_(first), int(first), torch.tensor(first)]
    for flag in sent:
        got = tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=flag)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1]["0.input_amax_history"], want[1]["0.input_amax_history"]), flag
    with pytest.raises(TypeError, match="is_first_microbatch must be None, True or False"):
        tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch="yes")


# --- checkpoints of te_func 0.1 -----------------------------------------------------------------

FORMAT1 = {"delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling(),
           "block": RECIPES[3][1]}


def _format1_model():
    return torch.nn.Sequential(tef.nn.Linear(32, 16), torch.nn.GELU(), tef.nn.LayerNormMLP(16, 32))


@pytest.mark.parametrize("name", FORMAT1)
def test_a_stateful_checkpoint_of_te_func_0_1_loads_and_resumes_where_it_stopped(name):
    """tests/data/format1_*.pt: a Stateful checkpoint written by te_func 0.1 after two steps, the
    next step's input and the loss that version computed for it."""
    saved = torch.load(DATA / f"format1_{name}.pt")
    shell = tef.Stateful(_format1_model(), FORMAT1[name])
    shell.load_state_dict(saved["state_dict"])
    # The saved loss was computed on another machine: CPU fp32 GEMMs (the emulated FP8 ones) differ
    # by an ulp or two between CPU models (BLAS kernels), measured 1.9e-7 relative on an AMD EPYC.
    torch.testing.assert_close(shell(saved["x"], is_first_microbatch=True).square().mean().detach(), saved["loss"],
                               rtol=1e-6, atol=0)
    assert RECIPE_KEY in shell.workspaces and not any("=" in k for k in shell.workspaces)


def test_format1_workspaces_of_another_recipe_are_refused_naming_both():
    saved = torch.load(DATA / "format1_delayed.pt")["state_dict"]
    shell = tef.Stateful(_format1_model(), DelayedScaling(amax_history_len=8))
    with pytest.raises(tef.errors.RecipeMismatchError, match=r"made for DelayedScaling\(.*amax_history_len=4.*not DelayedScaling\(.*=8"):
        shell.load_state_dict(saved)
    old_ws = {k.removeprefix("workspaces."): v for k, v in saved.items() if k.startswith("workspaces.")}
    model = _format1_model()
    with pytest.raises(tef.errors.RecipeMismatchError, match=r"te_func 0\.1 .* tef\.upgrade_workspaces"):
        tef.functional_call(model, detached_params(model), old_ws, (torch.randn(2, 32),),
                            recipe=DelayedScaling(amax_history_len=4))
    new_ws = tef.upgrade_workspaces(old_ws, model, DelayedScaling(amax_history_len=4))
    tef.validate_workspaces(model, new_ws, DelayedScaling(amax_history_len=4))


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8CurrentScaling()], ids=["mxfp8", "current"])
def test_format2_workspaces_upgrade_bit_for_bit(recipe):
    """Format 2 kept MXFP8's scales as float8_e8m0fnu; format 3 keeps their bytes (uint8).
    A format-2 set is refused by a call, with the way out, and tef.upgrade_workspaces (or a
    Stateful load) gives format 3's entries bit for bit."""
    model = _format1_model()
    ws = tef.init_workspaces(model, recipe)
    old = {k: v.view(torch.float8_e8m0fnu) if v.dtype == torch.uint8 else v.clone() for k, v in ws.items()}
    old[RECIPE_KEY] = torch.tensor([2, ws[RECIPE_KEY][1].item()])
    assert any(v.dtype == torch.float8_e8m0fnu for v in old.values()) == isinstance(recipe, MXFP8BlockScaling)
    with pytest.raises(tef.errors.RecipeMismatchError, match=r"format 2; this te_func reads format 3: convert them with "
                                         r"tef\.upgrade_workspaces"):
        tef.functional_call(model, detached_params(model), old, (torch.randn(2, 32),), recipe=recipe)
    new = tef.upgrade_workspaces(old, model, recipe)
    assert new.keys() == ws.keys() and all(torch.equal(new[k], ws[k]) and new[k].dtype == ws[k].dtype for k in ws)
    shell = tef.Stateful(_format1_model(), recipe)
    shell.load_state_dict({**{f"model.{k}": v for k, v in model.state_dict().items()},
                           **{f"workspaces.{k}": v for k, v in old.items()}})
    assert all(torch.equal(shell.workspaces[k], ws[k]) for k in ws)
    with pytest.raises(tef.errors.RecipeMismatchError, match="made for another recipe"):
        tef.upgrade_workspaces(old, model, DelayedScaling())
