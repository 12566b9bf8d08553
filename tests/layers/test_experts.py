"""te_func.nn.Experts and tef.convert on transformers' experts (tiny Mixtral and Qwen3-MoE, no download).

The transform matrix (tests/transforms/test_transforms.py, row "Experts") runs the layer through every
transform; here: its math against a loop of GEMMs and against float64, the routing's edge cases
(idle experts, every token to one expert, routing that changes under torch.compile), and converted
models: recipe None the original bit for bit, FP8 within FP8 tolerance, checkpoints, what stays."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch._dynamo.testing

import te_func as tef
from cases import VOCAB, detached_params, sqnr
from te_func.errors import TransformError
from te_func.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

T = pytest.importorskip("transformers")

E, H, INTER, K = 4, 64, 48, 2
RECIPES = [pytest.param(Float8CurrentScaling(), id="current"), pytest.param(DelayedScaling(amax_history_len=4),
                                                                            id="delayed"),
           pytest.param(MXFP8BlockScaling(), id="mxfp8")]


def _routing(tokens: int, experts=(0, 1, 2)):
    # Each token's top-2 among `experts` (the others idle) and its weights.
    pool = torch.tensor(experts)
    index = torch.stack([pool[torch.randperm(len(pool))[:K]] for _ in range(tokens)])
    return index, torch.softmax(torch.randn(tokens, K), -1)


def _leaves(module):
    return {k: v.requires_grad_() for k, v in detached_params(module).items()}


def _loop_reference(layer, params, x, index, weights, recipe, ws):
    """The same experts as one te_func grouped_linear per projection over the groups' sizes as a list
    (one GEMM per expert, the path GroupedLinear runs for m_splits lists), combined by hand."""
    ids = index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    sizes = torch.bincount(ids, minlength=E).tolist()
    run = dict(recipe=recipe, workspace=ws, is_first_microbatch=None)
    up, _ = tef.functional.grouped_linear(x[order // K], sizes, list(params["gate_up_proj"].unbind(0)),
                                          gemms=layer.gemms()[:E], **run)
    gate, lin = up.chunk(2, -1)
    y, _ = tef.functional.grouped_linear(torch.nn.functional.silu(gate) * lin, sizes,
                                         list(params["down_proj"].unbind(0)), gemms=layer.gemms()[E:], **run)
    per_pair = torch.empty_like(y).index_copy(0, order, y).view(-1, K, H)
    return sum(weights[:, j, None] * per_pair[:, j] for j in range(K))


@pytest.mark.parametrize("recipe", RECIPES)
def test_experts_equal_one_gemm_per_expert_and_float64(recipe):
    torch.manual_seed(0)
    layer = tef.nn.Experts(E, H, INTER)
    x = torch.randn(24, H, requires_grad=True)
    index, weights = _routing(24)
    ws = tef.init_workspaces(layer, recipe)
    params = _leaves(layer)
    out, _ = tef.functional_call(layer, params, ws, (x, index, weights), recipe=recipe)
    grads = torch.autograd.grad(out.square().sum(), [x, *params.values()])

    ref_params = _leaves(layer)
    want = _loop_reference(layer, ref_params, x, index, weights, recipe, ws)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *ref_params.values()])
    assert torch.equal(out, want)
    for g, w in zip(grads, want_grads):
        # the device-counts path sums nothing differently on CPU: one GEMM per expert, as the loop
        assert torch.equal(g, w)

    # Against float64: the experts' MLPs computed directly, token by token.
    x64, w64 = x.detach().double(), {k: v.detach().double() for k, v in params.items()}
    exact = torch.zeros(24, H, dtype=torch.float64)
    for t in range(24):
        for j in range(K):
            e = index[t, j]
            gate, lin = (w64["gate_up_proj"][e] @ x64[t]).chunk(2)
            exact[t] += weights[t, j].double() * (w64["down_proj"][e] @ (torch.nn.functional.silu(gate) * lin))
    # two FP8 GEMMs with SwiGLU between: 22.1-23.4 dB measured (LayerNormMLP-swiglu's 23.2)
    assert sqnr(exact, out.detach().double()) > 20


def test_idle_experts_and_every_token_to_one_expert_under_delayed_scaling():
    """Experts that get no token record an amax of 0 and get zero gradients, as TE's idle GEMMs; one
    expert taking every token is one group holding all rows."""
    torch.manual_seed(1)
    recipe = DelayedScaling(amax_history_len=4)
    layer = tef.nn.Experts(E, H, INTER)
    shell = tef.Stateful(layer, recipe)
    x = torch.randn(16, H)
    index = torch.stack([torch.tensor([1, 3])] * 16)        # tokens to experts 1 and 3 only
    weights = torch.softmax(torch.randn(16, K), -1)
    for _ in range(2):
        shell.zero_grad()
        out = shell(x, index, weights)
        out.square().sum().backward()
    assert torch.isfinite(out).all()
    ws = shell.workspaces
    for e in range(E):
        for proj in ("gate_up_proj", "down_proj"):
            hist = ws[f"{proj}{e}_input_amax_history"]
            assert (hist.abs().sum() > 0) == (e in (1, 3)), (proj, e, hist)
    for proj in ("gate_up_proj", "down_proj"):
        g = getattr(layer, proj).grad
        for e in range(E):
            assert (g[e].abs().sum() > 0) == (e in (1, 3)), (proj, e)

    # Every token to one expert, both of its slots (top-k may pick one expert twice nowhere, but
    # the layer takes it): one group of 32 rows.
    index = torch.zeros(16, K, dtype=torch.long)
    out = shell(x, index, weights)
    assert torch.isfinite(out).all() and out.abs().sum() > 0


def test_routing_that_changes_every_step_compiles_once():
    """Compiled fullgraph under current scaling, the counts stay on the device: new routings (an
    idle expert, then another) reuse the one graph, and compiled equals eager bit for bit."""
    torch.manual_seed(2)
    recipe = Float8CurrentScaling()
    layer = tef.nn.Experts(E, H, INTER)
    ws = tef.init_workspaces(layer, recipe)
    params = detached_params(layer)

    def step(params, ws, x, index, weights):
        def loss_fn(params, ws):
            out, new_ws = tef.functional_call(layer, params, ws, (x, index, weights), recipe=recipe)
            return out.square().sum(), new_ws
        return tef.grad(loss_fn)(params, ws)

    # aot_eager: the graph count is dynamo's; the transform matrix's row "Experts" runs inductor
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    x = torch.randn(16, H)
    for experts in ((0, 1, 2), (1, 2, 3), (0, 3)):
        index, weights = _routing(16, experts)
        grads, _ = compiled(params, ws, x, index, weights)
        want, _ = step(params, ws, x, index, weights)
        for k in want:
            assert torch.equal(grads[k], want[k]), k
        assert all(grads[k].abs().sum() > 0 for k in want)
    assert counter.frame_count == 1


def test_vmap_over_routed_tokens_says_it_is_not_supported():
    layer = tef.nn.Experts(E, H, INTER)
    recipe = Float8CurrentScaling()
    ws = tef.init_workspaces(layer, recipe)
    params = detached_params(layer)
    index, weights = _routing(8)

    def one(x):
        return tef.functional_call(layer, params, ws, (x, index, weights), recipe=recipe)[0]
    with pytest.raises(TransformError, match="vmap over routed tokens"):
        torch.func.vmap(one)(torch.randn(3, 8, H))


# --- converted transformers models ------------------------------------------------------------

_DECODER = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=64, head_dim=16)
MODELS = {
    "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**_DECODER, num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=48, decoder_sparse_step=1)),
}


def _experts_of(model):
    return {p: m for p, m in model.named_modules() if isinstance(m, tef.nn.Experts)}


@pytest.mark.parametrize("arch", MODELS)
def test_a_converted_moe_model_keeps_its_names_and_trains_its_experts_in_fp8(arch, tmp_path):
    torch.manual_seed(3)
    original = MODELS[arch]().float().train()
    model = tef.convert(copy.deepcopy(original))
    experts = _experts_of(model)
    assert len(experts) == 2
    assert model.state_dict().keys() == original.state_dict().keys()
    for path, m in experts.items():          # the very Parameter objects: tied, optimizer-visible
        assert m.gate_up_proj is model.get_parameter(f"{path}.gate_up_proj")

    ids = torch.randint(3, VOCAB, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    with torch.no_grad():
        exact = original(**batch)
        assert torch.equal(model(**batch).logits, exact.logits)        # recipe None: the original, bit for bit

    # FP8 training through tef.grad: the experts' weights get gradients near the high-precision ones.
    recipe = DelayedScaling(amax_history_len=4)
    params = detached_params(model)
    ws = tef.init_workspaces(model, recipe)

    def loss_fn(params, ws):
        out, new_ws = tef.functional_call(model, params, ws, (), batch, recipe=recipe)
        return out.loss, new_ws
    for _ in range(2):
        grads, ws = tef.grad(loss_fn)(params, ws)
    hp = torch.func.grad(lambda p: torch.func.functional_call(original, p, (), batch).loss)(
        detached_params(original))
    for path in experts:
        for proj in ("gate_up_proj", "down_proj"):
            key = f"{path}.{proj}"
            # every GEMM of the model in FP8, E5M2 gradients: 14.0-15.0 dB measured
            assert sqnr(hp[key].double(), grads[key].double()) > 12, key
    assert any(k.endswith("gate_up_proj1_grad_amax_history") for k in ws)

    # save_pretrained / from_pretrained: the checkpoint is transformers' own, the experts' names kept.
    model.save_pretrained(tmp_path)
    again = type(original).from_pretrained(tmp_path)
    for k, v in again.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_what_convert_leaves_of_experts_is_logged(caplog):
    cfg = T.MixtralConfig(**{**_DECODER, "num_hidden_layers": 1, "intermediate_size": 40}, num_local_experts=4,
                          num_experts_per_tok=2)
    model = T.MixtralForCausalLM(cfg)
    with caplog.at_level(logging.WARNING, logger="te_func.convert"):
        tef.convert(model)
    assert not _experts_of(model)
    assert "multiples of 16" in caplog.text and "experts" in caplog.text

    model = T.MixtralForCausalLM(T.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2))
    model.model.layers[0].mlp.experts._is_expert_parallel = True
    with caplog.at_level(logging.WARNING, logger="te_func.convert"):
        tef.convert(model)
    assert list(_experts_of(model)) == ["model.layers.1.mlp.experts"]
    assert "expert-parallel experts" in caplog.text


def test_a_stateful_moe_model_resumes_bit_for_bit():
    torch.manual_seed(4)
    recipe = DelayedScaling(amax_history_len=4)
    model = tef.convert(MODELS["qwen3_moe"]())
    ids = [torch.randint(3, VOCAB, (2, 16)) for _ in range(3)]

    def train(shell, opt, batches):
        for b in batches:
            opt.zero_grad()
            shell(input_ids=b, labels=b).loss.backward()
            opt.step()

    shell = tef.Stateful(model, recipe)
    opt = torch.optim.AdamW(shell.parameters(), lr=1e-3)
    train(shell, opt, ids[:2])
    saved = copy.deepcopy((shell.state_dict(), opt.state_dict()))
    train(shell, opt, ids[2:])

    resumed = tef.Stateful(tef.convert(MODELS["qwen3_moe"]()), recipe)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    resumed.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    train(resumed, opt2, ids[2:])
    for (k, a), b in zip(shell.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_linear_router_beside_experts_stays_in_high_precision(caplog):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(H, 16, bias=False)          # 16 experts: a size FP8 would take
            self.experts = torch.nn.Linear(H, H)                    # the parent's `experts` is what counts
            self.proj = torch.nn.Linear(H, H)

    block = Block()
    with caplog.at_level(logging.WARNING, logger="te_func.convert"):
        tef.convert(block)
    assert type(block.gate) is torch.nn.Linear and isinstance(block.proj, tef.nn.Linear)
    assert "router" in caplog.text
    assert isinstance(tef.convert(block.gate), tef.nn.Linear)   # on its own, as asked


def test_gpt_oss_experts_keep_their_transposed_layout_biases_and_gate():
    """gpt-oss's experts: weights stored (experts, in, out), biases, interleaved [gate, up] rows read by
    a clamped gate of their own, which the converted layer runs under every recipe."""
    torch.manual_seed(5)
    cfg = T.GptOssConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=H, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64)
    original = T.GptOssForCausalLM(cfg).float()
    model = tef.convert(copy.deepcopy(original))
    (layer,) = _experts_of(model).values()
    assert layer.is_transposed and layer.has_bias and layer._custom_gate is type(
        original.model.layers[0].mlp.experts)._apply_gate
    ids = torch.randint(3, VOCAB, (2, 16))
    with torch.no_grad():
        exact = original(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, exact)
        recipe = Float8CurrentScaling()
        ws = tef.init_workspaces(model, recipe)
        fp8 = tef.functional_call(model, detached_params(model), ws, (), {"input_ids": ids}, recipe=recipe)[0].logits
    assert 20 < sqnr(exact.double(), fp8.double()) < 200       # FP8, the same function


def test_experts_without_a_gate_and_transposed_meet_float64():
    """has_gate=False (`up_proj`, the activation alone) and weights stored (experts, in, out)."""
    torch.manual_seed(6)
    layer = tef.nn.Experts(E, H, INTER, has_gate=False, is_transposed=True, act_fn=torch.nn.GELU())
    assert layer.up_proj.shape == (E, H, INTER) and layer.down_proj.shape == (E, INTER, H)
    x = torch.randn(24, H)
    index, weights = _routing(24)
    recipe = Float8CurrentScaling()
    out, ws = tef.functional_call(layer, detached_params(layer), tef.init_workspaces(layer, recipe),
                                  (x, index, weights), recipe=recipe)
    assert "up_proj0_cast.data" in ws
    exact = torch.zeros(24, H, dtype=torch.float64)
    up, down = layer.up_proj.detach().double(), layer.down_proj.detach().double()
    for t in range(24):
        for j in range(K):
            e = index[t, j]
            exact[t] += weights[t, j].double() * (torch.nn.functional.gelu(x[t].double() @ up[e]) @ down[e])
    assert sqnr(exact, out.double()) > 20


# fullgraph=True reports the ValueError raised while tracing as Unsupported, its message kept
COMPILE_REFUSAL = (ValueError, torch._dynamo.exc.Unsupported)


def test_what_cannot_compile_says_so():
    """Block scaling reads the counts on the host, and so does a frozen model: compiled, each says so
    and names what compiles (eager runs them)."""
    torch._dynamo.reset()
    torch.manual_seed(7)
    layer = tef.nn.Experts(E, H, INTER)
    x = torch.randn(16, H)
    index, weights = _routing(16)
    recipe = MXFP8BlockScaling()
    ws = tef.init_workspaces(layer, recipe)
    params = detached_params(layer)

    def fwd(x):
        return tef.functional_call(layer, params, ws, (x, index, weights), recipe=recipe)[0]
    fwd(x)                                                            # eager: the host path
    with pytest.raises(COMPILE_REFUSAL, match="DelayedScaling, whose counts stay on the device"):
        torch.compile(fwd, fullgraph=True, backend="eager")(x)

    frozen = tef.freeze(layer, Float8CurrentScaling())
    with torch.no_grad():
        frozen(x, index, weights)                                     # eager
        with pytest.raises(COMPILE_REFUSAL, match="run the frozen model eagerly"):
            torch.compile(frozen, fullgraph=True, backend="eager")(x, index, weights)


def test_routing_that_does_not_fit_the_tokens_is_refused():
    layer = tef.nn.Experts(E, H, INTER)
    recipe = Float8CurrentScaling()
    ws = tef.init_workspaces(layer, recipe)
    params = detached_params(layer)
    x = torch.randn(8, H)
    index, weights = _routing(8)
    frozen = tef.freeze(layer, recipe)

    def both(*args):
        yield lambda: tef.functional_call(layer, params, ws, args, recipe=recipe)
        yield lambda: frozen(*args)
    cases = [((x, index[:6], weights[:6]), ValueError, r"must both be \(tokens, k\) for hidden_states of \(8, 64\)"),
             ((x, index, weights[:, :1]), ValueError, "must both be"),
             ((x, index.float(), weights), TypeError, "top_k_index must be an integer tensor"),
             ((x, index + E - 1, weights), RuntimeError, r"expert id outside \[0, 4\)")]
    with torch.no_grad():
        for args, error, message in cases:
            for call in both(*args):
                with pytest.raises(error, match=message):
                    call()
