"""tef.freeze: what a frozen model holds, saves, compiles and exports, and the errors it gives.

The frozen column of the transform matrix (tests/transforms/test_transforms.py) checks every layer x
recipe against the cached-weight forward; this file checks the model-level promises on one
small model holding every kind of GEMM layer.
"""
from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo.testing
from safetensors.torch import load_file, save_file

import te_func as tef
from cases import RECIPES, assert_dicts_equal, detached_params, is_fp4, needs_state, sqnr, tiny_llama, tiny_t5
from te_func.gemm import weight_only_gemm
from te_func.quant import Quantized, dequantize, quantize
from te_func.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling


@pytest.fixture
def torch_path_eagerly(monkeypatch):
    """The eager calls on the torch path where the compiled or exported graph runs it. Only Triton's
    interpreter (TRITON_INTERPRET=1) runs te_func's kernels eagerly on a CPU, whose norms and
    weight-only GEMM sum in their own order: fp32 rounding away from the graph's torch code."""
    previous = tef.kernels.set_cast_kernels(False)
    yield
    tef.kernels.set_cast_kernels(previous)

FP8 = [pytest.param(r, id=rid) for rid, r in RECIPES if r is not None and r.backward_override is None]


def make_model(device=None):
    return torch.nn.Sequential(tef.nn.Linear(64, 128, device=device), torch.nn.GELU(),
                               tef.nn.LayerNormMLP(128, 256, normalization="RMSNorm", activation="swiglu",
                                                   device=device),
                               tef.nn.LayerNormLinear(128, 64, device=device))


def trained(recipe, model=None):
    """A model and its workspaces after two steps (DelayedScaling's scales then come from amaxes)."""
    model = make_model() if model is None else model
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)

    def loss_fn(p, w, x):
        out, new_w = tef.functional_call(model, p, w, (x,), recipe=recipe, is_first_microbatch=True)
        return out.square().sum(), new_w
    for _ in range(2):
        _, ws = tef.grad(loss_fn)(params, ws, torch.randn(4, 8, 64))
    return model, ws


def cached_forward(model, ws, recipe, x):
    with torch.no_grad():
        return tef.functional_call(model, detached_params(model), ws, (x,), recipe=recipe,
                                   is_first_microbatch=False)[0]


# --- what it holds ------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", FP8)
def test_frozen_gemm_weights_take_half_of_bf16s_bytes(recipe):
    """The GEMM weights' resident bytes (casts, their scales, DelayedScaling's input scales)
    against the same weights in bf16: <= 0.53x (tensor-wise: 1 byte + one scale; MXFP8:
    1 + 1/32 bytes per value; 128x128 blocks: 1 + 4/16384)."""
    model = make_model()
    frozen = tef.freeze(model, recipe, workspaces=tef.init_workspaces(model, recipe))
    bf16 = sum(2 * m.gemm_weight(g.weight).numel() for m in model.modules()
               if isinstance(m, tef.nn.TEModule) for g in m.gemms())
    held = sum(t.numel() * t.element_size() for layer in tef.frozen_layers(frozen).values()
               for name, t in layer.state_dict().items() if name not in layer._parameters and name != "te_func_recipe")
    assert held <= 0.53 * bf16, held / bf16
    if isinstance(recipe, MXFP8BlockScaling):
        assert held == bf16 // 2 * (1 + 1 / 32)


def test_a_frozen_layer_shows_its_weights_shape_and_dtype_and_holds_none_of_it():
    """Model code reads a Linear's weight for its dtype (transformers' T5 casts the feed-forward's
    input to `wo.weight.dtype`): a frozen layer answers with a tensor on meta, which holds nothing,
    so any computation with it fails instead of reading a stale copy."""
    model = make_model()
    model[0].float()
    frozen = tef.freeze(model, Float8CurrentScaling())
    weight = frozen[0].weight
    assert weight.device.type == "meta" and weight.shape == (128, 64) and weight.dtype == torch.float32
    assert frozen[2].fc1_weight.shape == (512, 128) and frozen[2].fc2_weight.shape == (128, 256)
    assert "0.weight" not in frozen.state_dict() and not any(n.endswith("weight") and "norm" not in n
                                                             for n, _ in frozen.named_parameters())
    with pytest.raises(NotImplementedError):
        torch.randn(2, 64) @ frozen[0].weight.t().cpu()
    with pytest.raises(KeyError, match="'weight' already exists"):        # no unused Parameter slips in
        frozen[0].weight = torch.nn.Parameter(torch.randn(128, 64))


