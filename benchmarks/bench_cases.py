"""What `benchmarks/run.py` measures: workloads x variants, each built into a no-argument step.

A variant is one implementation of the same block: plain torch layers, te_func
with a recipe (None = bf16), or torchao float8. A workload is a shape and what
one timed call does (forward+backward, an 8-microbatch training step, forward
only). `build(case, ...)` returns a `Step`: the callable to time, the FLOPs it
does, and the bytes it keeps resident (parameters, workspaces, inputs).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

import te_func as tef
from te_func.quant import Quantizer, init_delayed_state, quantize_weight
from te_func.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

DTYPE = torch.bfloat16

TE_RECIPES = {"te-bf16": None, "te-current": Float8CurrentScaling(), "te-delayed": DelayedScaling(),
              "te-mxfp8": MXFP8BlockScaling(), "te-block": Float8BlockScaling()}
# The same recipes through tef.Stateful (compiled shell + .backward()) instead of the functional step.
STATEFUL = {"te-current-stateful": "te-current", "te-delayed-stateful": "te-delayed"}
AO_RECIPES = {"ao-tensorwise": "tensorwise", "ao-rowwise": "rowwise"}
VARIANTS = ["torch-bf16", *TE_RECIPES, *STATEFUL, *AO_RECIPES]
BASELINE = "torch-bf16"
# The real model: a HuggingFace Llama (random init), 4 layers of hidden 4096 / ffn 14336 /
# 32 heads / 8 kv heads, 2 sequences of 4096 tokens; lm_head stays bf16 in every FP8 variant.
LLAMA = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
LLAMA_BATCH = (2, 4096)
# The whole Llama-3.2-1B architecture (16 layers, 2048 / 8192, tied 128,256-token embedding), same batch.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=True)
LLAMA_QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


@dataclass(frozen=True)
class Workload:
    """`kind`: "mlp" / "linear" (forward+backward), "train8_cache" / "train8_nocache"
    (8 microbatches of forward+backward, weight casts cached or not), "infer" (no_grad forward),
    "cast" (te_func only: both FP8 layouts of the MLP's two weights, as one step without cache does),
    "per_sample" / "per_sample_batch" (every sample's gradients of the MLP block, torch.func.vmap
    over `samples` samples of tokens / samples tokens each; te_func in sample / batch scope),
    "llama" (the HF Llama: forward+backward+AdamW step); `compiled` False runs it eagerly.
    shape: (tokens, hidden, ffn) or (tokens, in, out)."""
    name: str
    kind: str
    shape: tuple[int, int, int]
    compiled: bool = True
    samples: int = 1

    @property
    def gemm_flops(self) -> float:
        """Forward GEMM FLOPs of one call; backward counts twice that."""
        t, h, f = self.shape
        if self.kind == "llama":     # the decoder's GEMMs: q, k, v, o, gate, up, down per layer
            cfg = llama_config(self)
            kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
            per_layer = 2 * t * h * (2 * h + 2 * kv + 3 * f)
            return 3 * per_layer * cfg["num_hidden_layers"]
        fwd = 2 * t * h * f * (1 if self.kind == "linear" else 2)
        if self.kind == "cast":
            return 0.0
        if self.kind == "infer":
            return fwd
        # Per-sample gradients do the batch's GEMM FLOPs: the weight gradients come per sample.
        return 3 * fwd * (8 if self.kind.startswith("train8") else 1)


def workloads(quick: bool) -> list[Workload]:
    big = [(64, 32, 64)] if quick else [(16384, 4096, 14336), (8192, 8192, 28672)]
    small = [(32, 16, 32)] if quick else [(4096, 2048, 8192), (16384, 1024, 4096)]
    lin = (64, 64, 64) if quick else (8192, 8192, 8192)
    w = [Workload(f"mlp_{'x'.join(map(str, s))}", "mlp", s) for s in big + small]
    w.append(Workload(f"linear_{'x'.join(map(str, lin))}", "linear", lin))
    w += [Workload(f"train8_cache_{'x'.join(map(str, big[0]))}", "train8_cache", big[0]),
          Workload(f"train8_nocache_{'x'.join(map(str, big[0]))}", "train8_nocache", big[0])]
    w += [Workload(f"infer_{'x'.join(map(str, s))}", "infer", s) for s in big]
    w.append(Workload(f"weight_cast_{'x'.join(map(str, big[0]))}", "cast", big[0]))
    w += [Workload(f"eager_mlp_{'x'.join(map(str, s))}", "mlp", s, compiled=False) for s in big]
    samples, tokens, hidden, ffn = (2, 8, 32, 64) if quick else (32, 512, 1024, 4096)
    for kind in ("per_sample", "per_sample_batch"):
        w.append(Workload(f"{kind}_{samples}x{tokens}x{hidden}x{ffn}", kind, (samples * tokens, hidden, ffn),
                          samples=samples))
    cfg, (b, seq) = (LLAMA_QUICK, (2, 16)) if quick else (LLAMA, LLAMA_BATCH)
    w.append(Workload("llama_4l_4096x14336_8192tok" if not quick else "llama_quick", "llama",
                      (b * seq, cfg["hidden_size"], cfg["intermediate_size"])))
    if not quick:
        w.append(Workload("llama1b_16l_2048x8192_8192tok", "llama",
                          (b * seq, LLAMA_1B["hidden_size"], LLAMA_1B["intermediate_size"])))
    return w


def llama_config(w: Workload) -> dict:
    """The HF Llama config of a "llama" workload, by its hidden size."""
    return {LLAMA["hidden_size"]: LLAMA, LLAMA_1B["hidden_size"]: LLAMA_1B}.get(w.shape[1], LLAMA_QUICK)


@dataclass
class Step:
    fn: Callable[[], object]
    resident_bytes: int
    note: str = ""
    # Frees what a previous call left behind (.grad), so peak memory counts one call.
    reset: Callable[[], None] = lambda: None


class NotApplicable(Exception):
    """The variant has nothing to measure on this workload (not an error)."""


def _nbytes(*trees) -> int:
    seen, total = set(), 0
    for tree in trees:
        for t in torch.utils._pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


class Inputs:
    """Random inputs shared by the cases of one process (never zeros), made once per shape."""

    def __init__(self, device):
        self.device = device

    @functools.lru_cache(maxsize=None)
    def get(self, tokens: int, features: int, out_features: int, n: int = 1):
        g = torch.Generator(device=self.device).manual_seed(tokens * 7 + features)
        x = torch.randn(n, tokens, features, device=self.device, dtype=DTYPE, generator=g)
        dy = torch.randn(n, tokens, out_features, device=self.device, dtype=DTYPE, generator=g)
        return (x[0], dy[0]) if n == 1 else (x, dy)


def _torch_block(w: Workload, device) -> nn.Module:
    t, h, f = w.shape
    if w.kind == "linear":
        # In a container: torchao's convert_to_float8_training swaps children, never the root.
        return nn.Sequential(nn.Linear(h, f, device=device, dtype=DTYPE))
    return nn.Sequential(nn.LayerNorm(h, device=device, dtype=DTYPE), nn.Linear(h, f, device=device, dtype=DTYPE),
                         nn.GELU(approximate="tanh"), nn.Linear(f, h, device=device, dtype=DTYPE))


def _te_block(w: Workload, device) -> tuple[nn.Module, str]:
    t, h, f = w.shape
    if w.kind == "linear":
        return tef.nn.Linear(h, f, params_dtype=DTYPE, device=device), ""
    if hasattr(tef.nn, "LayerNormMLP"):
        return tef.nn.LayerNormMLP(h, f, activation="gelu", params_dtype=DTYPE, device=device), \
            "te_func.nn.LayerNormMLP"
    return nn.Sequential(nn.LayerNorm(h, device=device, dtype=DTYPE), tef.nn.Linear(h, f, params_dtype=DTYPE, device=device),
                         nn.GELU(approximate="tanh"), tef.nn.Linear(f, h, params_dtype=DTYPE, device=device)), \
        "te_func.nn.LayerNormMLP missing: torch LayerNorm + tef.nn.Linear + GELU(tanh) + tef.nn.Linear"


def _out_features(w: Workload) -> int:
    return w.shape[2] if w.kind == "linear" else w.shape[1]


def _compile(fn, w: Workload):
    return torch.compile(fn, fullgraph=True) if w.compiled else fn


def keeps_weight_cache(w: Workload, keep_always: bool) -> bool:
    """Whether te_func's workspaces keep the weight casts on `w`: only where a call reads them
    again (microbatches with the cache, inference), unless `keep_always`. Elsewhere every call
    casts its weights (is_first_microbatch None), as TE's do, and a cache would only hold memory
    (tef.init_workspaces(..., weight_cache=False))."""
    return keep_always or w.kind in ("train8_cache", "infer")


def build(variant: str, w: Workload, inputs: Inputs, compile_ok: bool, keep_weight_cache: bool = False) -> Step:
    """The step of `variant` on workload `w`; raises what the variant raises when it cannot run.
    keep_weight_cache: te_func's workspaces keep the weight casts on every workload (see
    `keeps_weight_cache`)."""
    cache = keeps_weight_cache(w, keep_weight_cache)
    if not compile_ok:
        w = Workload(w.name, w.kind, w.shape, compiled=False)
    if w.kind == "cast" and (variant not in TE_RECIPES or TE_RECIPES[variant] is None):
        raise NotApplicable("only te_func FP8 recipes cache a weight cast")
    if w.kind.startswith("per_sample"):
        if variant in STATEFUL:
            raise NotApplicable("the Stateful variants are measured on training workloads")
        return _per_sample_step(variant, w, inputs, cache)
    if w.kind == "llama":
        return _llama_step(variant, w, inputs, cache)
    if variant in STATEFUL:
        if w.kind not in ("mlp", "linear", "train8_cache", "train8_nocache"):
            raise NotApplicable("the Stateful variants are measured on training workloads")
        return _te_stateful_step(TE_RECIPES[STATEFUL[variant]], w, inputs, cache)
    if variant in TE_RECIPES:
        return _te_step(TE_RECIPES[variant], w, inputs, cache)
    if variant in AO_RECIPES:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        model = _torch_block(w, inputs.device)
        # No module filter: every Linear in FP8, as te_func's layers do by default.
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(AO_RECIPES[variant]))
        return _torch_step(model, w, inputs, "torchao " + AO_RECIPES[variant])
    if variant == BASELINE:
        return _torch_step(_torch_block(w, inputs.device), w, inputs, "")
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def _torch_step(model: nn.Module, w: Workload, inputs: Inputs, note: str) -> Step:
    """Module forward (compiled with its loss) + .backward(); gradients set to None first."""
    t, h, _ = w.shape
    if w.kind == "infer":
        x, _ = inputs.get(t, h, _out_features(w))
        fwd = _compile(model, w)

        def infer():
            with torch.no_grad():
                return fwd(x)
        return Step(infer, _nbytes(list(model.parameters()), x), note)

    loss_of = _compile(lambda x, dy: (model(x) * dy).float().sum(), w)
    if w.kind.startswith("train8"):
        xs, dys = inputs.get(t, h, _out_features(w), 8)

        def train():
            model.zero_grad(set_to_none=True)
            for i in range(8):
                loss_of(xs[i], dys[i]).backward()      # .grad accumulates across microbatches
        return Step(train, _nbytes(list(model.parameters()), xs, dys), note,
                    lambda: model.zero_grad(set_to_none=True))

    x, dy = inputs.get(t, h, _out_features(w))
    x = x.detach().requires_grad_(True)      # input gradient too: 3x the forward GEMM FLOPs

    def reset():
        model.zero_grad(set_to_none=True)
        x.grad = None

    def fwd_bwd():
        reset()
        loss_of(x, dy).backward()
    return Step(fwd_bwd, _nbytes(list(model.parameters()), x, dy), note, reset)


def _per_sample_step(variant: str, w: Workload, inputs: Inputs, cache: bool) -> Step:
    """Every sample's gradients of every parameter, loss = sum(out * dy) per sample: te_func's
    tef.per_sample_grad (scope "sample" or, for per_sample_batch, "batch"), the torch and
    torchao blocks' torch.func.vmap(torch.func.grad(...)); the whole of it compiled."""
    t, h, f = w.shape
    x, dy = inputs.get(t // w.samples, h, h, w.samples)          # (samples, tokens, hidden) each
    if variant in TE_RECIPES:
        recipe = TE_RECIPES[variant]
        model, note = _te_block(w, inputs.device)
        params = {k: v.detach() for k, v in model.named_parameters()}
        ws = tef.init_workspaces(model, recipe, weight_cache=cache)

        def loss_fn(params, ws, x, dy):
            out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe)
            return (out * dy).float().sum(), new_ws
        scope = "batch" if w.kind == "per_sample_batch" else "sample"
        step = _compile(tef.per_sample_grad(loss_fn, (0, 0), scope=scope), w)
        return Step(lambda: step(params, ws, x, dy), _nbytes(params, ws, x, dy), f"{note}; scope {scope}".lstrip("; "))
    model = _torch_block(w, inputs.device)
    note = ""
    if variant in AO_RECIPES:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(AO_RECIPES[variant]))
        note = "torchao " + AO_RECIPES[variant]
    elif variant != BASELINE:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(params, x, dy):
        return (torch.func.functional_call(model, params, (x,)) * dy).float().sum()
    step = _compile(torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0)), w)
    return Step(lambda: step(params, x, dy), _nbytes(params, x, dy), note)


