"""The transform matrix: every layer x every recipe through every transform.

Columns: eager module call, tef.functional_call, tef.grad, torch.func.vmap
(per-sample gradients and a stacked ensemble), tef.per_sample_grad in both
quantization scopes (chunked and compiled too; HuggingFace models take each
sample as a batch of one), torch.compile(fullgraph=True)
of a whole train step, and tef.Stateful; workspaces without the weight
cache through tef.grad, torch.compile and tef.Stateful; and tef.freeze, with FP8 x FP8
and with weight-only FP8 GEMMs. Rows come from tests/cases.py, so a
new layer or recipe joins every column by adding one row there.

Each column checks values against another column that is already trusted,
bit for bit wherever the same ops run in the same order.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch._dynamo.testing

import te_func as tef
from cases import (HF_MODELS, LAYERS, RECIPES, ROW_BATCH_INVARIANT_MATMUL, assert_dicts_equal,
                   assert_dicts_match_to_rounding, assert_grads_match, bits, detached_params, is_fp4, needs_state,
                   sqnr)
from te_func.quant import dequantize
from te_func.quant.workspace import RECIPE_KEY
from te_func.recipe import DelayedScaling, Float8BlockScaling, MXFP8BlockScaling

BATCH = 4


MATRIX = [pytest.param(case, recipe, id=f"{case.name}-{rid}") for case in LAYERS + HF_MODELS for rid, recipe in RECIPES
          if rid not in case.skip_recipes]


@dataclass
class Setup:
    """A model, one batch of inputs, a regression target and the loss of the functional API."""
    case: object
    model: torch.nn.Module
    recipe: object
    inputs: tuple
    target: torch.Tensor
    kwargs: dict

    def loss_fn(self, params, ws, inputs, target, first=None):
        out, new_ws = tef.functional_call(self.model, params, ws, inputs, self.kwargs, recipe=self.recipe,
                                          is_first_microbatch=first)
        return self.loss(out, target), new_ws

    def loss(self, out, target):
        # A sum over samples (not a mean), so per-sample gradients add up to the batch gradient.
        return ((self.case.output(out).to(target.dtype) - target) ** 2).sum()

    def eager_context(self):
        """Where an eager call of the model runs with this recipe (stateless recipes only)."""
        return tef.autocast(self.recipe) if self.recipe is not None else torch.enable_grad()

    def per_sample_grad(self, **kwargs):
        """tef.per_sample_grad of loss_fn over (inputs, target), a batch of one per sample where
        the model needs its batch dim."""
        return tef.per_sample_grad(self.loss_fn, self.in_dims, keepdim=self.case.keepdim, **kwargs)

    def sample_loss_fn(self, params, ws, inputs, target):
        """loss_fn of one sample as a plain vmap passes it (keepdim done by hand)."""
        if self.case.keepdim:
            first, *rest = inputs
            inputs, target = (first[None], *rest), target[None]
        return self.loss_fn(params, ws, inputs, target)

    @property
    def in_dims(self):
        """tef.per_sample_grad's in_dims for (inputs, target): the samples along dim 0 of the
        first input and of the target, the other inputs shared."""
        return ((0,) + (None,) * (len(self.inputs) - 1), 0)


def make_setup(case, recipe, dtype=torch.float32, tokens: int = 8, batch: int = BATCH) -> Setup:
    """`tokens` per sample: a multiple of the 8 the cases draw (per-sample cases only)."""
    model = case.make(dtype)
    inputs = case.inputs(batch, dtype)                                      # (batch, 8, ...)
    if tokens != 8:
        first, *rest = case.inputs(batch * tokens // 8, dtype)
        inputs = (first.reshape(batch, tokens, *first.shape[2:]), *rest)    # (batch, tokens, ...)
    with torch.no_grad():
        out = case.output(model(*inputs, **case.kwargs))
    return Setup(case, model, recipe, inputs, torch.randn(out.shape), case.kwargs)


def float64_reference(s: Setup):
    """(loss_fn, params, ws, inputs, target) of the same model in float64 with recipe None."""
    model = copy.deepcopy(s.model).double()
    ref = Setup(s.case, model, None, double(s.inputs), s.target.double(), s.kwargs)
    return ref, {k: v.double() for k, v in detached_params(s.model).items()}, tef.init_workspaces(model, None)


def double(inputs: tuple) -> tuple:
    return tuple(x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)


# --- eager and functional_call -------------------------------------------------------------------

@pytest.mark.parametrize("case, recipe", MATRIX)
def test_eager_call_equals_functional_call(case, recipe):
    """Outside any frame a module computes in high precision; under tef.autocast(recipe) it
    computes what functional_call computes with that recipe and no cache (a layer with no FP8
    state, a norm, runs there under DelayedScaling too)."""
    s = make_setup(case, recipe)
    params = detached_params(s.model)
    hp, _ = tef.functional_call(s.model, params, tef.init_workspaces(s.model, None), s.inputs, s.kwargs,
                                recipe=None)
    assert torch.equal(case.output(s.model(*s.inputs, **s.kwargs)), case.output(hp))
    if recipe is None:
        return
    if needs_state(recipe) and any(m.gemms() for m in s.model.modules() if isinstance(m, tef.nn.TEModule)):
        with pytest.raises(tef.errors.TransformError, match="tef.autocast has nowhere to keep"):
            with tef.autocast(recipe):
                s.model(*s.inputs, **s.kwargs)
        return
    out, _ = tef.functional_call(s.model, params, tef.init_workspaces(s.model, recipe), s.inputs, s.kwargs,
                                 recipe=recipe)
    with tef.autocast(recipe):
        eager = s.model(*s.inputs, **s.kwargs)
    assert torch.equal(case.output(eager), case.output(out))


@pytest.mark.parametrize("case, recipe", MATRIX)
def test_functional_call_cached_weights_give_the_uncached_result(case, recipe):
    """is_first_microbatch None / True / False (on True's cache) agree for unchanged weights, and
    the new workspaces hold every entry of the old ones."""
    s = make_setup(case, recipe)
    params, ws = detached_params(s.model), tef.init_workspaces(s.model, recipe)
    run = lambda w, first: tef.functional_call(s.model, params, w, s.inputs, s.kwargs, recipe=recipe,
                                               is_first_microbatch=first)
    uncached, ws_none = run(ws, None)
    first, ws_first = run(ws, True)
    again, ws_again = run(ws, True)
    assert ws_none.keys() == ws_first.keys() == ws.keys()
    assert torch.equal(case.output(first), case.output(uncached))
    assert torch.equal(case.output(again), case.output(first))          # deterministic
    assert_dicts_equal(ws_again, ws_first)
    if not needs_state(recipe):     # delayed scaling may move its scales between the calls
        cached, ws_cached = run(ws_first, False)
        assert torch.equal(case.output(cached), case.output(first))
        assert_dicts_equal(ws_cached, ws_first)


# --- grad ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case, recipe", MATRIX)
def test_grad_equals_eager_backward(case, recipe):
    """tef.grad and tef.value_and_grad give what loss.backward() gives on the eager module
    (tef.Stateful for recipes with state), bit for bit."""
    s = make_setup(case, recipe)
    params, ws = detached_params(s.model), tef.init_workspaces(s.model, recipe)
    grads, new_ws = tef.grad(s.loss_fn)(params, ws, s.inputs, s.target, True)
    loss, grads2, new_ws2 = tef.value_and_grad(s.loss_fn)(params, ws, s.inputs, s.target, True)
    assert_dicts_equal(grads2, grads)
    assert_dicts_equal(new_ws2, new_ws)
    assert grads.keys() == params.keys()

    eager = copy.deepcopy(s.model)
    if needs_state(recipe):
        shell = tef.Stateful(eager, recipe)
        eager_loss = s.loss(shell(*s.inputs, is_first_microbatch=True, **s.kwargs), s.target)
    else:
        with s.eager_context():
            eager_loss = s.loss(eager(*s.inputs, **s.kwargs), s.target)
    eager_loss.backward()
    assert torch.equal(eager_loss.detach(), loss)
    assert_grads_match(case, {k: p.grad for k, p in eager.named_parameters()}, grads)


# --- vmap ---------------------------------------------------------------------------------------

# Per-sample FP8 under a plain vmap is not batch FP8 (tef.per_sample_grad(scope="batch") makes it
# so, below): current scaling takes one amax per sample under vmap, so the
# sum of per-sample gradients differs from the batch gradient by quantization noise (measured
# 21-24 dB apart for current scaling). Both are compared with the float64 batch gradient instead,
# and the per-sample sum must be about as accurate as the batch FP8 gradient. Measured over 20
# seeds (Linear 64->48, 4x8 tokens, torch 2.13 CPU), weight / bias, min (mean), per-sample sum vs
# batch FP8: current 24.1 (24.5) vs 24.1 (24.6) / 40.2 (42.7); MXFP8 and blockwise 27.8 (28.3) vs
# 27.8 (28.3) / 41.0 (43.5) dB.
# NVFP4 (4-bit values; min over 6 seeds, per-sample sum vs batch): Linear 17.6 vs 14.8, LayerNormLinear
# 12.1 vs 12.4, LayerNormMLP gelu 9.9 vs 9.2, swiglu 8.6 vs 8.6 dB: its floor sits under those.
PER_SAMPLE_SLACK_DB = 3.0
PER_SAMPLE_FLOOR_DB = 17.0      # torchao's weight-gradient minimum
PER_SAMPLE_FLOOR_DB_FP4 = 6.0


def _split(inputs, i):
    first, *rest = inputs
    return (first[i], *rest)


class _Checkpointed(torch.nn.Module):
    """The case's model under tef.checkpoint."""
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return tef.checkpoint(self.inner, *args, **kwargs)


@pytest.mark.parametrize("case, recipe", MATRIX)
def test_checkpointed_grad_equals_grad(case, recipe):
    """tef.checkpoint around the whole model under tef.grad, a step and a later microbatch:
    the gradients and workspaces of the plain model, bit for bit (the recompute reuses the
    step's casts and records each backward amax once)."""
    s = make_setup(case, recipe)
    wrapped = Setup(case, _Checkpointed(s.model), recipe, s.inputs, s.target, s.kwargs)
    params, ws = detached_params(s.model), tef.init_workspaces(s.model, recipe)
    wparams = {f"inner.{k}": v for k, v in params.items()}
    wws = {k if k == RECIPE_KEY else f"inner.{k}": v for k, v in ws.items()}
    for first in (True, False):
        grads, ws = tef.grad(s.loss_fn)(params, ws, s.inputs, s.target, first)
        wgrads, wws = tef.grad(wrapped.loss_fn)(wparams, wws, s.inputs, s.target, first)
        assert_dicts_equal({f"inner.{k}": v for k, v in grads.items()}, wgrads)
        assert_dicts_equal({k if k == RECIPE_KEY else f"inner.{k}": v for k, v in ws.items()}, wws)


@pytest.mark.parametrize("case, recipe", MATRIX)
def test_vmap_per_sample_grads(case, recipe):
    """vmap(tef.grad) over the batch: sample i's gradient equals tef.grad on sample i alone,
    and the per-sample gradients add up to the batch gradient."""
    if not case.per_sample or case.keepdim:
        pytest.skip(f"{case.name}: no per-sample batch dim" if not case.per_sample else
                    f"{case.name}: a forward needs its batch dim (the tef.per_sample_grad columns keep it)")
    s = make_setup(case, recipe)
    params, ws = detached_params(s.model), tef.init_workspaces(s.model, recipe)
    in_dims = (0,) + (None,) * (len(s.inputs) - 1)
    per_sample, _ = torch.func.vmap(tef.grad(s.loss_fn), in_dims=(None, None, in_dims, 0))(
        params, ws, s.inputs, s.target)
    for i in range(BATCH):
        alone, _ = tef.grad(s.loss_fn)(params, ws, _split(s.inputs, i), s.target[i])
        for k in params:
            assert torch.allclose(per_sample[k][i], alone[k], rtol=1e-6, atol=1e-6), (i, k)
    batch, _ = tef.grad(s.loss_fn)(params, ws, s.inputs, s.target)
    if recipe is None:
        for k in params:
            assert torch.allclose(per_sample[k].sum(0), batch[k], rtol=1e-5, atol=1e-5), k
        return
    ref, params64, ws64 = float64_reference(s)
    exact, _ = tef.grad(ref.loss_fn)(params64, ws64, ref.inputs, ref.target)
    floor = PER_SAMPLE_FLOOR_DB_FP4 if is_fp4(recipe) else PER_SAMPLE_FLOOR_DB
    for k in params:
        got, want = sqnr(exact[k], per_sample[k].sum(0)), sqnr(exact[k], batch[k])
        assert got >= max(want - PER_SAMPLE_SLACK_DB, floor), (k, got, want)


@pytest.mark.parametrize("case, recipe", MATRIX)
def test_vmap_ensemble_of_stacked_models(case, recipe):
    """case.members models stacked with tef.stack_module_state (parameters, buffers and workspaces
    in one call): member i of the vmapped call equals running model i alone (output and new
    workspaces), and tef.unstack_module_state gives back each member's."""
    members = [case.make(torch.float32) for _ in range(case.members)]
    member_ws = [tef.init_workspaces(m, recipe) for m in members]
    params, buffers, ws = tef.stack_module_state(members, recipe, member_ws)
    inputs = case.inputs(BATCH, torch.float32)
    base = members[0]

    def run(p, b, w):
        out, new_ws = tef.functional_call(base, {**p, **b}, w, inputs, case.kwargs, recipe=recipe,
                                          is_first_microbatch=True)
        return case.output(out), new_ws

    out, new_ws = torch.func.vmap(run)(params, buffers, ws)
    unstacked = tef.unstack_module_state(params, buffers, new_ws)
    assert len(unstacked) == len(members)
    for i, (m, (p_i, _, ws_i)) in enumerate(zip(members, unstacked)):
        out_i, want_ws = tef.functional_call(m, detached_params(m), member_ws[i], inputs, case.kwargs,
                                             recipe=recipe, is_first_microbatch=True)
        assert torch.equal(out[i], case.output(out_i))
        assert_dicts_equal(ws_i, want_ws)
        assert_dicts_equal({k: v.detach() for k, v in p_i.items()}, detached_params(m))


# --- tef.per_sample_grad: the two quantization scopes ------------------------------------------

PER_SAMPLE_MATRIX = [pytest.param(case, recipe, id=f"{case.name}-{rid}") for case in LAYERS + HF_MODELS
                     for rid, recipe in RECIPES
                     if case.per_sample and (case.slow_recipes is None or rid in case.slow_recipes)]
U = 2.0 ** -24          # fp32's unit roundoff


def per_sample_shape(case, recipe) -> dict:
    """make_setup's tokens per sample and samples: tokens that fill whole blocks along the tokens
    (32 MXFP8, 128 Float8BlockScaling), so that no block of the batch spans two samples, 8 where
    the scales are tensor-wise; 2 samples where one is long (128 tokens, a HuggingFace model:
    vmap runs its attention sample by sample) to keep the test short."""
    tokens = {MXFP8BlockScaling: 32, Float8BlockScaling: 128}.get(type(recipe), 8)
    return dict(tokens=tokens, batch=2 if tokens == 128 or case.keepdim else BATCH)


def per_token(s: Setup):
    """(inputs, target) with every token a sample of one token."""
    first, *rest = s.inputs
    return (first.reshape(-1, 1, first.shape[-1]), *rest), s.target.reshape(-1, 1, s.target.shape[-1])


def summation_order_bounds(s: Setup, params: dict, batch: dict) -> dict:
    """Per element of each gradient, how far two summation orders of the batch gradient may lie
    apart. Two orders of a sum of n terms t differ by at most 2 n u sum|t| (u = 2**-24). The
    terms are the per-token gradients; their magnitudes are taken from the high-precision model
    (every token a sample) and doubled, which covers the FP8 operands' distance from it
    (measured: the error stays below a tenth of the undoubled bound over every layer and
    recipe). Attention mixes a sample's tokens, so a model with it (case.keepdim) has no
    per-token terms: there the bound is 1e-5 of the gradient's largest element (measured:
    below 2e-6)."""
    if s.case.keepdim:
        return {k: 1e-5 * batch[k].double().abs().max() for k in params}
    hp = Setup(s.case, s.model, None, s.inputs, s.target, s.kwargs)
    terms, _ = tef.per_sample_grad(hp.loss_fn, s.in_dims)(params, tef.init_workspaces(s.model, None), *per_token(s))
    n = s.inputs[0].shape[0] * s.inputs[0].shape[1]
    return {k: 2 * n * U * 2 * terms[k].double().abs().sum(0) for k in params}


@pytest.mark.parametrize("case, recipe", PER_SAMPLE_MATRIX)
def test_per_sample_grad_is_vmap_of_grad_with_workspaces_folded(case, recipe):
    """scope="sample" computes what torch.func.vmap(tef.grad) computes, bit for bit, also in
    chunks (the last one short); its workspaces come back once, in their own
    shapes: the vmap's, folded. Bit for bit where the CPU's matmul gives rows the same bits
    in a batch of any size (a chunk's emulated GEMMs have fewer rows than the whole batch's),
    else to fp32 rounding."""
    s = make_setup(case, recipe, batch=per_sample_shape(case, recipe)["batch"])
    params, ws = detached_params(s.model), tef.init_workspaces(s.model, recipe)
    raw, raw_ws = torch.func.vmap(tef.grad(s.sample_loss_fn), in_dims=(None, None, *s.in_dims))(
        params, ws, s.inputs, s.target)
    grads, new_ws = s.per_sample_grad(chunk_size=len(s.target) - 1)(params, ws, s.inputs, s.target)
    same = assert_dicts_equal if ROW_BATCH_INVARIANT_MATMUL else assert_dicts_match_to_rounding
    same(grads, raw)
    same(new_ws, tef.fold_workspaces(s.model, raw_ws, recipe))
    assert all(new_ws[k].shape == ws[k].shape for k in ws)


@pytest.mark.parametrize("case, recipe", PER_SAMPLE_MATRIX)
def test_batch_scope_per_sample_grads_add_up_to_the_batch_gradient(case, recipe):
    """scope="batch": quantized with the whole batch's scales, the per-sample gradients add up to
    tef.grad of the batch up to fp32 summation order, and the workspaces equal the batch's bit
    for bit. Bit for bit the sums cannot agree: tef.grad adds the batch's tokens in one GEMM, the
    per-sample path per sample and then over samples (summation_order_bounds)."""
    if is_fp4(recipe):
        pytest.skip("NVFP4 has no batch scope: a sample's gradient gets its own per-tensor scale (from its "
                    "amax) and its own stochastic rounding, so its per-sample gradients do not add up to "
                    "the batch's within fp32 summation order")
    s = make_setup(case, recipe, **per_sample_shape(case, recipe))
    params, ws = detached_params(s.model), tef.init_workspaces(s.model, recipe)
    batch, batch_ws = tef.grad(s.loss_fn)(params, ws, s.inputs, s.target)
    grads, new_ws = s.per_sample_grad(scope="batch")(params, ws, s.inputs, s.target)
    assert_dicts_equal(new_ws, batch_ws)
    for k in params:
        assert grads[k].shape == (s.inputs[0].shape[0], *params[k].shape)
    bounds = summation_order_bounds(s, params, batch)
    for k in params:
        err = (grads[k].sum(0).double() - batch[k].double()).abs()
        assert (err <= bounds[k]).all(), (k, (err / bounds[k]).max())
    if tef.frame.batch_scope_spec(s.model, recipe):
        # Where the scopes differ (current scaling), the sample scope misses that bound by far.
        own, _ = s.per_sample_grad()(params, ws, s.inputs, s.target)
        assert any(((own[k].sum(0).double() - batch[k].double()).abs() > 100 * bounds[k]).any() for k in params
                   if k.endswith("weight") and params[k].dim() == 2)


@pytest.mark.parametrize("recipe", [pytest.param(r, id=rid) for rid, r in RECIPES])
def test_per_sample_grad_compiles_chunked(recipe):
    """torch.compile(fullgraph=True) of tef.per_sample_grad in chunks of 2 samples, on Linear: one
    graph for two calls, results equal to eager's, chunked or not, bit for bit. In batch scope
    where the scopes differ (current scaling: a pass over the whole batch, then the per-sample
    pass with its amaxes), else in sample scope, whose per-sample pass the batch scope runs
    there; the sample scope under current scaling compiles in examples/dp_sgd.py's test
    (LayerNormMLP and Linear)."""
    torch._dynamo.reset()
    s = make_setup(LAYERS[0], recipe)
    params, ws = detached_params(s.model), tef.init_workspaces(s.model, recipe)
    scope = "batch" if tef.frame.batch_scope_spec(s.model, recipe) else "sample"
    per_sample = tef.per_sample_grad(s.loss_fn, s.in_dims, scope=scope, chunk_size=2)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(per_sample, fullgraph=True, backend=counter)
    for _ in range(2):
        got, got_ws = compiled(params, ws, s.inputs, s.target)
        want, want_ws = per_sample(params, ws, s.inputs, s.target)
        whole, whole_ws = tef.per_sample_grad(s.loss_fn, s.in_dims, scope=scope)(params, ws, s.inputs, s.target)
        for a, b in ((got, want), (got_ws, want_ws), (want, whole), (want_ws, whole_ws)):
            assert_dicts_equal(a, b)
        ws = got_ws
    assert counter.frame_count == 1


# --- torch.compile ------------------------------------------------------------------------------

def skip_unless_compiled(case, recipe):
    rid = next(rid for rid, r in RECIPES if r is recipe)
    if case.slow_recipes is not None and rid not in case.slow_recipes:
        pytest.skip(f"{case.name} compiles under {', '.join(case.slow_recipes)} only (CI time)")


def make_train_step(s: Setup, lr=1e-3):
    def step(params, ws, inputs, target, first):
        grads, new_ws = tef.grad(s.loss_fn)(params, ws, inputs, target, first)
        return {k: p - lr * grads[k] for k, p in params.items()}, new_ws
    return step


def run_compiled_vs_eager(s: Setup, backend, steps: int):
    """Runs a compiled and an eager train step side by side, yielding both states per step."""
    step = make_train_step(s)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    p_c = p_e = detached_params(s.model)
    w_c = w_e = tef.init_workspaces(s.model, s.recipe)
    for i in range(steps):
        first = i % 2 == 0          # microbatch pairs: cast the weights, then reuse the cast
        p_c, w_c = compiled(p_c, w_c, s.inputs, s.target, first)
        p_e, w_e = step(p_e, w_e, s.inputs, s.target, first)
        yield (p_c, w_c), (p_e, w_e)


@pytest.mark.parametrize("case, recipe", MATRIX)
def test_compiled_train_step_equals_eager(case, recipe):
    """torch.compile(fullgraph=True) of tef.grad + an SGD update: no graph break, at most 2
    compilations (is_first_microbatch True / False) over 10 steps, results bit-equal to eager."""
    skip_unless_compiled(case, recipe)
    torch._dynamo.reset()
    s = make_setup(case, recipe)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for (p_c, w_c), (p_e, w_e) in run_compiled_vs_eager(s, counter, steps=10):
        assert_dicts_equal(p_c, p_e)
        assert_dicts_equal(w_c, w_e)
    assert 1 <= counter.frame_count <= 2


# The default backend, once per base recipe on the smallest GEMM layer: an inductor compile of a
# train step takes CI's CPU 30-90 s, so one Linear step each (the aot_eager column above covers
# every layer, the cached-weight graph and the backward_override variants).
_INDUCTOR_RECIPES = ("bf16", "current", "mxfp8", "block", "delayed", "nvfp4")


@pytest.mark.slow
@pytest.mark.parametrize("case, recipe", [
    pytest.param(*p.values, id=p.id) for p in MATRIX
    if p.values[0].name == "Linear" and p.id.split("-", 1)[1] in _INDUCTOR_RECIPES])
def test_compiled_train_step_with_inductor(case, recipe):
    """The default backend compiles the train step on CPU under every recipe (float8 casts,
    _scaled_mm, MXFP8's E8M0 scale bytes, NVFP4's uint8 codes and int64 Philox stream).
    Inductor fuses the reductions (bias gradient, SGD update), so equal to eager up to fp32
    rounding; the casts and states it leaves are bit-equal."""
    torch._dynamo.reset()
    s = make_setup(case, recipe)
    for (p_c, w_c), (p_e, w_e) in run_compiled_vs_eager(s, "inductor", steps=1):
        for k in p_e:
            assert torch.allclose(p_c[k], p_e[k], rtol=1e-5, atol=1e-6), k
        assert_dicts_equal(w_c, w_e)



@pytest.mark.slow
@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8BlockScaling()], ids=["mxfp8", "block"])
def test_inductor_compiles_block_recipes_on_a_stack_of_layers(recipe):
    """Two layers deep, inductor's C++ backend fuses the block casts of a gradient and of its
    transpose into one loop that torch's own loop split asserts on (te_func/_compat.py guards
    it; the repro is in docs/functional.md): the step compiles, equal to eager to fp32 rounding."""
    from te_func import _compat
    assert _compat._mismatched_ranges(AssertionError(({"y0": 32}, {"y0": 64})))
    assert not _compat._mismatched_ranges(AssertionError("another assertion"))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(tef.nn.Linear(256, 256), tef.nn.Linear(256, 256))
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)

    def loss_fn(p, w, x):
        out, new_w = tef.functional_call(model, p, w, (x,), recipe=recipe)
        return out.square().sum(), new_w
    x = torch.randn(32, 256)
    got, got_ws = torch.compile(tef.grad(loss_fn), fullgraph=True)(params, ws, x)
    want, want_ws = tef.grad(loss_fn)(params, ws, x)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-5), k
    assert_dicts_equal(got_ws, want_ws)