def test_frozen_model_is_a_copy_and_leaves_the_model_alone():
    recipe = Float8CurrentScaling()
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    frozen = tef.freeze(model, recipe)
    assert_dicts_equal(model.state_dict(), before)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert frozen[2].layer_norm_weight.data_ptr() != model[2].layer_norm_weight.data_ptr()
    x = torch.randn(3, 64)
    assert torch.equal(frozen(x), cached_forward(model, tef.init_workspaces(model, recipe), recipe, x))


def test_a_weight_tied_to_an_embedding_stays_for_the_embedding():
    """GPT-2's lm_head shares the token embedding's weight: the embedding keeps it, lm_head
    gets its cast."""
    from cases import tiny_gpt2
    model = tef.convert(tiny_gpt2(layers=1))
    frozen = tef.freeze(model, Float8CurrentScaling())
    assert frozen.transformer.wte.weight is not None and "lm_head.weight_cast.data" in frozen.state_dict()
    ids = torch.randint(0, 128, (2, 8))
    want = cached_forward(model, tef.init_workspaces(model, Float8CurrentScaling()), Float8CurrentScaling(), ids)
    with torch.no_grad():
        assert torch.equal(frozen(ids).logits, want.logits)


def test_a_frozen_hf_gpt2_compiles_whole_with_its_norms_outside_any_frame(monkeypatch):
    """A frozen model's norms are te_func LayerNorms called outside any frame, which look for an
    activation checkpoint's recompute by autograd's task id; torch 2.11's dynamo cannot trace that
    call (fullgraph then fails on the GPU machine's torch). Traced, nothing is looked up: here the
    task id raises if dynamo reaches it, as 2.11 would."""
    from cases import tiny_gpt2
    task_id = torch._C._current_graph_task_id

    def untraceable():
        if torch.compiler.is_compiling():
            raise AssertionError("autograd's task id read while tracing")
        return task_id()
    monkeypatch.setattr(torch._C, "_current_graph_task_id", untraceable)
    torch._dynamo.reset()
    model = tef.convert(tiny_gpt2(layers=1)).eval()
    assert any(isinstance(m, tef.nn.LayerNorm) for m in model.modules())
    frozen = tef.freeze(model, Float8CurrentScaling())
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        got = torch.compile(frozen, fullgraph=True, backend="eager")(ids).logits
        assert torch.equal(got, frozen(ids).logits)


# --- saving, loading, building without the weights ------------------------------------------------

@pytest.mark.parametrize("recipe", FP8)
def test_frozen_state_dict_round_trips_through_torch_save_and_safetensors(recipe, tmp_path):
    model, ws = trained(recipe)
    frozen = tef.freeze(model, recipe, workspaces=ws)
    x = torch.randn(2, 8, 64)
    want = frozen(x)
    torch.save(frozen.state_dict(), tmp_path / "frozen.pt")
    save_file(frozen.state_dict(), tmp_path / "frozen.safetensors")    # refuses shared storage
    for sd in (torch.load(tmp_path / "frozen.pt"), load_file(tmp_path / "frozen.safetensors")):
        other, other_ws = make_model(), None             # other weights: everything must come from sd
        if needs_state(recipe):
            other_ws = tef.init_workspaces(other, recipe)
        fresh = tef.freeze(other, recipe, workspaces=other_ws)
        fresh.load_state_dict(sd)
        assert torch.equal(fresh(x), want)


@pytest.mark.parametrize("recipe", FP8)
def test_a_pickled_frozen_model_loads_where_its_configs_were_never_made(recipe, tmp_path, monkeypatch):
    """torch.save of the whole module: unpickled in a process whose table of frozen configs is
    empty (here: emptied), its layers bring their configs back and compute what they did."""
    from te_func.nn import frozen as frozen_module
    model, ws = trained(recipe)
    frozen = tef.freeze(model, recipe, workspaces=ws)
    x = torch.randn(2, 8, 64)
    want = frozen(x)
    torch.save(frozen, tmp_path / "frozen.pt")
    monkeypatch.setattr(frozen_module, "_CONFIGS", {})
    loaded = torch.load(tmp_path / "frozen.pt", weights_only=False)
    assert torch.equal(loaded(x), want)


