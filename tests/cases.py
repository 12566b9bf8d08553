"""The tables every cross-cutting test runs over: recipes and layers.

A new recipe or layer joins the transform matrix, the numerics checks and
the checkpoint tests by adding one row here.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import te_func as tef
from te_func.quant import lower
from te_func.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                            NVFP4BlockScaling)

# (id, recipe). None is high precision.
RECIPES = [
    ("bf16", None),
    ("current", Float8CurrentScaling()),
    ("mxfp8", MXFP8BlockScaling()),
    ("block", Float8BlockScaling()),
    ("delayed", DelayedScaling(amax_history_len=4)),
    # TE's backward_override: the backward reads the forward's casts dequantized, or the original tensors
    ("current-bwd-dequantized", Float8CurrentScaling(backward_override="dequantized")),
    ("block-bwd-high-precision", Float8BlockScaling(backward_override="high_precision")),
    # TE's default NVFP4: 16x16 weight blocks, stochastically rounded gradients, Hadamard-transformed wgrad
    ("nvfp4", NVFP4BlockScaling()),
]


@dataclass(frozen=True)
class LayerCase:
    """One te_func layer as the shared tests drive it.

    make(dtype) builds the module; inputs(batch, dtype) draws fresh random
    positional arguments (the first is the token tensor, (batch, tokens, features));
    output(out) picks the tensor to differentiate from what forward returns.
    """
    name: str
    make: Callable[[torch.dtype], torch.nn.Module]
    inputs: Callable[[int, torch.dtype], tuple]
    output: Callable = lambda out: out
    kwargs: dict = field(default_factory=dict)
    # Whether the per-sample vmap columns apply: vmap over dim 0 of the first
    # input, the other inputs shared (False for inputs like GroupedLinear's m_splits).
    per_sample: bool = True
    # Whether a forward needs its batch dim (a HuggingFace model): the per-sample columns then
    # pass each sample as a batch of one (tef.per_sample_grad's keepdim); a plain vmap cannot.
    keepdim: bool = False
    # The recipes (ids) the slow columns run (torch.compile, per-sample gradients), None for all:
    # a HuggingFace model takes dynamo ~10-20 s per graph on CI's CPU, and a per-sample vmap
    # through it seconds per recipe.
    slow_recipes: tuple[str, ...] | None = None
    # The recipes (ids) the row leaves out of every column: NVFP4's emulation (E2M1 GEMMs in fp32,
    # Philox bits in int64 ops) makes a HuggingFace model's step ~10x slower on CI's CPU, and the
    # te_func layer rows run it.
    skip_recipes: tuple[str, ...] = ()
    # Whether torch.func.grad and eager autograd give the model's gradients bit for bit: not for
    # HF Llama, whose scaled_dot_product_attention backward torch.func runs another way (plain
    # torch shows the same difference), so those compare to fp32 rounding.
    exact_grads: bool = True
    members: int = 4          # of the vmapped ensemble


def _tokens(features):
    return lambda batch, dtype: (torch.randn(batch, 8, features, dtype=dtype),)


def _grouped_inputs(batch, dtype):
    # Tokens of the whole batch split over 3 GEMMs, one of them empty; a list for
    # torch.compile, which cannot trace FP8 over a tensor's data-dependent sizes.
    return (torch.randn(batch, 8, 64, dtype=dtype), [3 * batch, 0, 5 * batch])


def _grouped_counts(batch, dtype):
    x, splits = _grouped_inputs(batch, dtype)
    return x, torch.tensor(splits)


def _routed(batch, dtype):
    # transformers' experts interface: each token's top-2 of 4 experts and their weights; expert 3 is
    # idle (routing to it would need a token whose top-2 holds it).
    tokens = torch.randn(batch, 8, 64, dtype=dtype)
    index = torch.stack([torch.randperm(3)[:2] for _ in range(batch * 8)])
    return tokens, index, torch.softmax(torch.randn(batch * 8, 2), -1).to(dtype)


LAYERS = [
    LayerCase("Linear", lambda dt: tef.nn.Linear(64, 48, params_dtype=dt), _tokens(64)),
    LayerCase("LayerNorm", lambda dt: tef.nn.LayerNorm(64, params_dtype=dt), _tokens(64)),
    LayerCase("RMSNorm", lambda dt: tef.nn.RMSNorm(64, zero_centered_gamma=True, params_dtype=dt), _tokens(64)),
    LayerCase("LayerNormLinear", lambda dt: tef.nn.LayerNormLinear(64, 48, params_dtype=dt), _tokens(64)),
    LayerCase("LayerNormMLP-gelu", lambda dt: tef.nn.LayerNormMLP(64, 96, params_dtype=dt), _tokens(64)),
    LayerCase("LayerNormMLP-swiglu", lambda dt: tef.nn.LayerNormMLP(64, 96, normalization="RMSNorm",
                                                                    activation="swiglu", params_dtype=dt),
              _tokens(64)),
    # clamped_swiglu's activation_params through every transform (alpha changes every output; a
    # recipe-independent activation, so three recipes: none, tensor-wise, delayed; compiled under
    # one, for CI time). The limit sits past most of fc1's outputs: a clamp's derivative is a step,
    # which FP8 noise crosses as it crosses relu's; tests/layers/test_layers.py checks the clamps against
    # float64.
    LayerCase("LayerNormMLP-clamped_swiglu",
              lambda dt: tef.nn.LayerNormMLP(64, 96, activation="clamped_swiglu",
                                             activation_params={"limit": 2.0, "alpha": 1.5}, params_dtype=dt),
              _tokens(64), slow_recipes=("current",),
              skip_recipes=("mxfp8", "block", "current-bwd-dequantized", "block-bwd-high-precision", "nvfp4")),
    LayerCase("GroupedLinear", lambda dt: tef.nn.GroupedLinear(3, 64, 48, params_dtype=dt), _grouped_inputs,
              per_sample=False),
    # The counts as a tensor: under the tensor-wise recipes the groups stay on the device (one grouped
    # GEMM a direction, no host sync). The other recipes read the tensor on the host and run as the
    # list row (tests/layers/test_layers.py checks they are the list's bit for bit): left out, for CI time.
    LayerCase("GroupedLinear-counts", lambda dt: tef.nn.GroupedLinear(3, 64, 48, params_dtype=dt), _grouped_counts,
              per_sample=False, slow_recipes=("delayed",),
              skip_recipes=("bf16", "mxfp8", "block", "current-bwd-dequantized", "block-bwd-high-precision",
                            "nvfp4")),
    # A mixture of experts' expert MLPs as tef.convert makes them from transformers' experts, their
    # counts on the device as the GroupedLinear-counts row's (the host-path recipes left out the same way).
    LayerCase("Experts", lambda dt: tef.nn.Experts(4, 64, 48, params_dtype=dt), _routed, per_sample=False,
              slow_recipes=("delayed",),
              skip_recipes=("bf16", "mxfp8", "block", "current-bwd-dequantized", "block-bwd-high-precision",
                            "nvfp4")),
]


# --- HuggingFace models, random init from tiny configs (no download) ---------------------------

VOCAB, SEQ = 128, 8


def tiny_llama(dtype=torch.float32, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(dtype)


def tiny_gpt2(dtype=torch.float32, layers=2):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=64, embd_pdrop=0.0,
                     attn_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).to(dtype)


def tiny_mixtral(dtype=torch.float32, layers=2):
    """A mixture of experts: 4 experts, top-2 (tef.convert makes its experts te_func.nn.Experts)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                        num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(cfg).to(dtype)