# --- derivatives beyond the first, gradients outside vmap, inference_mode, meta ------------------

def _float_first_input(s: Setup) -> bool:
    return s.inputs[0].is_floating_point()


def _derivatives(s: Setup, params: dict, ws: dict, dparams: dict, dx):
    """jvp of the output, and the Hessian-vector product of the loss in direction (dparams, dx)
    reverse-over-reverse (vjp of grad) and forward-over-reverse (jvp of grad), with respect to
    the parameters and the first input where it is a float tensor (not token ids)."""
    first, *rest = s.inputs

    def out_of(p, x):
        out, _ = tef.functional_call(s.model, p, ws, (x, *rest), s.kwargs, recipe=s.recipe)
        return s.case.output(out)

    def loss(p, x):
        return ((out_of(p, x).to(s.target.dtype) - s.target) ** 2).sum()
    if dx is None:
        out_tangent = torch.func.jvp(lambda p: out_of(p, first), (params,), (dparams,))[1]
        grad_p = torch.func.grad(lambda p: loss(p, first))
        reverse = torch.func.vjp(grad_p, params)[1](dparams)[0]
        forward = torch.func.jvp(grad_p, (params,), (dparams,))[1]
    else:
        out_tangent = torch.func.jvp(out_of, (params, first), (dparams, dx))[1]
        grad_both = torch.func.grad(loss, argnums=(0, 1))
        reverse = torch.func.vjp(grad_both, params, first)[1]((dparams, dx))
        forward = torch.func.jvp(grad_both, (params, first), (dparams, dx))[1]
        reverse, forward = {**reverse[0], "x": reverse[1]}, {**forward[0], "x": forward[1]}
    return {"jvp": out_tangent, **{f"vjp(grad)[{k}]": v for k, v in reverse.items()},
            **{f"jvp(grad)[{k}]": v for k, v in forward.items()}}


