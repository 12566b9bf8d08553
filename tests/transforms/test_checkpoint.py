"""tef.checkpoint: activation checkpointing under torch.func transforms (tef.grad, per-sample vmap,
torch.compile of them), on te_func's own layers and a converted HuggingFace Llama."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import te_func as tef
from cases import RECIPES, VOCAB, detached_params, tiny_llama

FP8 = [pytest.param(r, id=rid) for rid, r in RECIPES if r is not None and "-" not in rid]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = tef.nn.RMSNorm(32)
        self.mlp = tef.nn.LayerNormMLP(32, 64)
        self.proj = tef.nn.Linear(32, 32)
        self.calls = 0

    def forward(self, x, scale=1.0):
        self.calls += 1
        return self.proj(self.mlp(self.norm(x))) * scale + x


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.checkpointed = False

    def forward(self, x):
        for b in self.blocks:
            if self.checkpointed == "partial":     # a partial of the block's bound call, keywords bound
                x = tef.checkpoint(functools.partial(b.__call__, scale=0.5), x)
            else:
                x = tef.checkpoint(b, x, scale=0.5) if self.checkpointed else b(x, scale=0.5)
        return x


def loss_of(model, recipe):
    def loss_fn(params, ws, x, first):
        out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=first)
        return out.square().sum(), new_ws
    return loss_fn


def pair(form=True):
    plain = Net()
    ckpt = copy.deepcopy(plain)
    ckpt.checkpointed = form
    return plain, ckpt


@pytest.mark.parametrize("recipe", FP8)
def test_checkpointed_grad_equals_the_plain_one_over_microbatches(recipe, form=True):
    """Three calls (a step, a later microbatch, a new step) under tef.grad: gradients and
    workspaces bit for bit those of the un-checkpointed model (casts reused by the recompute,
    DelayedScaling's backward amax recorded once, NVFP4's stochastic rounding drawing the same
    numbers), and each block ran twice per call (forward, recompute)."""
    plain, ckpt = pair(form)
    xs = [torch.randn(4, 8, 32) for _ in range(3)]
    results = []
    for model in (plain, ckpt):
        params, ws = detached_params(model), tef.init_workspaces(model, recipe)
        steps = []
        for i, x in enumerate(xs):
            grads, ws = tef.grad(loss_of(model, recipe))(params, ws, x, i != 1)
            steps.append((grads, ws))
        results.append(steps)
    for (g, w), (cg, cw) in zip(*results):
        assert g.keys() == cg.keys() and all(torch.equal(g[k], cg[k]) for k in g)
        assert w.keys() == cw.keys() and all(torch.equal(w[k], cw[k]) for k in w)
    assert [b.calls for b in plain.blocks] == [3, 3] and [b.calls for b in ckpt.blocks] == [6, 6]


@pytest.mark.parametrize("recipe", [p for p in FP8 if p.id == "delayed"])
def test_a_partial_of_the_blocks_bound_call_checkpoints_as_the_block(recipe):
    """What transformers 5.17's checkpointing layers pass, partial(layer.__call__, **kwargs): the
    same gradients and workspaces as the un-checkpointed model."""
    test_checkpointed_grad_equals_the_plain_one_over_microbatches(recipe, form="partial")


@pytest.mark.parametrize("recipe", FP8)
def test_checkpointed_blocks_on_workspaces_without_the_weight_cache(recipe):
    """The recompute casts the weights again (the forward's casts are not kept): gradients and
    workspaces are those of the un-checkpointed model with the cache, and no cast comes back."""
    plain, ckpt = pair()
    x = torch.randn(4, 8, 32)
    params = detached_params(plain)
    want, want_ws = tef.grad(loss_of(plain, recipe))(params, tef.init_workspaces(plain, recipe), x, None)
    got, got_ws = tef.grad(loss_of(ckpt, recipe))(params, tef.init_workspaces(ckpt, recipe, weight_cache=False),
                                                  x, None)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not any("_cast." in k for k in got_ws) and all(torch.equal(v, want_ws[k]) for k, v in got_ws.items())
    assert [b.calls for b in ckpt.blocks] == [2, 2]


def test_checkpointed_per_sample_and_compiled():
    """tef.per_sample_grad (both scopes) and torch.compile(tef.grad(...), fullgraph=True) of the
    checkpointed model equal the plain model's (current scaling: the scope matters there; the
    microbatch test above covers the other recipes' state)."""
    recipe = tef.recipe.Float8CurrentScaling()
    plain, ckpt = pair()
    x = torch.randn(4, 8, 32)
    for scope in ("sample", "batch"):
        got = [tef.per_sample_grad(loss_of(m, recipe), (0, None), scope=scope)(
            detached_params(m), tef.init_workspaces(m, recipe), x, True) for m in (plain, ckpt)]
        assert all(torch.equal(got[0][0][k], got[1][0][k]) for k in got[0][0])
        assert all(torch.equal(got[0][1][k], got[1][1][k]) for k in got[0][1])
    torch._dynamo.reset()
    params, ws = detached_params(ckpt), tef.init_workspaces(ckpt, recipe)
    compiled = torch.compile(tef.grad(loss_of(ckpt, recipe)), fullgraph=True, backend="aot_eager")
    got, got_ws = compiled(params, ws, x, True)
    want, want_ws = tef.grad(loss_of(plain, recipe))(params, ws, x, True)
    assert all(torch.equal(got[k], want[k]) for k in want) and all(torch.equal(got_ws[k], want_ws[k]) for k in want_ws)


def test_outside_transforms_it_is_torch_utils_checkpoint():
    """Eagerly (tef.Stateful and .backward()), tef.checkpoint is torch.utils.checkpoint, which
    the frame supports: the same gradients as the plain model."""
    plain, ckpt = pair()
    x = torch.randn(4, 8, 32)
    for model in (plain, ckpt):
        tef.Stateful(model, tef.recipe.DelayedScaling())(x).square().sum().backward()
    for (k, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.equal(p.grad, q.grad), k
    assert [b.calls for b in ckpt.blocks] == [2, 2]


def test_a_function_without_its_module_is_refused():
    with pytest.raises(TypeError, match="give the module to recompute"):
        tef.checkpoint(lambda x: x * 2, torch.randn(2))


@pytest.mark.parametrize("recipe", [p for p in FP8 if p.id == "delayed"])
def test_hf_gradient_checkpointing_under_tef_grad(recipe):
    """A converted HF Llama with gradient checkpointing on and tef.checkpoint as its
    checkpointing function (torch.func refuses torch.utils.checkpoint): tef.grad gives the
    un-checkpointed model's gradients and workspaces, bit for bit."""
    pytest.importorskip("transformers")
    base = tef.convert(tiny_llama())
    plain, ckpt = copy.deepcopy(base), copy.deepcopy(base)
    # transformers 5.25's name; 5.17 (and older releases that pyproject admits) has only the other
    (getattr(ckpt, "activation_checkpointing_enable", None) or ckpt.gradient_checkpointing_enable)()
    # Its hook making the embeddings' output require grad calls requires_grad_, which torch.func
    # refuses; under tef.grad that output is differentiated anyway.
    ckpt.disable_input_require_grads()
    for m in ckpt.modules():
        if hasattr(m, "_gradient_checkpointing_func"):
            m._gradient_checkpointing_func = tef.checkpoint
    x = torch.randint(0, VOCAB, (2, 16))
    results = []
    for model in (plain, ckpt):
        model.train()

        def loss_fn(params, ws, ids):
            out, new_ws = tef.functional_call(model, params, ws, (), {"input_ids": ids, "labels": ids},
                                              recipe=recipe)
            return out.loss, new_ws
        results.append(tef.grad(loss_fn)(detached_params(model), tef.init_workspaces(model, recipe), x))
    (g, w), (cg, cw) = results
    assert all(torch.equal(g[k], cg[k]) for k in g) and all(torch.equal(w[k], cw[k]) for k in w)