def _te_step(recipe, w: Workload, inputs: Inputs, cache: bool) -> Step:
    """te_func's functional step: tef.value_and_grad over tef.functional_call, compiled whole.
    cache: the workspaces keep the weight casts (`keeps_weight_cache`)."""
    t, h, _ = w.shape
    model, note = _te_block(w, inputs.device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ws = tef.init_workspaces(model, recipe, weight_cache=cache)

    def loss_fn(params, ws, x, dy, first):
        out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=first)
        return (out * dy).float().sum(), new_ws

    if w.kind == "cast":
        weights = [p for p in params.values() if p.dim() == 2]
        quantizer = Quantizer(recipe)
        # DelayedScaling casts with its weight state's scale (and records the amax).
        state = init_delayed_state(recipe, inputs.device) if isinstance(recipe, DelayedScaling) else None
        cast = _compile(lambda ws_: [quantize_weight(wt, quantizer, None, True, state)[1] for wt in ws_], w)
        return Step(lambda: cast(weights), _nbytes(weights), note)

    if w.kind == "infer":
        x, _ = inputs.get(t, h, _out_features(w))
        fwd = _compile(lambda params, ws, x: tef.functional_call(model, params, ws, (x,), recipe=recipe,
                                                                 is_first_microbatch=False)[0], w)

        def infer():
            with torch.no_grad():
                return fwd(params, ws, x)
        return Step(infer, _nbytes(params, ws, x), note)

    if w.kind.startswith("train8"):
        xs, dys = inputs.get(t, h, _out_features(w), 8)
        reuse = w.kind == "train8_cache"

        def micro(params, ws, acc, x, dy, first):
            # The loss is returned: a step that drops it lets the compiler drop fc2's forward
            # GEMM too (d sum(out * dy) / d out = dy does not need `out`), which torch's
            # `.backward()` step computes.
            loss, grads, new_ws = tef.value_and_grad(loss_fn)(params, ws, x, dy, first)
            return loss, (grads if acc is None else {k: acc[k] + g for k, g in grads.items()}), new_ws
        micro = _compile(micro, w)

        def train():
            acc, state = None, ws
            for i in range(8):
                _, acc, state = micro(params, state, acc, xs[i], dys[i], (i == 0) if reuse else None)
            return acc, state
        return Step(train, _nbytes(params, ws, xs, dys), note)

    x, dy = inputs.get(t, h, _out_features(w))
    step = _compile(tef.value_and_grad(loss_fn, argnums=(0, 2)), w)
    return Step(lambda: step(params, ws, x, dy, None), _nbytes(params, ws, x, dy), note)