def _step_into_scales(s: Setup, params, ws):
    """One tef.grad step, so that a DelayedScaling layer quantizes with scales from its
    history (a first step's are 1) and the weight casts are cached."""
    _, ws = tef.grad(s.loss_fn)(params, ws, s.inputs, s.target, True)
    return ws


@pytest.mark.parametrize("case, recipe", MATRIX)
def test_forward_mode_and_second_derivatives(case, recipe):
    """torch.func.jvp, and Hessian-vector products both ways (vjp of grad, jvp of grad), with
    respect to the parameters and the input: under recipe None those of the float64 model to fp32
    rounding; under a recipe finite, not zero, within FP8 noise of recipe None, and the two HVPs
    within FP8 noise of each other (docs/functional.md defines them: the linearization on the
    forward's casts)."""
    rid = next(rid for rid, r in RECIPES if r is recipe)
    if case.slow_recipes is not None and rid not in case.slow_recipes:
        pytest.skip(f"{case.name} runs second derivatives under {', '.join(case.slow_recipes)} only (CI time)")
    s = make_setup(case, recipe)
    params = detached_params(s.model)
    ws = _step_into_scales(s, params, tef.init_workspaces(s.model, recipe))
    gen = torch.Generator().manual_seed(5)
    dparams = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
    dx = torch.randn(s.inputs[0].shape, generator=gen) if _float_first_input(s) else None
    # torch has no forward mode for the fused attention kernels: HuggingFace's sdpa through math
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        got = _derivatives(s, params, ws, dparams, dx)
        hp = Setup(case, s.model, None, s.inputs, s.target, s.kwargs)
        want = _derivatives(hp, params, tef.init_workspaces(s.model, None), dparams, dx)
    if recipe is None:
        ref, params64, ws64 = float64_reference(s)
        want = _derivatives(ref, params64, ws64, {k: v.double() for k, v in dparams.items()},
                            None if dx is None else dx.double())
        for k in want:
            torch.testing.assert_close(got[k].double(), want[k], rtol=1e-3, atol=1e-4 * want[k].abs().max(), msg=k)
        return
    floor = 3.0 if is_fp4(recipe) else 10.0
    for k in want:
        if want[k].norm() == 0:                 # a parameter the loss is linear in, for one
            assert got[k].norm() == 0, k
            continue
        assert torch.isfinite(got[k]).all() and got[k].norm() > 0.1 * want[k].norm(), k
        # Under DelayedScaling the outer backward of reverse-over-reverse quantizes its cotangent
        # with the step's gradient scale, made for the first-order gradients: larger values
        # saturate (docs/functional.md). Forward-over-reverse quantizes no tangent.
        if not (k.startswith("vjp(grad)") and isinstance(recipe, DelayedScaling)):
            assert sqnr(want[k], got[k]) >= floor, (k, sqnr(want[k], got[k]))


