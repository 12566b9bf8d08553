"""The fused Triton casts (te_func.kernels) are bit-identical to te_func.quant's torch code.

Run on CUDA (marked `cuda`; skipped without a GPU). With TRITON_INTERPRET=1 they also
run on CPU through Triton's interpreter, for work on the kernels without a GPU.
Each test runs the same cast twice, kernels on and off, and compares the bits.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

import te_func as tef
import te_func.kernels as kernels
from cases import detached_params
from te_func.kernels import dispatch
from te_func.quant import DelayedState, Scheme, quantize_scheme, quantize_with_transpose
from te_func.recipe import DelayedScaling, Float8CurrentScaling

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter runs on any machine; else these tests need a GPU.
gpu = (lambda test: test) if INTERPRET else pytest.mark.cuda

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCHEMES = {
    "current-e4m3": Scheme(E4M3, 448.0, None, "current"),
    "current-e5m2": Scheme(E5M2, 57344.0, None, "current"),
    "current-pow2-eps": Scheme(E4M3, 448.0, None, "current", amax_epsilon=1e-3, power_2_scale=True),
    "delayed-e4m3": Scheme(E4M3, 448.0, None, "delayed"),
    "delayed-e5m2": Scheme(E5M2, 57344.0, None, "delayed"),
}
# Odd shapes cover the tile edges (tiles are 128 x 64) and the amax blocks (4096).
SHAPES = [(256, 512), (17, 33), (130, 260), (1, 7), (300, 129)]


@pytest.fixture
def device():
    if INTERPRET:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.fixture
def kernels_on():
    previous = kernels.set_cast_kernels(True)
    yield
    kernels.set_cast_kernels(previous)


def state_for(device):
    history = torch.rand(4, device=device) * 3
    return DelayedState(history, torch.tensor(448.0 / 2.5, device=device))


def both_paths(fn):
    """fn() with the kernels, then with the torch path; asserts the kernels ran."""
    before = dispatch.calls["fused"]
    fused = fn()
    assert dispatch.calls["fused"] > before, "the fused kernels did not run"
    kernels.set_cast_kernels(False)
    try:
        reference = fn()
    finally:
        kernels.set_cast_kernels(True)
    return fused, reference


def assert_same_bits(got, want):
    """Same pytree structure and values bit for bit (NaN equal to NaN for amax records)."""
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
    assert got_spec == want_spec
    for g, w in zip(got_leaves, want_leaves):
        if not isinstance(w, torch.Tensor):
            assert g == w
            continue
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous() == w.is_contiguous()
        if w.dtype in (E4M3, E5M2):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), \
                f"{(g.view(torch.uint8) != w.view(torch.uint8)).sum()} FP8 values differ"
        else:
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def random_input(shape, dtype, device):
    # Several magnitudes, so that some values land in FP8's subnormals.
    x = torch.randn(shape, device=device) * torch.logspace(-4, 2, shape[-1], device=device)
    return x.to(dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=str)
def test_cast_with_transpose_matches_the_torch_path(device, kernels_on, dtype, shape, scheme):
    s, x = SCHEMES[scheme], random_input(shape, dtype, device)
    state = state_for(device) if s.rule == "delayed" else None
    fused, reference = both_paths(lambda: quantize_with_transpose(x, s, state))
    assert_same_bits(fused, reference)


@gpu
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=str)
def test_cast_of_a_3d_tensor_matches_the_torch_path(device, kernels_on, scheme):
    s, x = SCHEMES[scheme], random_input((3, 5, 70), torch.bfloat16, device)
    state = state_for(device) if s.rule == "delayed" else None
    fused, reference = both_paths(lambda: quantize_scheme(x, s, state))
    assert_same_bits(fused, reference)


SPECIALS = {
    "nan": lambda x: x.index_fill(1, torch.tensor([3], device=x.device), float("nan")),
    "neg-nan": lambda x: x.index_fill(0, torch.tensor([2], device=x.device), -float("nan")),
    "inf": lambda x: x.index_fill(1, torch.tensor([5], device=x.device), float("inf")),
    "neg-inf": lambda x: x.index_fill(1, torch.tensor([0], device=x.device), -float("inf")),
    "zeros": lambda x: torch.zeros_like(x),
    "tiny": lambda x: x * 1e-30,          # fp8_max / amax overflows fp32: FLT_MAX scale
    "huge": lambda x: x * 1e30,
}


@gpu
@pytest.mark.parametrize("special", list(SPECIALS), ids=str)
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=str)
def test_nan_inf_zeros_and_extremes_match_the_torch_path(device, kernels_on, special, scheme):
    s = SCHEMES[scheme]
    x = SPECIALS[special](torch.randn(33, 70, device=device))
    state = state_for(device) if s.rule == "delayed" else None
    fused, reference = both_paths(lambda: quantize_with_transpose(x, s, state))
    assert_same_bits(fused, reference)


@gpu
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=lambda r: type(r).__name__)
def test_linear_under_grad_matches_the_torch_path(device, kernels_on, recipe):
    """Forward casts get plain tensors, backward casts torch.func.grad's wrapped gradients."""
    model = tef.nn.Linear(96, 80, device=device)
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)
    x = torch.randn(40, 96, device=device)

    def loss_fn(p, w, x):
        out, new_w = tef.functional_call(model, p, w, (x,), recipe=recipe, is_first_microbatch=None)
        return out.square().mean(), new_w

    fused, reference = both_paths(lambda: tef.value_and_grad(loss_fn, argnums=(0, 2))(params, ws, x))
    assert_same_bits(fused, reference)


