"""What a torch.func user meets when going past te_func's own calls: DelayedScaling differentiated
by plain torch.func or .backward() records its backward amaxes as tef.grad does (or is refused
where it cannot), a misspelt parameter name is refused, convert says what it left, errors say
what differs, and `import te_func` leaves the compiler alone."""
from __future__ import annotations

import inspect
import logging
import subprocess
import sys

import pytest
import torch
from torch.func import grad, jacrev, vjp

import te_func as tef
from te_func import errors
from te_func.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

from cases import VOCAB, detached_params, tiny_gpt2, tiny_llama

RECIPE = DelayedScaling(amax_history_len=4)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(tef.nn.Linear(32, 64), torch.nn.GELU(), tef.nn.Linear(64, 32))


def loss_fn(model, x, recipe=RECIPE):
    def f(params, ws):
        out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe)
        return out.square().mean(), new_ws
    return f


GRAD_KEYS = ("0.grad_amax_history", "2.grad_amax_history")


def test_plain_torch_func_grad_and_backward_record_what_tef_grad_records():
    """torch.func.grad (and grad_and_value, vjp) over tef.functional_call, and plain .backward():
    the new workspaces hold the backward amaxes tef.grad merges, the gradients are tef.grad's, and
    the workspaces passed in are untouched."""
    model, x = mlp(), torch.randn(16, 32)
    params, ws = detached_params(model), tef.init_workspaces(model, RECIPE)
    before = {k: v.clone() for k, v in ws.items()}
    f = loss_fn(model, x)
    want_grads, want_ws = tef.grad(f)(params, ws)
    assert all(want_ws[k][0] > 0 for k in GRAD_KEYS)

    got_grads, got_ws = grad(f, has_aux=True)(params, ws)
    for k in want_grads:
        torch.testing.assert_close(got_grads[k], want_grads[k], rtol=0, atol=0)
    for k in GRAD_KEYS:
        torch.testing.assert_close(got_ws[k], want_ws[k], rtol=0, atol=0)

    _, pull, vjp_ws = vjp(lambda p: f(p, ws), params, has_aux=True)
    pull(torch.ones(()))
    for k in GRAD_KEYS:
        torch.testing.assert_close(vjp_ws[k], want_ws[k], rtol=0, atol=0)

    live = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss, back_ws = f(live, ws)
    loss.backward()
    for k in want_grads:
        torch.testing.assert_close(live[k].grad, want_grads[k], rtol=0, atol=0)
    for k in GRAD_KEYS:
        torch.testing.assert_close(back_ws[k], want_ws[k], rtol=0, atol=0)
    for k, v in before.items():
        assert torch.equal(ws[k], v), k


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["HF-Llama", "HF-GPT2"])
def test_a_converted_hf_model_differentiated_by_torch_func_records_as_tef_grad_does(make):
    """The same on a converted transformers model, its labels' loss differentiated by plain
    torch.func.grad and by .backward(): every layer's grad history as tef.grad leaves it."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tef.convert(make(layers=1))
    ids = torch.randint(0, VOCAB, (2, 8))
    params, ws = detached_params(model), tef.init_workspaces(model, RECIPE)

    def f(p, w):
        out, new_ws = tef.functional_call(model, p, w, (), {"input_ids": ids, "labels": ids}, recipe=RECIPE)
        return out.loss, new_ws
    _, want = tef.grad(f)(params, ws)
    _, by_torch = grad(f, has_aux=True)(params, ws)
    live = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss, by_backward = f(live, ws)
    loss.backward()
    histories = [k for k in want if k.endswith("grad_amax_history")]
    assert histories and all(want[k][0] > 0 for k in histories)
    for k in histories:
        torch.testing.assert_close(by_torch[k], want[k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(by_backward[k], want[k], rtol=0, atol=0, msg=k)


def test_jacrev_over_inputs_records_the_max_of_its_rows_backward_amaxes():
    """jacrev runs one backward per output row under vmap: the one history keeps their max."""
    model, x = mlp(), torch.randn(4, 32)
    params, ws = detached_params(model), tef.init_workspaces(model, RECIPE)
    rows = []
    for i in range(4):
        def row(p, w, i=i):
            out, new_ws = tef.functional_call(model, p, w, (x,), recipe=RECIPE)
            return out.sum(dim=1)[i], new_ws
        rows.append(tef.grad(row)(params, ws)[1]["0.grad_amax_history"][0])
    box = {}

    def out_sum(x):
        out, box["ws"] = tef.functional_call(model, params, ws, (x,), recipe=RECIPE)
        return out.sum(dim=1)
    jac = jacrev(out_sum)(x)
    assert jac.shape == (4, 4, 32)
    assert len(set(float(r) for r in rows)) > 1          # the rows' amaxes differ: the max is a choice
    torch.testing.assert_close(box["ws"]["0.grad_amax_history"][0], torch.stack(rows).max(), rtol=0, atol=0)


def test_training_with_backward_steps_as_tef_grad_does_and_ends_near_high_precision():
    """A functional loop differentiated by .backward() takes the steps a tef.grad loop takes, bit
    for bit (small gradients: with scales stuck at 1.0 E5M2 flushes them), and once the histories
    hold the first steps' amaxes its gradients are within FP8 tolerance of high precision."""
    model = mlp()
    start = detached_params(model)
    ws_back = ws_grad = tef.init_workspaces(model, RECIPE)
    torch.manual_seed(1)
    for step in range(4):
        x = torch.randn(16, 32) * 1e-3
        live = {k: v.clone().requires_grad_() for k, v in start.items()}
        loss, ws_back = loss_fn(model, x)(live, ws_back)
        loss.backward()
        want, ws_grad = tef.grad(loss_fn(model, x))(start, ws_grad)
        for k in want:
            torch.testing.assert_close(live[k].grad, want[k], rtol=0, atol=0)
    hp = torch.func.grad(loss_fn(model, x, None), has_aux=True)(start, tef.init_workspaces(model, None))[0]
    assert max(((want[k] - hp[k]).norm() / hp[k].norm()).item() for k in hp) < 0.15
    assert ws_back["0.grad_scale"] != 1 and ws_back["2.grad_scale"] != 1