@pytest.mark.parametrize("case, recipe", MATRIX)
def test_gradients_outside_a_vmap_over_stacked_members(case, recipe):
    """vmap(functional_call) over stacked members' parameters with loss.backward() outside it
    (the ensemble or MAML pattern): each member's gradient is that member's own backward's, and
    the workspaces come back as plain state."""
    members = [case.make(torch.float32) for _ in range(case.members)]
    stacked, buffers, _ = tef.stack_module_state(members, recipe, [tef.init_workspaces(m, recipe) for m in members])
    stacked = {k: v.detach().requires_grad_() for k, v in stacked.items()}
    base = members[0]
    ws = tef.init_workspaces(base, recipe)
    inputs = case.inputs(BATCH, torch.float32)

    def member(p, b):
        out, new_ws = tef.functional_call(base, {**p, **b}, ws, inputs, case.kwargs, recipe=recipe)
        assert all(not v.requires_grad for v in new_ws.values())
        return case.output(out)
    torch.func.vmap(member)(stacked, buffers).square().sum().backward()
    for i, m in enumerate(members):
        p = {k: v.detach().requires_grad_() for k, v in m.named_parameters()}
        b = dict(m.named_buffers())
        out, _ = tef.functional_call(base, {**p, **b}, ws, inputs, case.kwargs, recipe=recipe)
        case.output(out).square().sum().backward()
        for k in p:
            assert torch.equal(stacked[k].grad[i], p[k].grad) or sqnr(p[k].grad, stacked[k].grad[i]) > 100, (i, k)