def _te_stateful_step(recipe, w: Workload, inputs: Inputs, cache: bool) -> Step:
    """tef.Stateful compiled whole, `sum(shell(x) * dy).backward()`: what a module user runs."""
    t, h, _ = w.shape
    model, note = _te_block(w, inputs.device)
    shell = tef.Stateful(model, recipe, weight_cache=cache)
    # The loss compiled with the model, as torch's step compiles it: left eager, its multiply,
    # fp32 copy and sum (and their backward) cost ~0.6 ms at 16384x4096.
    loss_of = _compile(lambda x, dy, first: (shell(x, is_first_microbatch=first) * dy).float().sum(), w)

    def reset():
        shell.zero_grad(set_to_none=True)

    if w.kind.startswith("train8"):
        xs, dys = inputs.get(t, h, _out_features(w), 8)
        reuse = w.kind == "train8_cache"

        def train():
            reset()
            for i in range(8):
                loss_of(xs[i], dys[i], (i == 0) if reuse else None).backward()
        return Step(train, _nbytes(list(shell.parameters()), shell.workspaces, xs, dys), "tef.Stateful", reset)

    x, dy = inputs.get(t, h, _out_features(w))
    x = x.detach().requires_grad_(True)

    def fwd_bwd():
        reset()
        x.grad = None
        loss_of(x, dy, None).backward()
    return Step(fwd_bwd, _nbytes(list(shell.parameters()), shell.workspaces, x, dy), "tef.Stateful", reset)