def tiny_t5(dtype=torch.float32, layers=1):
    """An encoder-decoder whose feed-forward reads `wo.weight.dtype` (tests/shell/test_freeze.py)."""
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=layers, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg).to(dtype)


def _token_ids(batch, dtype):
    return (torch.randint(0, VOCAB, (batch, SEQ)),)


def _converted(make):
    # One decoder layer in the matrix: dynamo's time to trace a model grows with its layers.
    return lambda dt: tef.convert(make(dt, layers=1))


try:
    import transformers  # noqa: F401
    HF_MODELS = [
        # A forward needs its batch dim: per-sample gradients take each sample as a batch of one.
        # The slow columns run one tensor-wise recipe per model (CI time); the te_func layer rows
        # above run them under every recipe.
        LayerCase("HF-Llama", _converted(tiny_llama), _token_ids, output=lambda out: out.logits, keepdim=True,
                  slow_recipes=("current",), exact_grads=False, members=2, skip_recipes=("nvfp4",)),
        LayerCase("HF-GPT2", _converted(tiny_gpt2), _token_ids, output=lambda out: out.logits, keepdim=True,
                  slow_recipes=("delayed",), members=2, skip_recipes=("nvfp4",)),
    ]
except ImportError:      # the test extra installs transformers; without it these rows drop out
    HF_MODELS = []


def needs_state(recipe) -> bool:
    """Whether `recipe` keeps state between steps, so it cannot run under tef.autocast: DelayedScaling's
    amax histories, the random streams of NVFP4's stochastic rounding."""
    return isinstance(recipe, DelayedScaling) or lower(recipe).keeps_rng


def is_fp4(recipe) -> bool:
    return isinstance(recipe, NVFP4BlockScaling)


def bits(t: torch.Tensor) -> torch.Tensor:
    # torch.equal has no CPU kernel for the float8 dtypes: compare their bytes.
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def assert_dicts_equal(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(bits(got[k]), bits(want[k])), k


def assert_grads_match(case, got: dict, want: dict):
    """Bit for bit, or where torch's own autograd and torch.func.grad differ (case.exact_grads
    False: HF Llama's attention backward), to fp32 rounding (`assert_dicts_match_to_rounding`)."""
    if case.exact_grads:
        return assert_dicts_equal(got, want)
    assert_dicts_match_to_rounding(got, want)


def _rows_alone_match_rows_stacked() -> bool:
    # Whether this CPU's fp32 matmul gives a row the same bits alone (8 rows) as stacked with
    # others (32 rows). Not on every CPU: on a Xeon with AVX-512 and AMX it does not (2026-12-03),
    # and te_func's emulated FP8 GEMMs are such matmuls.
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(32, 192, generator=g), torch.randn(64, 192, generator=g)
    return torch.equal((a @ w.t())[24:], a[24:] @ w.t())


ROW_BATCH_INVARIANT_MATMUL = _rows_alone_match_rows_stacked()


def assert_dicts_match_to_rounding(got: dict, want: dict):
    """FP8 casts and integer entries bit for bit, float entries (gradients, delayed-scaling
    amaxes and scales) within 1e-5 of their norm: fp32 rounding in another summation order."""
    assert got.keys() == want.keys()
    for k in want:
        if got[k].element_size() == 1 or not got[k].is_floating_point():
            assert torch.equal(bits(got[k]), bits(want[k])), k
        else:
            assert (got[k] - want[k]).norm() <= 1e-5 * want[k].norm(), k


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||out - ref||), in float64."""
    ref, out = ref.double(), out.double()
    if torch.equal(ref, out):
        return float("inf")     # also an all-zero gradient (an empty group) computed exactly
    return (20 * torch.log10(ref.norm() / (out - ref).norm())).item()


def detached_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What tef.functional_call / tef.grad take as `params`."""
    return {k: v.detach() for k, v in model.named_parameters()}


def load_example(name: str):
    """examples/{name}.py as a module (the examples are scripts, not a package)."""
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