@pytest.mark.parametrize("case, recipe", MATRIX)
def test_inference_mode_and_meta_loading_leave_training_bit_identical(case, recipe):
    """Three runs of two training steps with an evaluation between: under no_grad, under
    inference_mode, and under inference_mode by a shell built on the meta device that loaded the
    first run's state with assign=True. Every output, gradient and workspace entry is equal bit
    for bit."""
    s = make_setup(case, recipe)
    plain = tef.Stateful(copy.deepcopy(s.model), recipe)
    evaluated = tef.Stateful(copy.deepcopy(s.model), recipe)
    with torch.device("meta"):
        meta = tef.Stateful(case.make(torch.float32), recipe)
    meta.load_state_dict(copy.deepcopy(plain.state_dict()), assign=True)
    # What from_pretrained does after loading: tie the shared weights again, and make the
    # buffers a state_dict leaves out (the rotary frequencies; here taken from the original).
    if hasattr(meta.model, "tie_weights"):
        meta.model.tie_weights()
    for name, buffer in plain.model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        setattr(meta.model.get_submodule(owner), leaf, buffer.clone())
    batches = [case.inputs(BATCH, torch.float32) for _ in range(2)]
    for step, inputs in enumerate(batches):
        results = []
        for shell, mode in ((plain, torch.no_grad), (evaluated, torch.inference_mode), (meta, torch.inference_mode)):
            shell.model.zero_grad()
            s.loss(shell(*inputs, **s.kwargs), s.target).backward()
            with mode():
                out = case.output(shell(*inputs, **s.kwargs))
            results.append((out.clone(), {k: p.grad for k, p in shell.model.named_parameters()},
                            dict(shell.workspaces)))
        for out, grads, ws in results[1:]:
            assert torch.equal(out, results[0][0]), step
            assert_dicts_equal(grads, results[0][1])
            assert_dicts_equal(ws, results[0][2])