@gpu
def test_vmap_takes_the_torch_path_with_one_amax_per_sample(device, kernels_on):
    s, x = SCHEMES["current-e4m3"], random_input((3, 20, 48), torch.bfloat16, device)
    x[1] *= 100                                      # per-sample amax differ
    before = dispatch.calls["fused"]
    q_t = torch.func.vmap(lambda xi: quantize_with_transpose(xi, s)[1])(x)
    assert dispatch.calls["fused"] == before
    for i in range(3):
        fused = quantize_with_transpose(x[i], s)[1]
        assert_same_bits(torch.utils._pytree.tree_map(lambda t: t[i], q_t), fused)


@gpu
def test_compiled_cast_takes_the_torch_path_and_agrees(device, kernels_on):
    s, x = SCHEMES["current-e4m3"], random_input((130, 260), torch.bfloat16, device)
    compiled = torch.compile(lambda x: quantize_with_transpose(x, s), fullgraph=True, backend="aot_eager")
    before = dispatch.calls["fused"]
    got = compiled(x)
    assert dispatch.calls["fused"] == before
    assert_same_bits(got, quantize_with_transpose(x, s))


def test_cpu_tensors_take_the_torch_path(kernels_on):
    if INTERPRET:
        pytest.skip("the interpreter runs the kernels on CPU")
    before = dispatch.calls["fused"]
    q, q_t, _ = quantize_with_transpose(torch.randn(16, 32), SCHEMES["current-e4m3"])
    assert dispatch.calls["fused"] == before and q.data.dtype == E4M3 and q_t.shape == (32, 16)


def _signature(x_dtype: str, given_scale: bool) -> dict:
    pointers = {"x_ptr": "*" + x_dtype, "out_ptr": "*u8", "out_t_ptr": "*u8", "scale_inv_ptr": "*fp32",
                "amax_bits_ptr": "*i32", "scale_ptr": "*fp32" if given_scale else "*i32"}
    return {**pointers, "M": "i32", "N": "i32", "fp8_max": "fp32", "amax_epsilon": "fp32"}


# (input dtype, FP8 dtype, GIVEN_SCALE, POW2, WRITE_T, SOFT_ROUND): every flag on and off.
VARIANTS = [("bf16", E4M3, *flags) for flags in itertools.product([False, True], repeat=4)] + \
    [("fp16", E5M2, False, False, True, False), ("fp32", E5M2, True, False, True, True),
     ("fp32", E4M3, False, True, False, False)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_every_kernel_variant_compiles_for_hopper(variant):
    """Triton's own ptxas compiles for sm_90 without a GPU: front-end errors show up on any machine."""
    if INTERPRET:
        pytest.skip("the interpreter does not compile")
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from te_func.kernels import cast
    x_dtype, fp8, given, pow2, write_t, soft = variant
    fp8_type, mantissa, bias = cast._FP8[fp8]
    constexprs = {"FP8": fp8_type, "GIVEN_SCALE": given, "POW2": pow2, "WRITE_T": write_t, "SOFT_ROUND": soft,
                  "MANTISSA": mantissa, "BIAS": bias, "BLOCK_M": cast.TILE_M, "BLOCK_N": cast.TILE_N}
    signature = {**_signature(x_dtype, given), **{name: "constexpr" for name in constexprs}}
    kernel = triton.compile(ASTSource(cast._cast_kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 8})
    ptx = kernel.asm["ptx"]
    assert "div.rn.f32" in ptx or given                   # the scale: one correctly rounded division
    assert soft or f"cvt.rn.satfinite.{'e4m3' if fp8 == E4M3 else 'e5m2'}x2.f32" in ptx   # round to nearest even
    amax = ASTSource(cast._amax_kernel, {"x_ptr": "*" + x_dtype, "amax_bits_ptr": "*i32", "numel": "i32",
                                         "iters": "i32", "BLOCK": "constexpr"}, {"BLOCK": cast.AMAX_BLOCK})
    assert "atom" in triton.compile(amax, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