@pytest.mark.slow
def test_a_compiled_backward_outside_tef_grad_is_refused_when_it_runs():
    """Compiled, the backward cannot write the new workspaces: it raises UnrecordedAmaxError if run,
    and a compiled tef.value_and_grad of the same function records as eager."""
    model, x = mlp(), torch.randn(8, 32)
    params = dict(model.named_parameters())
    ws = tef.init_workspaces(model, RECIPE)
    f = torch.compile(loss_fn(model, x), backend="aot_eager", fullgraph=True)
    loss, _ = f(params, ws)
    with pytest.raises(errors.UnrecordedAmaxError, match=r"tef\.grad / tef\.value_and_grad.*tef\.Stateful"):
        loss.backward()
    step = torch.compile(tef.value_and_grad(loss_fn(model, x)), backend="aot_eager", fullgraph=True)
    _, _, new_ws = step(detached_params(model), ws)
    _, _, eager_ws = tef.value_and_grad(loss_fn(model, x))(detached_params(model), ws)
    for k in GRAD_KEYS:
        torch.testing.assert_close(new_ws[k], eager_ws[k])


def test_a_parameter_name_that_names_nothing_is_refused_with_the_nearest_name():
    model, x = mlp(), torch.randn(4, 32)
    ws = tef.init_workspaces(model, Float8CurrentScaling())
    params = detached_params(model)
    params["0.wieght"] = params.pop("0.weight")
    with pytest.raises(errors.UnknownParameterError, match=r"'0\.wieght'.*did you mean '0\.weight'") as e:
        tef.functional_call(model, params, ws, (x,), recipe=Float8CurrentScaling())
    assert isinstance(e.value, KeyError) and e.value.keys == ["0.wieght"] and e.value.nearest == "0.weight"
    with pytest.raises(errors.UnknownParameterError):
        tef.grad(loss_fn(model, x, Float8CurrentScaling()))(params, ws)
    # (params, buffers) as torch.func.functional_call takes them, and a tied name, pass
    tef.functional_call(model, (detached_params(model), {}), ws, (x,), recipe=Float8CurrentScaling())