# --- Stateful -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case, recipe", MATRIX)
def test_stateful_backward_equals_grad_and_compiles(case, recipe):
    """Two microbatches through tef.Stateful + .backward() accumulate what tef.grad gives,
    leave the workspaces tef.grad returns, and torch.compile(shell, fullgraph=True) does the same."""
    torch._dynamo.reset()
    s = make_setup(case, recipe)
    micro = [s.inputs, case.inputs(BATCH, torch.float32)]
    targets = [s.target, torch.randn_like(s.target)]
    params, ws = detached_params(s.model), tef.init_workspaces(s.model, recipe)
    want = {k: torch.zeros_like(p) for k, p in params.items()}
    for i, (inp, tgt) in enumerate(zip(micro, targets)):
        g, ws = tef.grad(s.loss_fn)(params, ws, inp, tgt, i == 0)
        want = {k: want[k] + g[k] for k in want}

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    eager_shell = tef.Stateful(copy.deepcopy(s.model), recipe)
    runs = [(eager_shell, eager_shell)]
    rid = next(rid for rid, r in RECIPES if r is recipe)
    if case.slow_recipes is None or rid in case.slow_recipes:
        compiled_shell = tef.Stateful(copy.deepcopy(s.model), recipe)
        runs.append((compiled_shell, torch.compile(compiled_shell, fullgraph=True, backend=counter)))
    for shell, call in runs:
        for i, (inp, tgt) in enumerate(zip(micro, targets)):
            s.loss(call(*inp, is_first_microbatch=i == 0, **s.kwargs), tgt).backward()
        assert_grads_match(case, {k: p.grad for k, p in shell.model.named_parameters()}, want)
        assert_grads_match(case, shell.workspaces, ws)          # grad amaxes come from the gradients
    assert 1 <= counter.frame_count <= 2 or len(runs) == 1