def test_a_format2_frozen_checkpoint_loads():
    """Workspace format 2 kept MXFP8's scales as float8_e8m0fnu: such a frozen checkpoint loads
    (its scale bytes as they were) and computes what it did."""
    recipe = MXFP8BlockScaling()
    model, ws = trained(recipe)
    frozen = tef.freeze(model, recipe, workspaces=ws)
    old = {k: v.view(torch.float8_e8m0fnu) if v.dtype == torch.uint8 else v.clone()
           for k, v in frozen.state_dict().items()}
    for k in old:
        if k.endswith("te_func_recipe"):
            old[k][0] = 2
    fresh = tef.freeze(make_model(), recipe)
    fresh.load_state_dict(old)
    x = torch.randn(2, 8, 64)
    assert torch.equal(fresh(x), frozen(x))


def test_frozen_delayed_model_computes_no_reciprocal_per_call():
    """Under DelayedScaling the input scales are constants of a frozen model: their reciprocals (the
    casts' decode factors) are buffers made at freezing and on each load, outside the state_dict,
    so a compiled call has no reciprocal op (one kernel launch per GEMM at decode sizes)."""
    recipe = DelayedScaling()
    model, ws = trained(recipe)
    frozen = tef.freeze(model, recipe, workspaces=ws)
    x = torch.randn(2, 8, 64)
    backend = torch._dynamo.testing.AotEagerAndRecordGraphs()
    with torch.no_grad():
        compiled = torch.compile(frozen, fullgraph=True, backend=backend)
        assert torch.equal(compiled(x), cached_forward(model, ws, recipe, x))
    ops = [n.target for g in backend.fw_graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.mm.default in ops or any("scaled_mm" in str(op) for op in ops)
    assert not any("reciprocal" in str(op) for op in ops)
    assert not any(k.endswith("input_scale_inv") for k in frozen.state_dict())
    # Loading other scales (a checkpoint of another training step) makes their reciprocals anew.
    model2, ws2 = trained(recipe, copy.deepcopy(model))
    other = tef.freeze(model2, recipe, workspaces=ws2)
    scales = [k for k in frozen.state_dict() if k.endswith("input_scale")]
    assert scales and any(not torch.equal(frozen.state_dict()[k], other.state_dict()[k]) for k in scales)
    for loaded in (frozen, copy.deepcopy(frozen)):      # a copy keeps the load hook
        loaded.load_state_dict(other.state_dict())
        for name, buf in loaded.named_buffers():
            if name.endswith("input_scale_inv"):
                assert torch.equal(buf, torch.reciprocal(loaded.get_buffer(name.removesuffix("_inv"))))
        with torch.no_grad():
            assert torch.equal(loaded(x), other(x))


@pytest.mark.parametrize("recipe", FP8)
def test_frozen_skeleton_on_meta_loads_a_checkpoint_with_assign(recipe, tmp_path):
    """No high-precision weight is ever made: a model built on meta freezes to a skeleton on meta,
    and a frozen checkpoint fills it."""
    model, ws = trained(recipe)
    frozen = tef.freeze(model, recipe, workspaces=ws)
    save_file(frozen.state_dict(), tmp_path / "frozen.safetensors")
    with torch.device("meta"):
        skeleton = tef.freeze(make_model(), recipe)
    assert all(t.device.type == "meta" for t in skeleton.state_dict().values())
    skeleton.load_state_dict(load_file(tmp_path / "frozen.safetensors"), assign=True)
    x = torch.randn(2, 8, 64)
    assert torch.equal(skeleton(x), cached_forward(model, ws, recipe, x))


def test_freeze_to_a_device_moves_only_the_casts():
    """device=: the copy is made without the GEMM weights and only FP8 casts (and the small
    non-GEMM tensors) reach the device; here the device is meta, so nothing is computed there."""
    recipe = Float8CurrentScaling()
    model = make_model()
    frozen = tef.freeze(model, recipe, device="meta")
    state = frozen.state_dict()
    assert all(t.device.type == "meta" for t in state.values())
    casts = {k: t for k, t in state.items() if k.endswith("_cast.data")}
    assert len(casts) == 4 and all(t.dtype == torch.float8_e4m3fn for t in casts.values())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_checkpoint_of_another_recipe_or_shape_is_refused():
    model = make_model()
    current = tef.freeze(model, Float8CurrentScaling()).state_dict()
    other_recipe = tef.freeze(model, MXFP8BlockScaling())
    with pytest.raises(tef.errors.RecipeMismatchError, match="made for another recipe"):
        other_recipe.load_state_dict(current)
    with pytest.raises(tef.errors.RecipeMismatchError, match="made for another recipe"):
        tef.freeze(model, Float8CurrentScaling(use_power_2_scales=True)).load_state_dict(current)
    narrow = tef.freeze(torch.nn.Sequential(tef.nn.Linear(64, 96)), Float8CurrentScaling())
    with pytest.raises(tef.errors.EntryMismatchError, match=r"'0.bias' has shape \(128,\).*another model"):
        narrow.load_state_dict({k: v for k, v in current.items() if k.startswith("0.")})
    with pytest.raises(tef.errors.MissingEntryError, match="not a frozen te_func checkpoint"):
        other_recipe.load_state_dict({k: v for k, v in current.items() if not k.endswith("te_func_recipe")})


# --- torch.compile and torch.export -------------------------------------------------------------------

# The tensor-wise recipes (CI time: dynamo takes ~30 s per block-scaled model on 2 cores); every
# recipe traces whole in the export test below.
@pytest.mark.parametrize("recipe", [p for p in FP8 if p.id in ("current", "delayed")])
def test_compiled_frozen_model_equals_eager_without_a_compile_per_size(recipe, torch_path_eagerly):
    """fullgraph=True, no graph break; three token counts, at most two compilations (the second
    makes the token dim dynamic); compiled equals eager bit for bit. aot_eager here: CPU
    inductor has no C++ type for MXFP8's E8M0 scales (the current-scaling inductor run is below)."""
    torch._dynamo.reset()
    model, ws = trained(recipe)
    frozen = tef.freeze(model, recipe, workspaces=ws)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(frozen, fullgraph=True, backend=counter)
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = torch.randn(batch, 8, 64)
            assert torch.equal(compiled(x), frozen(x))
    assert 1 <= counter.frame_count <= 2


@pytest.mark.parametrize("recipe", [p for p in FP8 if p.id in ("current", "delayed")])
def test_a_compiled_frozen_call_looks_up_no_missing_attribute(recipe, monkeypatch):
    """Dynamo re-checks before every call what the traced code read; an attribute the code asked
    for and did not find is re-checked by nn.Module.__getattr__ raising AttributeError, in Python,
    per layer and per call (a decode step's host time). A compiled frozen call makes none."""
    torch._dynamo.reset()
    model, ws = trained(recipe)
    frozen = tef.freeze(model, recipe, workspaces=ws)
    compiled = torch.compile(frozen, fullgraph=True, backend="eager")
    x = torch.randn(2, 8, 64)
    lookups, module_getattr = [], torch.nn.Module.__getattr__

    def counting(self, name):
        lookups.append(name)
        return module_getattr(self, name)
    with torch.no_grad():
        want = compiled(x)
        monkeypatch.setattr(torch.nn.Module, "__getattr__", counting)
        got = compiled(x)
    assert torch.equal(got, want)
    assert lookups == []


@pytest.mark.parametrize("recipe", FP8)
def test_compiled_calls_build_no_frozen_dataclass_from_its_defaults(recipe, monkeypatch):
    """Where torch.compile (2.11) traces a frozen dataclass built with a field left to its default,
    the compiled code checks that default again before every call, in Python (on the H200's host,
    giving every field halved two frozen blocks' guard check: docs/benchmarks.md, "Decode under
    reduce-overhead: where the time goes"). Every one te_func builds in a compiled frozen call
    or training step is given all its fields. Recorded while dynamo traces: on a torch that no
    longer guards defaults (2.13) the construction is the same, so this checks te_func's code."""
    user_defined = pytest.importorskip("torch._dynamo.variables.user_defined")
    traced = getattr(user_defined, "UserDefinedClassVariable", None)
    if traced is None or not hasattr(traced, "call_function"):
        pytest.skip("this torch's dynamo traces classes elsewhere")
    defaulted, call_function = [], traced.call_function

    def recording(self, tx, args, kwargs):
        cls = self.value
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen:
            fields = [f.name for f in dataclasses.fields(cls) if f.init]
            if len(args) + len(kwargs) < len(fields):
                at = tx.frame_summary()
                defaulted.append(f"{cls.__name__}({len(args) + len(kwargs)} of {fields}) at {at.filename}:{at.lineno}")
        return call_function(self, tx, args, kwargs)
    monkeypatch.setattr(traced, "call_function", recording)

    torch._dynamo.reset()
    model, ws = trained(recipe)
    params, x = detached_params(model), torch.randn(2, 8, 64)

    def loss_fn(p, w, x):
        out, new_w = tef.functional_call(model, p, w, (x,), recipe=recipe, is_first_microbatch=False)
        return out.square().sum(), new_w
    torch.compile(tef.grad(loss_fn), fullgraph=True, backend="eager")(params, ws, x)
    with torch.no_grad():
        torch.compile(tef.freeze(model, recipe, workspaces=ws), fullgraph=True, backend="eager")(x)
        llama = tef.convert(tiny_llama(layers=1)).eval()             # a converted HF model, frozen
        hf = tef.freeze(llama, recipe, workspaces=tef.init_workspaces(llama, recipe))
        torch.compile(hf, fullgraph=True, backend="eager")(torch.randint(0, 128, (1, 5)), use_cache=False)
    assert sorted(set(defaulted)) == []     # each place once


@pytest.mark.slow
def test_frozen_model_compiles_with_inductor():
    """The default backend: fullgraph, at most two graphs for three sizes. Inductor's generated
    C++ (vectorized, fused bias and activation) rounds fp32 differently from eager, so equal
    within fp32 rounding (measured 6e-7 max abs); aot_eager above is bit for bit."""
    torch._dynamo.reset()
    recipe = Float8CurrentScaling()
    model = make_model()
    frozen = tef.freeze(model, recipe)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(frozen[:2], fullgraph=True, backend=counter)
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = torch.randn(batch, 8, 64)
            assert torch.allclose(compiled(x), frozen[:2](x), rtol=1e-5, atol=1e-6)
    assert counter.frame_count <= 2


@pytest.mark.parametrize("recipe", FP8)
def test_frozen_model_exports_with_a_dynamic_batch(recipe, torch_path_eagerly):
    model = torch.nn.Sequential(tef.nn.Linear(64, 128), tef.nn.LayerNormMLP(128, 256))   # CI time: two layers
    ws = trained(recipe, model)[1] if needs_state(recipe) else None
    frozen = tef.freeze(model, recipe, workspaces=ws)
    batch = torch.export.Dim("batch", max=4096)
    exported = torch.export.export(frozen, (torch.randn(4, 8, 64),), dynamic_shapes=({0: batch},))
    with torch.no_grad():
        for n in (1, 6):
            x = torch.randn(n, 8, 64)
            assert torch.equal(exported.module()(x), frozen(x))


_LOAD_AND_RUN = textwrap.dedent("""
    import sys, torch
    import torch._inductor
    runner = torch._inductor.aoti_load_package(sys.argv[1])
    torch.save(runner(torch.load(sys.argv[2])), sys.argv[3])
""")


def _have_compiler() -> bool:
    from torch._inductor.cpp_builder import get_cpp_compiler
    try:
        get_cpp_compiler()
        return True
    except Exception:
        return False


@pytest.mark.slow
def test_aoti_package_loads_in_a_fresh_process_and_matches_eager(tmp_path):
    """AOTInductor on CPU for one recipe (a C++ build: slow on 2 cores); every recipe exports above."""
    if not _have_compiler():
        pytest.skip("AOTInductor needs a C++ compiler on the PATH; none was found")
    recipe = Float8CurrentScaling()
    model = torch.nn.Sequential(tef.nn.Linear(64, 32))
    frozen = tef.freeze(model, recipe)
    x = torch.randn(4, 8, 64)
    exported = torch.export.export(frozen, (x,), dynamic_shapes=({0: torch.export.Dim("batch", max=4096)},))
    package = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "frozen.pt2"))
    x = torch.randn(3, 8, 64)
    torch.save(x, tmp_path / "x.pt")
    subprocess.run([sys.executable, "-c", _LOAD_AND_RUN, package, str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
                   check=True, timeout=300)
    with torch.no_grad():
        want = frozen(x)
    got = torch.load(tmp_path / "out.pt")
    assert got.shape == want.shape and torch.equal(got, want)


# --- weight-only FP8 for few tokens --------------------------------------------------------------------

# The FP8 weight dequantized to bf16 against float64 on 64x128 -> 256 (swiglu) -> 128: measured
# (torch 2.13 CPU, 10 seeds) min ~26 dB weight-only vs ~24 dB FP8 x FP8 (current scaling).
# NVFP4's weights have 3-bit E2M1 mantissas: 11.8 dB on this test's seed.
WEIGHT_ONLY_MIN_DB = 22.0
WEIGHT_ONLY_MIN_DB_FP4 = 10.0


@pytest.mark.parametrize("recipe", FP8)
def test_weight_only_fp8_below_the_token_threshold(recipe):
    """weight_only_tokens=16: calls of <= 16 tokens leave the input unquantized and multiply it by
    the FP8 weight; larger calls run FP8 x FP8, as the model without the option."""
    model, ws = trained(recipe)
    frozen = tef.freeze(model, recipe, workspaces=ws)
    small = tef.freeze(model, recipe, workspaces=ws, weight_only_tokens=16)
    reference = make_model().double()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        x = torch.randn(2, 8, 64)                       # 16 tokens: weight-only
        got = small(x)
        assert not torch.equal(got, frozen(x))
        # What it computes: the same layers with the FP8 weights, decoded, in high precision.
        want = reference(x.double())
        assert sqnr(want, got) >= (WEIGHT_ONLY_MIN_DB_FP4 if is_fp4(recipe) else WEIGHT_ONLY_MIN_DB), sqnr(want, got)
        big = torch.randn(3, 8, 64)                     # 24 tokens: FP8 x FP8
        assert torch.equal(small(big), frozen(big))
    with pytest.raises(ValueError, match="weight_only_tokens"):
        tef.freeze(model, recipe, workspaces=ws, weight_only_tokens=-1)


@pytest.mark.parametrize("recipe", [p for p in FP8 if p.id in ("current", "delayed")])
def test_weight_only_model_compiles_whole_and_exports(recipe, torch_path_eagerly):
    """The tensor-wise recipes' weight-only GEMM is one op (te_func::weight_only_mm, the Triton
    kernel on FP8 GPUs): dynamo takes it whole, torch.export keeps it, both equal eager. With
    weight_only_tokens=1 (decoding) one-token calls have a graph of their own and the other
    sizes share one, without a compilation per size."""
    torch._dynamo.reset()
    model, ws = trained(recipe)
    small = tef.freeze(model, recipe, workspaces=ws, weight_only_tokens=1)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(small, fullgraph=True, backend=counter)
    with torch.no_grad():
        for tokens in (1, 2, 3, 5, 1, 9):
            x = torch.randn(tokens, 64)
            assert torch.equal(compiled(x), small(x))
    # 1 token (weight-only), then every other size in one graph (dynamic)
    assert counter.frame_count == 2
    x = torch.randn(1, 64)
    exported = torch.export.export(small, (x,))
    assert "te_func.weight_only_mm" in str(exported.graph)
    with torch.no_grad():
        assert torch.equal(exported.module()(x), small(x))


def test_weight_only_gemm_under_vmap_is_the_gemm_of_the_stacked_tokens():
    w, _ = quantize(torch.randn(32, 48), Float8CurrentScaling(), "weight")
    xs = torch.randn(5, 7, 48, dtype=torch.bfloat16)
    got = torch.func.vmap(weight_only_gemm, in_dims=(0, None))(xs, w)
    assert torch.equal(got, weight_only_gemm(xs.reshape(35, 48), w).reshape(5, 7, 32))
    ws = torch.stack([w.data, w.data])       # weights batched too: one GEMM per sample
    got = torch.func.vmap(lambda x, d: weight_only_gemm(x, Quantized(d, w.scale_inv)))(xs[:2], ws)
    assert torch.equal(got, weight_only_gemm(xs[:2].reshape(14, 48), w).reshape(2, 7, 32))
    bias = torch.randn(32, dtype=torch.bfloat16)
    got = torch.func.vmap(weight_only_gemm, in_dims=(0, None, None))(xs, w, bias)   # a shared bias
    assert torch.equal(got, weight_only_gemm(xs.reshape(35, 48), w, bias).reshape(5, 7, 32))
    biases = torch.randn(2, 32, dtype=torch.bfloat16)       # a bias per sample: one GEMM per sample
    got = torch.func.vmap(weight_only_gemm, in_dims=(0, None, 0))(xs[:2], w, biases)
    assert torch.equal(got, torch.stack([weight_only_gemm(xs[i], w, biases[i]) for i in range(2)]))
    # The bias goes in before the one rounding, as te_func.gemm.gemm adds it.
    assert torch.equal(weight_only_gemm(xs[0], w, bias),
                       ((xs[0].float() @ w.data.float().t()) * w.scale_inv + bias.float()).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"one value per output column: expected shape \(32,\)"):
        weight_only_gemm(xs[0], w, bias[:1])


# --- bad input ------------------------------------------------------------------------------------------

def test_freeze_errors():
    recipe = Float8CurrentScaling()
    with pytest.raises(ValueError, match="no te_func GEMM layers.*tef.convert"):
        tef.freeze(torch.nn.Sequential(torch.nn.Linear(64, 64)), recipe)
    model = make_model()
    frozen = tef.freeze(model, recipe)
    with pytest.raises(ValueError, match="frozen already"):
        tef.freeze(frozen, recipe)
    with pytest.raises(ValueError, match="scales live in the workspaces"):
        tef.freeze(model, DelayedScaling())
    with pytest.raises(tef.errors.RecipeMismatchError, match="made for another recipe"):
        tef.freeze(model, recipe, workspaces=tef.init_workspaces(model, MXFP8BlockScaling()))
    x = torch.randn(2, 64, requires_grad=True)
    with pytest.raises(tef.errors.FrozenModelError, match="for inference only"):
        frozen(x)
    with torch.no_grad():
        frozen(x)                                       # fine without autograd
    broken = make_model()
    with torch.no_grad():
        broken[2].fc2_weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"2.fc2_weight holds 1 non-finite"):
        tef.freeze(broken, recipe)