def test_convert_returns_a_converted_root_and_warns_once_about_what_it_left(caplog):
    root = torch.nn.Linear(32, 32)
    new = tef.convert(root)
    assert isinstance(new, tef.nn.Linear) and new.weight is root.weight
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 100), torch.nn.Linear(100, 10),
                                torch.nn.LayerNorm(10))
    with caplog.at_level(logging.WARNING, logger="te_func.convert"):
        tef.convert(model)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "2 layer(s) converted, 2 left in high precision" in msg and "multiples of 16" in msg and "1, 2" in msg


@pytest.mark.parametrize("made, given, says", [
    (Float8CurrentScaling(), RECIPE,
     r"made for Float8CurrentScaling\(\), run with DelayedScaling\(amax_history_len=4\)"),
    (RECIPE, None, r"made for DelayedScaling\(amax_history_len=4\), run with None"),
    (RECIPE, DelayedScaling(amax_history_len=8), r"amax_history_len=4 \(made for\) vs 8 \(given\)"),
    (MXFP8BlockScaling(), Float8CurrentScaling(), r"made for MXFP8BlockScaling\(\), run with Float8CurrentScaling"),
])
def test_a_recipe_mismatch_says_briefly_which_recipes_differ(made, given, says):
    model = mlp()
    ws = tef.init_workspaces(model, made)
    with pytest.raises(errors.RecipeMismatchError, match=says) as e:
        tef.functional_call(model, detached_params(model), ws, (torch.randn(4, 32),), recipe=given)
    assert len(str(e.value)) < 300 and "QParams" not in str(e.value)
    assert "another model" not in str(e.value) and "missing" not in str(e.value)
    assert "tef.init_workspaces(model, recipe)" in str(e.value)


def test_a_0d_input_is_told_the_shape_the_layer_takes():
    model = mlp()
    with pytest.raises(ValueError, match=r"0-d tensor.*\(\.\.\., 32\)") as e:
        tef.functional_call(model, detached_params(model), tef.init_workspaces(model, None), (torch.tensor(1.0),),
                            recipe=None)
    assert "?" not in str(e.value)


def test_a_frozen_model_given_to_functional_call_is_told_it_is_frozen():
    model = mlp()
    frozen = tef.freeze(model, Float8CurrentScaling())
    with pytest.raises(errors.FrozenModelError, match=r"frozen \(tef\.freeze\).*frozen\(x\)"):
        tef.functional_call(frozen, dict(frozen.named_parameters()), {}, (torch.randn(4, 32),),
                            recipe=Float8CurrentScaling())


def test_workspaces_made_under_inference_mode_train_afterwards():
    model, x = mlp(), torch.randn(4, 32)
    with torch.inference_mode():
        ws = tef.init_workspaces(model, RECIPE)
        _, ws2 = tef.functional_call(model, detached_params(model), ws, (x,), recipe=RECIPE)
    for w in (ws, ws2):
        grads, new_ws = tef.grad(loss_fn(model, x))(detached_params(model), w)
        assert all(torch.isfinite(g).all() for g in grads.values()) and new_ws["2.grad_amax_history"][0] > 0