# --- workspaces without the weight cache ---------------------------------------------------------

@pytest.mark.parametrize("case, recipe", MATRIX)
def test_workspaces_without_weight_cache_train_as_the_cached_ones(case, recipe):
    """tef.init_workspaces(..., weight_cache=False) holds every entry but the weight casts; tef.grad,
    a compiled step, per-sample gradients and tef.Stateful on them compute what they compute on the
    cached workspaces (is_first_microbatch None), bit for bit, and hand back no cast; True / False
    are refused."""
    s = make_setup(case, recipe)
    params, spec = detached_params(s.model), tef.workspace_spec(s.model, recipe)
    full, bare = tef.init_workspaces(s.model, recipe), tef.init_workspaces(s.model, recipe, weight_cache=False)
    uncached = lambda ws: {k: v for k, v in ws.items() if spec[k].kind != "cast"}   # noqa: E731
    assert bare.keys() == uncached(full).keys()
    assert_dicts_equal(bare, uncached(full))
    start, steps = bare, []
    for _ in range(2):          # the second step starts from the first's state (DelayedScaling's scales)
        want, full = tef.grad(s.loss_fn)(params, full, s.inputs, s.target)
        got, bare = tef.grad(s.loss_fn)(params, bare, s.inputs, s.target)
        assert_dicts_equal(got, want)
        assert bare.keys() == uncached(full).keys()
        assert_dicts_equal(bare, uncached(full))
        steps.append((got, bare))
    if any(e.kind == "cast" for e in spec.values()):
        for first in (True, False):
            with pytest.raises(ValueError, match="keep none .*weight_cache=False"):
                tef.functional_call(s.model, params, bare, s.inputs, s.kwargs, recipe=recipe,
                                    is_first_microbatch=first)

    want, want_ws = steps[0]      # tef.grad from `start`
    rid = next(rid for rid, r in RECIPES if r is recipe)
    # Compiled on one layer of two GEMMs and on a converted HF model (CI time): what differs from
    # the cached workspaces' compiled steps, run for every row above, is the absent entries alone.
    if case.name in ("LayerNormMLP-gelu", "HF-Llama") and (case.slow_recipes is None or rid in case.slow_recipes):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        got, got_ws = torch.compile(tef.grad(s.loss_fn), fullgraph=True, backend=counter)(params, start, s.inputs,
                                                                                        s.target)
        assert_dicts_equal(got, want)
        assert_dicts_equal(got_ws, want_ws)
        assert counter.frame_count == 1
    if case.name == "LayerNormMLP-gelu":      # per-sample gradients (vmap), samples as the quantization wants
        p = make_setup(case, recipe, **per_sample_shape(case, recipe))
        got, got_ws = p.per_sample_grad()(params, tef.init_workspaces(p.model, recipe, weight_cache=False),
                                          p.inputs, p.target)
        cached, cached_ws = p.per_sample_grad()(params, tef.init_workspaces(p.model, recipe), p.inputs, p.target)
        assert_dicts_equal(got, cached)
        assert_dicts_equal(got_ws, uncached(cached_ws))
    shell = tef.Stateful(copy.deepcopy(s.model), recipe, weight_cache=False)
    s.loss(shell(*s.inputs, **s.kwargs), s.target).backward()
    assert_grads_match(case, {k: p.grad for k, p in shell.model.named_parameters()}, want)
    assert_grads_match(case, shell.workspaces, want_ws)


# --- tef.freeze ---------------------------------------------------------------------------------

def trained_workspaces(s: Setup, params) -> dict:
    """Workspaces after two training steps: DelayedScaling's scales then come from amaxes (not the
    initial 1), and its casts were made with them."""
    ws = tef.init_workspaces(s.model, s.recipe)
    for _ in range(2 if needs_state(s.recipe) else 1):
        _, ws = tef.grad(s.loss_fn)(params, ws, s.inputs, s.target, True)
    return ws