# --- a real model: HF Llama, generate() with a KV cache -------------------------------------------------

def _greedy(step, ids, new_tokens):
    """Greedy decoding with a KV cache: `step(ids, cache) -> logits`, one prefill then one token a call."""
    from transformers import DynamicCache
    cache, logits, out = DynamicCache(), [], ids
    nxt = ids
    for _ in range(new_tokens):
        last = step(nxt, cache)[:, -1]
        logits.append(last)
        nxt = last.argmax(-1, keepdim=True)
        out = torch.cat([out, nxt], dim=1)
    return out, logits


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_frozen_hf_llama_generates_what_the_converted_model_does(recipe):
    model = tef.convert(tiny_llama(layers=2)).eval()
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)
    ids = torch.randint(0, 128, (2, 5))
    frozen = tef.freeze(model, recipe, workspaces=ws)

    def cached(x, cache):
        out, _ = tef.functional_call(model, params, ws, (x,), {"past_key_values": cache, "use_cache": True},
                                     recipe=recipe, is_first_microbatch=False)
        return out.logits

    with torch.no_grad():
        want, want_logits = _greedy(cached, ids, 6)
        got, got_logits = _greedy(lambda x, cache: frozen(x, past_key_values=cache, use_cache=True).logits, ids, 6)
        generated = frozen.generate(ids, max_new_tokens=6, do_sample=False)
    assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    assert torch.equal(got, want) and torch.equal(generated, want)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_frozen_hf_llama_generates_through_transformers_compiled_decode(recipe):
    """transformers' own compiled decoding (static cache, its auto-compile, as examples/generate.py
    --compile runs it on a GPU): every one-token step is one fullgraph dynamo graph, the same for
    every position, and the tokens are the uncompiled model's. The backend runs dynamo's graph as
    traced (inductor's code is checked by the compile tests above), so this stays quick."""
    from transformers import CompileConfig
    model = tef.convert(tiny_llama(layers=2)).eval()
    frozen = tef.freeze(model, recipe, workspaces=tef.init_workspaces(model, recipe))
    graphs = []

    def backend(gm, example_inputs, **options):
        graphs.append(gm)
        return gm.forward

    config = CompileConfig(fullgraph=True, backend=backend)
    config._compile_all_devices = True           # transformers compiles on accelerators only, unless told
    ids = torch.randint(0, 128, (2, 5))
    torch._dynamo.reset()
    with torch.no_grad():
        want = frozen.generate(ids, max_new_tokens=6, do_sample=False)
        got = frozen.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                              compile_config=config)
    assert torch.equal(got, want)
    assert len(graphs) == 1


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_a_frozen_hf_t5_casts_where_the_trained_one_did_and_generates(recipe):
    """T5's feed-forward casts its input to `wo.weight.dtype` before `wo`, which `from_pretrained`
    keeps in float32 in a bf16 model: the frozen model reads the trained weight's dtype and gives
    the cached-weight forward's logits, bit for bit."""
    model = tiny_t5(torch.bfloat16).eval()
    for block in (*model.encoder.block, *model.decoder.block):
        block.layer[-1].DenseReluDense.wo.float()
    model = tef.convert(model)
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)
    ids, decoder_ids = torch.randint(2, 128, (2, 12)), torch.randint(2, 128, (2, 6))
    inputs = {"input_ids": ids, "decoder_input_ids": decoder_ids}
    with torch.no_grad():
        _, ws = tef.functional_call(model, params, ws, (), inputs, recipe=recipe, is_first_microbatch=True)
        want = tef.functional_call(model, params, ws, (), inputs, recipe=recipe, is_first_microbatch=False)[0]
        frozen = tef.freeze(model, recipe, workspaces=ws)
        got = frozen(**inputs)
        generated = frozen.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert frozen.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    assert got.logits.dtype == want.logits.dtype and torch.equal(got.logits, want.logits)
    assert generated.shape[0] == 1 and 2 <= generated.shape[1] <= 5