def test_grad_and_value_and_grad_take_has_aux_and_argnums():
    model, x = mlp(), torch.randn(4, 32)
    params, ws = detached_params(model), tef.init_workspaces(model, RECIPE)

    def with_aux(p, w, x):
        out, new_ws = tef.functional_call(model, p, w, (x,), recipe=RECIPE)
        return out.square().mean(), new_ws, {"logits": out}

    def nested_aux(p, w, x):
        loss, new_ws, aux = with_aux(p, w, x)
        return (loss, aux), new_ws

    grads, new_ws, aux = tef.grad(with_aux, has_aux=True)(params, ws, x)
    assert aux["logits"].shape == (4, 32) and new_ws["2.grad_amax_history"][0] > 0 and grads.keys() == params.keys()
    loss, grads2, new_ws2, aux2 = tef.value_and_grad(nested_aux, has_aux=True)(params, ws, x)
    assert loss.dim() == 0 and torch.equal(aux2["logits"], aux["logits"])
    assert all(torch.equal(grads[k], grads2[k]) for k in grads)
    (g_params, g_x), _ = tef.grad(loss_fn_x(model), argnums=(0, 2))(params, ws, x)
    assert g_x.shape == x.shape and g_params.keys() == params.keys()
    with pytest.raises(TypeError, match="has_aux=True"):
        tef.grad(with_aux)(params, ws, x)


def loss_fn_x(model):
    def f(p, w, x):
        out, new_ws = tef.functional_call(model, p, w, (x,), recipe=RECIPE)
        return out.square().mean(), new_ws
    return f


def test_the_public_signatures_are_typed_and_hold_no_private_argument():
    import importlib.metadata
    import importlib.resources
    assert tef.__version__ == importlib.metadata.version("te_func")
    assert importlib.resources.files("te_func").joinpath("py.typed").is_file()
    for fn in (tef.functional_call, tef.grad, tef.value_and_grad):
        sig = inspect.signature(fn)
        assert not any(name.startswith("_") for name in sig.parameters), fn
        assert sig.return_annotation is not inspect.Signature.empty, fn
    assert "has_aux" in inspect.signature(tef.grad).parameters


def test_import_leaves_the_compiler_alone():
    """`import te_func` imports neither torch._dynamo nor sympy (seconds of import time), and a
    compile afterwards still gets te_func's hooks (the boundary kept whole: FP8 backward)."""
    code = ("import sys, torch, te_func\n"
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
    code = ("import torch, te_func as tef\n"
            "from te_func.recipe import DelayedScaling\n"
            "m = torch.nn.Sequential(tef.nn.Linear(32, 32))\n"
            "r = DelayedScaling(amax_history_len=4)\n"
            "ws = tef.init_workspaces(m, r)\n"
            "def f(p, w):\n"
            "    out, nw = tef.functional_call(m, p, w, (torch.randn(4, 32),), recipe=r)\n"
            "    return out.square().sum(), nw\n"
            "p = {k: v.detach() for k, v in m.named_parameters()}\n"
            "g, nw = torch.compile(tef.grad(f), backend='aot_eager', fullgraph=True)(p, ws)\n"
            "print(bool(nw['0.grad_amax_history'][0] > 0))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, layers, tokens", [
    (MXFP8BlockScaling(), lambda: torch.nn.Sequential(torch.nn.GELU(), tef.nn.Linear(256, 16)), 8),
    (Float8BlockScaling(), lambda: torch.nn.Sequential(tef.nn.Linear(256, 512), torch.nn.GELU(),
                                                       tef.nn.Linear(512, 128)), 64),
], ids=["mxfp8", "block"])
def test_block_recipes_train_steps_compile_with_cpu_inductor_after_a_dynamo_reset(recipe, layers, tokens):
    """Inductor's C++ loop split asserts on these block casts (torch 2.13); te_func's guard is
    installed with inductor's code generator, so torch._dynamo.reset() does not remove it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = layers(), torch.randn(tokens, 256)
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)
    f = loss_fn(model, x, recipe)
    got, _ = torch.compile(tef.grad(f), fullgraph=True)(params, ws)
    want, _ = tef.grad(f)(params, ws)
    for k in want:
        if k.endswith("weight"):
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
        else:       # a bias gradient is a sum: inductor's order of summation
            torch.testing.assert_close(got[k], want[k])