def _llama_step(variant: str, w: Workload, inputs: Inputs, cache: bool) -> Step:
    """One training step of the HF Llama: forward + backward + AdamW, compiled; lm_head in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM
    quick = w.shape[1] < 1024
    cfg = llama_config(w)
    b, seq = (2, 16) if quick else LLAMA_BATCH
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(inputs.device, DTYPE)
    keep_lm_head = lambda module, fqn: fqn != "lm_head"  # noqa: E731
    g = torch.Generator(device=inputs.device).manual_seed(3)
    ids = torch.randint(0, cfg["vocab_size"], (b, seq), device=inputs.device, generator=g)
    fused = inputs.device.type == "cuda"
    if variant in AO_RECIPES:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(AO_RECIPES[variant]),
                                   module_filter_fn=keep_lm_head)
        variant_note = "torchao " + AO_RECIPES[variant]
    elif variant != BASELINE:
        tef.convert(model, module_filter_fn=keep_lm_head)
        variant_note = "tef.convert"
    else:
        variant_note = ""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
    first = True if cache else None      # one microbatch: casts stored (and never read) or not kept

    if variant in (BASELINE, *AO_RECIPES) or variant in STATEFUL or variant == "te-bf16":
        recipe = None if variant in (BASELINE, *AO_RECIPES) else TE_RECIPES[STATEFUL.get(variant, variant)]
        if recipe is None and variant != "te-bf16":
            fwd = _compile(model, w) if not quick else model
            loss_of = lambda: fwd(input_ids=ids, labels=ids).loss  # noqa: E731
            ws = {}
        else:
            shell = tef.Stateful(model, recipe, weight_cache=cache)
            fwd = torch.compile(shell, fullgraph=True) if w.compiled and not quick else shell
            loss_of = lambda: fwd(input_ids=ids, labels=ids, is_first_microbatch=first).loss  # noqa: E731
            ws = shell.workspaces
            variant_note += ", tef.Stateful"

        def step():
            loss_of().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif variant in TE_RECIPES:
        recipe = TE_RECIPES[variant]
        params = dict(model.named_parameters())
        ws = tef.init_workspaces(model, recipe, weight_cache=cache)
        state = {"ws": ws}

        def loss_fn(p, ws):
            out, new_ws = tef.functional_call(model, p, ws, (), {"input_ids": ids, "labels": ids}, recipe=recipe,
                                              is_first_microbatch=first)
            return out.loss, new_ws

        grad_fn = tef.value_and_grad(loss_fn)
        grad_fn = torch.compile(grad_fn, fullgraph=True) if w.compiled and not quick else grad_fn
        variant_note += ", tef.value_and_grad"

        def step():
            _, grads, state["ws"] = grad_fn({k: v.detach() for k, v in params.items()}, state["ws"])
            for k, p in params.items():
                p.grad = grads[k]
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        raise NotApplicable(f"{variant} is not measured on the real model")
    step()          # AdamW's state exists from here on: count it as resident
    resident = _nbytes(list(model.parameters()), opt.state_dict()["state"], ws, ids)
    return Step(step, resident, variant_note)