def test_frozen_hf_llama_decodes_one_token_calls_weight_only():
    """weight_only_tokens=1, as docs/inference.md advises for decoding: the prompt's call runs
    FP8 x FP8 (the logits of the model without the option), every one-token step weight-only
    FP8, whose logits follow the float64 model with the FP8 weights decoded."""
    recipe = Float8CurrentScaling()
    model = tef.convert(tiny_llama(dtype=torch.bfloat16, layers=2)).eval()
    frozen = tef.freeze(model, recipe)
    decoder = tef.freeze(model, recipe, weight_only_tokens=1)
    reference = copy.deepcopy(model).double()
    for path, layer in tef.frozen_layers(frozen).items():   # the reference's weights: the FP8 casts, decoded
        for g in layer.gemm_specs:
            weight = reference.get_submodule(path).get_parameter(g.weight)
            weight.data = dequantize(layer.get_submodule(f"{g.weight}_cast").quantized()).double()
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        got, got_logits = _greedy(lambda x, cache: decoder(x, past_key_values=cache, use_cache=True).logits, ids, 4)
        fp8, fp8_logits = _greedy(lambda x, cache: frozen(x, past_key_values=cache, use_cache=True).logits, ids, 4)
        assert torch.equal(got_logits[0], fp8_logits[0])               # the 5-token prompt: FP8 x FP8
        decoded = torch.stack(got_logits[1:], dim=1).double()         # the three one-token steps
        exact = reference(got[:, :-1]).logits[:, -3:]
        # Measured (torch 2.13 CPU, 4 seeds): 33-37 dB weight-only, 27-30 dB FP8 x FP8 (whose input is
        # quantized too); the bf16 model's own roundings bound both.
        assert sqnr(exact, decoded) > 30, sqnr(exact, decoded)
        assert sqnr(exact, decoded) > sqnr(reference(fp8[:, :-1]).logits[:, -3:],
                                            torch.stack(fp8_logits[1:], dim=1).double())
        assert decoder.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 9)