@pytest.mark.parametrize("case, recipe", MATRIX)
def test_frozen_model_equals_cached_forward(case, recipe):
    """tef.freeze(model, recipe, workspaces=ws) computes what the cached-weight forward computes
    (functional_call with is_first_microbatch=False, no_grad), bit for bit, and holds no
    high-precision GEMM weight, no transposed cast and no amax history."""
    s = make_setup(case, recipe)
    gemm_layers = [m for m in s.model.modules() if isinstance(m, tef.nn.TEModule) and m.gemms()]
    if recipe is None or not gemm_layers:
        with pytest.raises(ValueError, match="recipe is None" if recipe is None else "no te_func GEMM layers"):
            tef.freeze(s.model, recipe)
        return
    params = detached_params(s.model)
    ws = trained_workspaces(s, params)
    frozen = tef.freeze(s.model, recipe, workspaces=ws)
    with torch.no_grad():
        want, _ = tef.functional_call(s.model, params, ws, s.inputs, s.kwargs, recipe=recipe,
                                      is_first_microbatch=False)
        got = frozen(*s.inputs, **s.kwargs)
    assert torch.equal(case.output(got), case.output(want))
    # What stays: every tensor of the model but the GEMM weights (biases, norms, embeddings), as it was.
    state, source = frozen.state_dict(), s.model.state_dict()
    gemm_weights = {f"{p}.{m.gemm_param(g.weight)}".lstrip(".") for p, m in s.model.named_modules()
                    if m in gemm_layers for g in m.gemms()}
    assert_dicts_equal({k: state[k] for k in source.keys() - gemm_weights},
                       {k: v for k, v in source.items() if k not in gemm_weights})
    # The rest: per GEMM its forward cast (NVFP4: with its global amax), (DelayedScaling) its input's
    # scale, and each layer's recipe.
    for path, layer in tef.frozen_layers(frozen).items():
        p = f"{path}." if path else ""
        fields = ("data", "scale_inv", "global_amax") if is_fp4(recipe) else ("data", "scale_inv")
        forward_state = {f"{p}{g.weight}_cast.{k}" for g in layer.gemm_specs for k in fields}
        if isinstance(recipe, DelayedScaling):
            forward_state |= {f"{p}{g.prefix}input_scale" for g in layer.gemm_specs}
        assert {k for k in state if k.startswith(p)} - {p + k for k in layer._parameters} \
            == forward_state | {f"{p}te_func_recipe"}
    assert not gemm_weights & state.keys()


@pytest.mark.parametrize("case, recipe", MATRIX)
def test_frozen_weight_only_model_is_the_model_with_its_fp8_weights_decoded(case, recipe):
    """tef.freeze(..., weight_only_tokens=N) with every call within N: each GEMM takes its input
    unquantized and the FP8 weight, so the model computes the high-precision model whose GEMM
    weights are the frozen casts decoded, to the input's precision (fp32 here)."""
    s = make_setup(case, recipe)
    gemm_layers = [m for m in s.model.modules() if isinstance(m, tef.nn.TEModule) and m.gemms()]
    if recipe is None or not gemm_layers:
        return      # nothing to freeze: test_frozen_model_equals_cached_forward checks the error
    ws = trained_workspaces(s, detached_params(s.model))
    frozen = tef.freeze(s.model, recipe, workspaces=ws, weight_only_tokens=2**20)
    decoded = copy.deepcopy(s.model).double()
    with torch.no_grad():
        for path, layer in tef.frozen_layers(frozen).items():
            source = decoded.get_submodule(path)
            for name in {source.gemm_param(g.weight) for g in layer.gemm_specs}:
                # A weight of its own: one tied to an embedding (GPT-2's lm_head) stays the embedding's.
                setattr(source, name, torch.nn.Parameter(source.get_parameter(name).clone()))
            for g in layer.gemm_specs:
                # gemm_weight: the (out, in) view, whatever layout the layer stores.
                source.gemm_weight(g.weight).copy_(dequantize(layer.get_submodule(f"{g.weight}_cast").quantized()))
        got = case.output(frozen(*s.inputs, **s.kwargs))
        want = case.output(decoded(*double(s.inputs), **s.kwargs))
    # fp32 roundings only (>= 130 dB measured on CPU); an FP8 cast of the input would give ~30.
    assert sqnr(want, got.double()) > 100, sqnr(want, got.double())


# --- torch 2.11: te_func's vmap rule for the bit views ----------------------------------------------

_FORCED_RULE = r"""
import sys
import pytest
import torch
from te_func import _compat
from te_func.quant import e8m0_scale_inv, e8m0_to_float, round_down_pow2
calls, inner = [], _compat._view_dtype
_compat._view_dtype = lambda *a: calls.append(1) or inner(*a)
assert _compat.ensure_view_dtype_batching(force=True)
x = torch.randn(3, 4, 5).abs() * 100
for dim in (0, 1, 2):
    for f in (round_down_pow2, lambda t: e8m0_to_float(e8m0_scale_inv(t, 448.0))):
        want = torch.stack([f(s) for s in x.unbind(dim)], dim)
        assert torch.equal(torch.vmap(f, in_dims=dim, out_dims=dim)(x), want), dim
with pytest.raises(RuntimeError, match="one element size"):
    torch.vmap(lambda t: t.view(torch.int16))(x)
rc = pytest.main(["-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning", *sys.argv[1:]])
assert calls, "the rule never ran"
sys.exit(rc)
"""


def test_vmap_takes_the_bit_views_by_te_funcs_rule_where_torch_has_none():
    """torch 2.11 (the GPU machine's) has no vmap rule for Tensor.view(dtype), which MXFP8's E8M0
    scales and Float8BlockScaling's power-of-2 scales read the fp32 bits with; te_func registers
    one there (te_func._compat.ensure_view_dtype_batching). This torch has its own, so a process of its own forces
    te_func's in its place: the bit functions batched in every dim equal a loop, and per-sample
    gradients, a batch scope and an ensemble under both recipes pass (compiled, through the same
    rule: run on torch 2.11 itself, as the README says)."""
    import subprocess
    import sys
    from pathlib import Path
    ids = [f"tests/transforms/test_transforms.py::{name}" for name in (
        "test_vmap_per_sample_grads[Linear-mxfp8]", "test_vmap_per_sample_grads[Linear-block]",
        "test_vmap_ensemble_of_stacked_models[LayerNormMLP-gelu-mxfp8]",
        "test_batch_scope_per_sample_grads_add_up_to_the_batch_gradient[LayerNormLinear-block]")]
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _FORCED_RULE, *ids], cwd=root, capture_output=True, text=True,
                          timeout=600)
    report = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0 and "4 passed" in done.stdout, report
