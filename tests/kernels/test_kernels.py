"""The fused Triton casts (te_func.kernels) are bit-identical to te_func.quant's torch code;
the norm kernels agree with te_func.ops.normalization's to fp32 rounding (their row sums
add in another order); DelayedScaling's state kernels with te_func.quant's, bit for bit.

Run on CUDA (marked `cuda`; skipped without a GPU). With TRITON_INTERPRET=1 they also
run on CPU through Triton's interpreter, for work on the kernels without a GPU.
Each test runs the same cast twice, kernels on and off, and compares the bits.
"""
from __future__ import annotations

import itertools
import operator
import os

import pytest
import torch

import te_func as tef
import te_func.kernels as kernels
from cases import detached_params, sqnr
from te_func.kernels import dispatch
from te_func.ops.normalization import NormConfig, norm_backward, norm_forward, norm_output
from te_func.ops.activations import (activation_backward, activation_forward, activation_grad_with_sums,
                                    activation_spec, activation_with_amax)
from te_func.quant import DelayedState, Quantized, Scheme, quantize_scheme, quantize_with_transpose
from te_func.quant.scheme import scale_from_amax
from te_func.quant.tensor import abs_skipping_nan, amax_of, cast_with_scale
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


# --- the compiled graphs' cast: te_func::cast_from_partials --------------------------------------

def _partials(x, row):
    return abs_skipping_nan(x).reshape(-1, row).amax(1)


def _partials_op(x, partials, s):
    """te_func::cast_from_partials (registered where te_func.kernels.cast imports)."""
    assert dispatch._kernels("cast") is not None
    return Quantized(*kernels.cast_from_partials(x, partials, s.dtype, s.fp8_max, s.amax_epsilon, s.power_2_scale))


def _torch_cast(x, s):
    """te_func.quant's torch path for current scaling, spelled out: the scale of amax_of(x)."""
    return cast_with_scale(x, scale_from_amax(amax_of(x), s.fp8_max, s.amax_epsilon, s.power_2_scale), s)


CURRENT = [k for k in SCHEMES if k.startswith("current")]


@gpu
@pytest.mark.parametrize("row", ["whole-rows", "chunks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(16, 14336), (3, 2 * 1024 + 16)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scheme", CURRENT, ids=str)
def test_cast_from_partials_matches_the_torch_path(device, scheme, shape, dtype, row):
    s, x = SCHEMES[scheme], random_input(shape, dtype, device)
    row = shape[-1] if row == "whole-rows" or shape[-1] % 2 else shape[-1] // 2
    assert_same_bits(_partials_op(x, _partials(x, row), s), _torch_cast(x, s))


@gpu
@pytest.mark.parametrize("shape", SHAPES + [(200, 14336)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scheme", CURRENT, ids=str)
def test_cast_from_partials_in_large_tiles_has_the_same_bits(device, scheme, shape):
    """A prefill-sized cast (large=True: larger tiles, typically one partial max, the GELU's)."""
    s, x = SCHEMES[scheme], random_input(shape, torch.bfloat16, device)
    for partials in (amax_of(x).reshape(1), _partials(x, shape[-1])):
        got = torch.ops.te_func.cast_from_partials(x, partials, s.dtype, s.fp8_max, s.amax_epsilon, s.power_2_scale,
                                                   True)
        assert_same_bits(Quantized(got[0], got[1].reshape(())), _torch_cast(x, s))


@gpu
@pytest.mark.parametrize("special", list(SPECIALS), ids=str)
@pytest.mark.parametrize("scheme", CURRENT, ids=str)
def test_cast_from_partials_on_nan_inf_zeros_and_extremes(device, scheme, special):
    s = SCHEMES[scheme]
    x = SPECIALS[special](torch.randn(33, 70, device=device))
    assert_same_bits(_partials_op(x, _partials(x, 35), s), _torch_cast(x, s))


def _recording(graphs):
    """A torch.compile backend that keeps dynamo's graph and runs it as written (aot_eager)."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)
    return backend


def _op_calls(gm, op) -> int:
    """How many calls of the te_func op `op` (the packet or its overload) the graph makes."""
    return sum(n.target in (op, op.default) for n in gm.graph.nodes)


def _calls_partials_op(gm) -> bool:
    return _op_calls(gm, torch.ops.te_func.cast_from_partials) > 0


@pytest.mark.parametrize("shape,row", [((16, 4096), 4096), ((1, 14336), 3584), ((64, 14336), 3584),
                                       ((2, 8, 4096), 4096), ((3, 5000), 2500), ((3, 4099), 4099), ((5, 40000), 4000),
                                       ((65, 4096), None), ((4096, 4096), None), ((0, 4096), None),
                                       ((3, 300000), None)], ids=str)
def test_which_compiled_casts_take_partial_maxes_and_of_which_rows(monkeypatch, shape, row):
    """The rule, on its own (no GPU): at most COMPILED_CAST_ROWS rows; each row in the fewest equal
    pieces of at most PARTIAL_ROW elements (a width with none: whole rows); at most MAX_PARTIALS
    partial maxes at COMPILED_CAST_ROWS rows, so a very wide row keeps inductor's chain."""
    monkeypatch.setattr(dispatch, "_compiled_op_applies", lambda x: True)
    assert dispatch.partial_rows(torch.empty(shape)) == row


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", CURRENT, ids=str)
def test_a_compiled_small_cast_is_two_passes_with_the_torch_paths_bits(device, kernels_on, scheme):
    """Under torch.compile a decode-sized current-scaling cast takes its amax as partial maxes and
    calls te_func::cast_from_partials; a large one keeps inductor's own amax. Both give the torch
    path's bits, under aot_eager and under inductor."""
    s = SCHEMES[scheme]
    torch._dynamo.reset()
    for shape, small in (((16, 14336), True), ((2, 8, 4096), True), ((4096, 4096), False)):
        x = random_input(shape, torch.bfloat16, device)
        graphs = []
        got = torch.compile(lambda x: quantize_scheme(x, s)[0], fullgraph=True, backend=_recording(graphs))(x)
        assert _calls_partials_op(graphs[-1]) == small, shape
        assert_same_bits(got, _torch_cast(x, s))
        assert_same_bits(torch.compile(lambda x: quantize_scheme(x, s)[0], fullgraph=True)(x), _torch_cast(x, s))
    kernels.set_cast_kernels(False)     # off: the torch path under compile too
    graphs = []
    torch.compile(lambda x: quantize_scheme(x, s)[0], fullgraph=True, backend=_recording(graphs))(x[:16])
    assert not _calls_partials_op(graphs[-1])


@pytest.mark.cuda
def test_a_compiled_gelu_then_cast_scales_by_the_gelus_own_amax(device, kernels_on):
    """gelu_partials -> cast_from_partials compiled by inductor: the cast's scale is that of the
    amax of the v the graph returns, and its data that cast of v, bit for bit (a cast reading
    partial maxes other than the ones the GELU wrote would not be)."""
    s = SCHEMES["current-e4m3"]
    x, b = random_input((16, 14336), torch.bfloat16, device), torch.randn(14336, device=device).bfloat16()

    def step(x, b):
        v, partials = torch.ops.te_func.gelu_partials(x, b)
        return v, *kernels.cast_from_partials(v, partials, s.dtype, s.fp8_max, s.amax_epsilon, s.power_2_scale)
    assert dispatch._kernels("cast") is not None
    torch._dynamo.reset()
    v, data, scale_inv = torch.compile(step, fullgraph=True)(x, b)
    assert_same_bits(Quantized(data, scale_inv), _torch_cast(v, s))


@pytest.mark.cuda
def test_the_partials_ops_under_vmap_take_one_amax_per_sample(device, kernels_on):
    s, x = SCHEMES["current-e4m3"], random_input((3, 20, 48), torch.bfloat16, device)
    x[1] *= 100
    q = torch.func.vmap(lambda xi: _partials_op(xi, _partials(xi, 48), s))(x)
    v, partials = torch.func.vmap(lambda xi: torch.ops.te_func.gelu_partials(xi, None))(x)
    for i in range(3):
        assert_same_bits(Quantized(q.data[i], q.scale_inv[i]), _torch_cast(x[i], s))
        assert_same_bits((v[i], partials[i]), torch.ops.te_func.gelu_partials(x[i], None))


GELU = activation_spec("gelu")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(16, 14336)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("special", ["random", "nan"])
def test_gelu_partials_is_the_gelu_kernel_with_each_tiles_max(device, special, shape, dtype):
    """te_func::gelu_partials: the GELU kernel's v (fc1's bias added on the way), and per tile of
    its grid the max |v| (NaN skipped), which together are amax_of(v); with large=True (a
    prefill's x) the same v and one max, amax_of(v)."""
    from te_func.kernels import cast
    x = random_input(shape, dtype, device)
    if special == "nan":
        x[0, 0] = float("nan")
    bias = torch.randn(shape[-1], device=device).to(dtype)
    assert dispatch._kernels("cast") is not None
    v, partials = torch.ops.te_func.gelu_partials(x, bias)
    want = activation_forward(GELU, x + bias)
    assert torch.equal(v.isnan(), want.isnan())
    assert_same_activation((v.nan_to_num(),), (want.nan_to_num(),))
    v_large, one_max = torch.ops.te_func.gelu_partials(x, bias, True)
    assert_same_bits(v_large, v)
    assert one_max.shape == (1,) and one_max.dtype == torch.float32
    assert_same_bits(one_max.reshape(()), amax_of(v))
    tm, tn = cast.GELU_PARTIALS_TILE_M, cast.GELU_PARTIALS_TILE_N
    tiles = torch.nn.functional.pad(abs_skipping_nan(v), (0, -shape[1] % tn, 0, -shape[0] % tm))
    tiles = tiles.reshape(tiles.shape[0] // tm, tm, tiles.shape[1] // tn, tn).amax(dim=(1, 3)).reshape(-1)
    assert_same_bits(partials, tiles)
    assert_same_bits(partials.amax(), amax_of(v))


def assert_same_activation(got, want):
    """Bit for bit on the GPU. Triton's interpreter has no CUDA tanhf: there the GELU agrees
    with torch's CPU one to rounding."""
    if not INTERPRET:
        assert_same_bits(got, want)
        return
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and sqnr(w, g) > 40


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backward", [False, True], ids=["gelu", "gelu_backward"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_gelu_kernel_matches_the_formulas_with_its_amax_and_column_sums(device, kernels_on, with_bias, backward,
                                                                         shape, dtype):
    """With a bias, fc1's: the kernels add it to the GELU's input as torch's `+` would, and the
    forward hands back its input and the bias, for the backward kernel to add again."""
    x, y = random_input(shape, dtype, device), random_input(shape, dtype, device) * 4
    bias = random_input(shape[-1:], dtype, device) if with_bias else None
    biased = lambda t: t if bias is None else t + bias     # noqa: E731
    before = dispatch.calls["fused"]
    if backward:
        v, amax, sums = activation_grad_with_sums(GELU, x, y, True, bias)
        want = activation_backward(GELU, x, biased(y))
    else:
        v, amax, kept, kept_bias = activation_with_amax(GELU, x, bias)
        assert kept is x and kept_bias is bias
        want, sums = activation_forward(GELU, biased(x)), None
    assert dispatch.calls["fused"] > before
    assert_same_activation((v, amax), (want, amax_of(want)))
    if sums is None:
        return
    assert sums.dtype == dtype
    if INTERPRET:
        assert sqnr(want.sum(0), sums) > 30
        return
    # One sum over rows in fp32, as torch's, in another order: the same to fp32 rounding of
    # the terms, then one rounding to x's dtype.
    torch.testing.assert_close(sums.float(), want.sum(0).float(), rtol=torch.finfo(dtype).eps,
                               atol=4 * torch.finfo(torch.float32).eps * want.float().abs().sum(0).max().item())


@gpu
@pytest.mark.parametrize("special", list(SPECIALS), ids=str)
@pytest.mark.parametrize("backward", [False, True], ids=["gelu", "gelu_backward"])
def test_gelu_kernel_on_nan_inf_zeros_and_extremes(device, kernels_on, backward, special):
    if INTERPRET and special in ("nan", "neg-nan", "inf", "neg-inf", "huge"):
        pytest.skip("the interpreter's NaN and overflow handling is not the GPU's")
    x = SPECIALS[special](torch.randn(33, 70, device=device)).to(torch.bfloat16)
    y = torch.randn(33, 70, device=device, dtype=torch.bfloat16) * 4
    if backward:
        got, want = activation_grad_with_sums(GELU, x, y, False)[:2], activation_backward(GELU, x, y)
    else:
        got, want = activation_with_amax(GELU, x)[:2], activation_forward(GELU, x)
    assert_same_activation(got, (want, amax_of(want)))


NORMS = {"layernorm": NormConfig("LayerNorm"), "layernorm-zero-centered": NormConfig("LayerNorm", 1e-6, True),
         "rmsnorm": NormConfig("RMSNorm", 1e-5), "rmsnorm-zero-centered": NormConfig("RMSNorm", 1e-5, True)}
# Widths across the kernels' warp counts and a masked tail; 17 rows leave the last programs part-empty.
NORM_SHAPES = [(64, 96), (17, 33), (3, 4096), (130, 1000)]


def _within_rounding(got: torch.Tensor, want: torch.Tensor, terms: torch.Tensor) -> bool:
    """Each value within an ulp (of `want`'s dtype) of `want`, plus the fp32 rounding of a row
    sum's order carried through terms of size `terms` (which may cancel to a small result)."""
    slack = torch.finfo(want.dtype).eps * want.double().abs() + 32 * torch.finfo(torch.float32).eps * terms.double()
    return bool(((got.double() - want.double()).abs() <= slack + torch.finfo(want.dtype).tiny).all())


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("norm", list(NORMS), ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_norm_kernels_match_the_formulas_to_fp32_rounding(device, kernels_on, with_bias, norm, shape, dtype):
    """Forward: y in x's dtype within an ulp of the torch code's, mean and rsigma to a few fp32 ulps,
    the amax exactly y's. Backward (from the same statistics): dx within an ulp of x's dtype,
    dweight and dbias to fp32 rounding; and both as close to float64 as the torch code is."""
    cfg = NORMS[norm]
    if with_bias and cfg.rms:
        pytest.skip("RMSNorm has no bias")
    x = (torch.randn(shape, device=device) * 3 + 1.5).to(dtype)       # rows with a mean of their own
    weight = (torch.randn(shape[-1], device=device) * (0.1 if cfg.zero_centered_gamma else 1)).to(dtype)
    bias = torch.randn(shape[-1], device=device).to(dtype) if with_bias else None
    dy = torch.randn(shape, device=device).to(dtype)

    (y, mean, rsigma, amax), (want_y, want_mean, want_rsigma, no_amax) = both_paths(
        lambda: norm_output(x, weight, bias, cfg))
    assert no_amax is None and y.dtype == dtype and rsigma.shape == (shape[0], 1)
    assert torch.equal(amax, amax_of(y))
    x_hat_max = (x.float() - (0 if cfg.rms else want_mean)).abs().amax(-1, keepdim=True) * want_rsigma
    gamma = weight.float() + 1 if cfg.zero_centered_gamma else weight.float()
    assert _within_rounding(y, want_y, x_hat_max * gamma.abs() + (0 if bias is None else bias.float().abs()))
    torch.testing.assert_close(rsigma, want_rsigma, rtol=4e-6, atol=0)
    if cfg.rms:
        assert mean is None and want_mean is None
    else:
        torch.testing.assert_close(mean, want_mean, rtol=4e-6, atol=4e-7 * x.float().abs().amax().item())

    (dx, dw, db), (want_dx, want_dw, want_db) = both_paths(
        lambda: norm_backward(dy, x, want_mean, want_rsigma, weight, cfg))
    assert dx.dtype == dtype and dw.dtype == db.dtype == torch.float32
    dx_hat = (dy.float() * gamma).abs()
    assert _within_rounding(dx, want_dx, want_rsigma * (dx_hat + x_hat_max * dx_hat.amax(-1, keepdim=True)))
    scale = (dy.float().abs() * 4).sum(0)     # |x_hat| < 4 here: the terms' size, for the sums' rounding
    for got, want in ((dw, want_dw), (db, want_db)):
        assert ((got - want).abs() <= 8 * torch.finfo(torch.float32).eps * scale).all()

    # Against float64: the kernels' results are as good as the torch code's.
    y64, mean64, rsigma64 = norm_forward(x.double(), weight.double(), None if bias is None else bias.double(), cfg)
    dx64, dw64, db64 = norm_backward(dy.double(), x.double(), mean64, rsigma64, weight.double(), cfg)
    for got, want, ref in ((y, want_y, y64), (dx, want_dx, dx64), (dw, want_dw, dw64)):
        assert sqnr(ref, got) >= min(sqnr(ref, want), 120) - 3


@gpu
def test_norm_kernels_leave_rows_wider_than_a_block_to_the_torch_code(device, kernels_on):
    from te_func.kernels import norm
    x = torch.randn(2, norm.MAX_HIDDEN + 16, device=device, dtype=torch.bfloat16)
    weight = torch.ones(x.shape[-1], device=device)
    before = dispatch.calls["fused"]
    y, _, _, amax = norm_output(x, weight, None, NORMS["rmsnorm"])
    assert amax is None and dispatch.calls["fused"] == before and y.shape == x.shape


@gpu
def test_norm_kernel_skips_nan_in_its_amax_and_keeps_it_in_y(device, kernels_on):
    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    x[3, 5] = float("nan")
    y, _, rsigma, amax = norm_output(x, torch.ones(64, device=device, dtype=torch.bfloat16), None, NORMS["layernorm"])
    assert y[3].isnan().all() and rsigma[3].isnan().all() and not y[:3].isnan().any()
    assert torch.equal(amax, amax_of(y)) and amax.isfinite()


@gpu
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=str)
def test_cast_with_a_known_amax_matches_the_torch_path(device, kernels_on, scheme):
    """A producer's amax (the GELU kernels') spares current scaling its amax pass, same bits."""
    s, x = SCHEMES[scheme], random_input((130, 260), torch.bfloat16, device)
    state = state_for(device) if s.rule == "delayed" else None
    fused, reference = both_paths(lambda: quantize_with_transpose(x, s, state, amax_of(x)))
    assert_same_bits(fused, reference)
    assert_same_bits(fused, quantize_with_transpose(x, s, state))


@pytest.fixture
def torch_norms(monkeypatch):
    """The norm's torch code even where its kernels apply: what is left is bit-identical."""
    monkeypatch.setattr(kernels, "norm_forward", lambda *a: None)
    monkeypatch.setattr(kernels, "norm_backward", lambda *a: None)


def _mlp_step(device, recipe, hidden=96):
    model = tef.nn.LayerNormMLP(hidden, 2 * hidden, params_dtype=torch.bfloat16, device=device)
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)
    x = torch.randn(40, hidden, device=device, dtype=torch.bfloat16)

    def loss_fn(p, w, x):
        out, new_w = tef.functional_call(model, p, w, (x,), recipe=recipe, is_first_microbatch=None)
        return out.float().square().mean(), new_w
    return tef.value_and_grad(loss_fn, argnums=(0, 2)), (params, ws, x)


def assert_same_step(got, want):
    """A LayerNormMLP step's results: the same bits, but fc1's bias gradient, a sum over tokens
    the kernels take in another order (to the last bit of bf16)."""
    (loss, (grads, dx), ws), (want_loss, (want_grads, want_dx), want_ws) = got, want
    bias, want_bias = grads.pop("fc1_bias"), want_grads.pop("fc1_bias")
    if INTERPRET:   # no CUDA tanhf there: close, not the same bits
        assert sqnr(want_bias, bias) > 30 and sqnr(want_dx, dx) > 20
        assert all(sqnr(want_grads[k], grads[k]) > 20 for k in grads)
        return
    torch.testing.assert_close(bias, want_bias, rtol=2 ** -7, atol=0)
    assert_same_bits((loss, grads, dx, ws), (want_loss, want_grads, want_dx, want_ws))


@gpu
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=lambda r: type(r).__name__)
def test_layernorm_mlp_with_the_gelu_kernels_matches_the_torch_path(device, kernels_on, torch_norms, recipe):
    step, args = _mlp_step(device, recipe)
    fused, reference = both_paths(lambda: step(*args))
    assert_same_step(fused, reference)


@gpu
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=lambda r: type(r).__name__)
def test_layernorm_mlp_with_every_kernel_matches_the_torch_path_to_fp8_tolerance(device, kernels_on, recipe):
    """The norm kernels too: their row sums' order moves a few bf16 values of the normalized
    output by an ulp, and so an FP8 value here and there, so the step agrees to FP8's noise."""
    step, args = _mlp_step(device, recipe, hidden=256)
    fused, reference = both_paths(lambda: step(*args))
    (loss, (grads, dx), ws), (want_loss, (want_grads, want_dx), want_ws) = fused, reference
    assert torch.isclose(loss, want_loss, rtol=1e-2)
    assert sqnr(want_dx, dx) > 20
    assert all(sqnr(want_grads[k], grads[k]) > 20 for k in want_grads), \
        {k: sqnr(want_grads[k], grads[k]) for k in want_grads}
    for k in want_ws:       # amax histories and scales: the amaxes of nearly the same tensors
        torch.testing.assert_close(ws[k].float(), want_ws[k].float(), rtol=2 ** -6, atol=0)


@gpu
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=lambda r: type(r).__name__)
def test_compiled_layernorm_mlp_takes_the_torch_path_with_the_same_bits(device, kernels_on, recipe):
    """Under torch.compile the GELU's casts are te_func's torch code (inductor fuses it itself);
    aot_eager runs it as written: the kernels' eager results, bit for bit."""
    step, args = _mlp_step(device, recipe)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    before = dispatch.calls["fused"]
    got = compiled(*args)
    assert dispatch.calls["fused"] == before
    assert_same_step(got, step(*args))


HISTORIES = {      # DelayedScaling's amax history as steps leave it, and its corner cases
    "random": lambda h: h,
    "idle-step": lambda h: h.index_fill(0, torch.tensor([0], device=h.device), 0.0),    # skipped: no roll
    "nan": lambda h: h.index_fill(0, torch.tensor([0, h.numel() - 1], device=h.device), float("nan")),
    "inf": lambda h: h.index_fill(0, torch.tensor([0], device=h.device), float("inf")),  # old scale kept
    "subnormal": lambda h: h * 1e-44,     # fp8_max / amax overflows fp32: FLT_MAX scale
    "all-zero": lambda h: torch.zeros_like(h),
}


@gpu
@pytest.mark.parametrize("history", list(HISTORIES), ids=str)
@pytest.mark.parametrize("length", [1, 2, 3, 16, 1024])
@pytest.mark.parametrize("algo,margin,role", [("max", 0, "input"), ("most_recent", 0, "grad"),
                                              ("max", 3, "grad"), ("most_recent", 1, "weight")], ids=str)
def test_delayed_update_kernel_matches_the_torch_code(device, kernels_on, algo, margin, role, length, history):
    from te_func.quant.delayed import delayed_update
    recipe = DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=margin)
    state = DelayedState(HISTORIES[history](torch.rand(length, device=device) * 100), torch.tensor(3.5, device=device))
    fused, reference = both_paths(lambda: delayed_update(state, recipe, role))
    assert_same_bits(fused, reference)
    assert fused.scale.shape == () and fused.amax_history.data_ptr() != state.amax_history.data_ptr()


@gpu
@pytest.mark.parametrize("amax", [0.0, 0.5, 7.0, float("inf"), float("nan")], ids=str)
@pytest.mark.parametrize("history", ["random", "idle-step", "nan"], ids=str)
@pytest.mark.parametrize("length", [1, 5, 1024])
def test_delayed_record_kernel_matches_the_torch_code(device, kernels_on, length, history, amax):
    from te_func.quant.tensor import record_amax
    state = DelayedState(HISTORIES[history](torch.rand(length, device=device) * 10), torch.tensor(3.5, device=device))
    cast_amax = torch.tensor(amax, device=device)
    fused, reference = both_paths(lambda: record_amax(state, cast_amax))
    assert_same_bits(fused, reference)
    assert fused.scale is state.scale


@gpu
def test_delayed_kernels_leave_batched_histories_to_the_torch_code(device, kernels_on):
    """Under vmap (an ensemble's states) each member keeps its own history: the torch code."""
    from te_func.quant.delayed import delayed_update
    recipe = DelayedScaling(amax_history_len=8)
    states = DelayedState(torch.rand(3, 8, device=device), torch.ones(3, device=device))
    before = dispatch.calls["fused"]
    got = torch.func.vmap(lambda s: delayed_update(s, recipe, "input"))(states)
    assert dispatch.calls["fused"] == before
    for i in range(3):
        assert_same_bits(DelayedState(got.amax_history[i], got.scale[i]),
                         delayed_update(DelayedState(states.amax_history[i], states.scale[i]), recipe, "input"))


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


def _compile_for_hopper(fn, signature: dict, constexprs: dict, fp_fusion: bool = True) -> str:
    """The PTX Triton's own ptxas makes of `fn` for sm_90 (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 8, "enable_fp_fusion": fp_fusion}).asm["ptx"]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_every_kernel_variant_compiles_for_hopper(variant):
    """Triton's own ptxas compiles for sm_90 without a GPU: front-end errors show up on any machine."""
    if INTERPRET:
        pytest.skip("the interpreter does not compile")
    pytest.importorskip("triton")
    from te_func.kernels import cast
    x_dtype, fp8, given, pow2, write_t, soft = variant
    fp8_type, mantissa, bias = cast._FP8[fp8]
    ptx = _compile_for_hopper(cast._cast_kernel, _signature(x_dtype, given),
                              {"FP8": fp8_type, "GIVEN_SCALE": given, "POW2": pow2, "WRITE_T": write_t,
                               "SOFT_ROUND": soft, "MANTISSA": mantissa, "BIAS": bias, "BLOCK_M": cast.TILE_M,
                               "BLOCK_N": cast.TILE_N})
    assert "div.rn.f32" in ptx or given                   # the scale: one correctly rounded division
    assert soft or f"cvt.rn.satfinite.{'e4m3' if fp8 == E4M3 else 'e5m2'}x2.f32" in ptx   # round to nearest even
    amax = _compile_for_hopper(cast._amax_kernel, {"x_ptr": "*" + x_dtype, "amax_bits_ptr": "*i32", "numel": "i32",
                                                   "iters": "i32"}, {"BLOCK": cast.AMAX_BLOCK})
    assert "atom" in amax


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("pow2", [False, True], ids=["", "pow2"])
def test_the_partials_cast_kernel_compiles_for_hopper(pow2, fp8):
    if INTERPRET:
        pytest.skip("the interpreter does not compile")
    pytest.importorskip("triton")
    from te_func.kernels import cast
    fp8_type, mantissa, bias = cast._FP8[fp8]
    signature = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv" if fp8 == E4M3 else "*fp8e5", "scale_inv_ptr": "*fp32",
                 "partials_ptr": "*fp32", "n_partials": "i32", "M": "i32", "N": "i32", "fp8_max": "fp32",
                 "amax_epsilon": "fp32"}
    ptx = _compile_for_hopper(cast._partials_cast_kernel, signature, {
        "FP8": fp8_type, "POW2": pow2, "SOFT_ROUND": False, "MANTISSA": mantissa, "BIAS": bias,
        "BLOCK_M": cast.PARTIALS_TILE_M, "BLOCK_N": cast.PARTIALS_TILE_N, "BLOCK_P": cast.PARTIALS_BLOCK})
    assert "div.rn.f32" in ptx and f"cvt.rn.satfinite.{'e4m3' if fp8 == E4M3 else 'e5m2'}x2.f32" in ptx
    gelu = _compile_for_hopper(cast._activation_kernel, {
        "x_ptr": "*bf16", "y_ptr": "*bf16", "b_ptr": "*bf16", "v_ptr": "*bf16", "amax_bits_ptr": "*fp32",
        "colsum_ptr": "*fp32", "M": "i32", "N": "i32"}, {"ACT": 1, "HAS_BIAS": True, "COLSUM": False, "PARTIALS": True,
                                                        "BLOCK_M": cast.GELU_PARTIALS_TILE_M,
                                                        "BLOCK_N": cast.GELU_PARTIALS_TILE_N}, fp_fusion=False)
    assert "atom" not in gelu and "fma.rn.f32" not in gelu      # a store per tile; each product rounded


def test_a_compiled_graph_casts_with_the_partial_maxes_the_gelu_kernel_wrote():
    """The graph AOTAutograd makes of gelu_partials -> cast_from_partials (traced on fake CUDA
    tensors, no GPU needed): the cast reads the buffer the GELU kernel writes its maxes into. A
    buffer passed to a kernel twice comes back as two copies, one of them never written."""
    if INTERPRET:
        pytest.skip("the interpreter's kernels cannot be traced")
    pytest.importorskip("triton")
    from torch._functorch.aot_autograd import aot_function
    from torch._subclasses.fake_tensor import FakeTensorMode
    assert dispatch._kernels("cast") is not None
    graphs = []

    def step(x, b):
        v, partials = torch.ops.te_func.gelu_partials(x, b)
        return torch.ops.te_func.cast_from_partials(v, partials, E4M3, 448.0, 0.0, False)

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(16, 512, dtype=torch.bfloat16, device="cuda")
        b = torch.empty(512, dtype=torch.bfloat16, device="cuda")
        try:
            aot_function(step, keep)(x, b)
        except RuntimeError:
            pass        # running the traced graph needs a GPU; the trace is what is checked
    wrapper = torch.ops.higher_order.triton_kernel_wrapper_functional
    gelu, cast_ = [n for n in graphs[0].graph.nodes if n.target is wrapper]
    read = cast_.kwargs["kwargs"]["partials_ptr"]
    assert read.target is operator.getitem and read.args == (gelu, "amax_bits_ptr")


@pytest.mark.parametrize("x_dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("act,colsum", [(1, False), (1, True), (2, True), (2, False)], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_every_activation_kernel_variant_compiles_for_hopper(bias, act, colsum, x_dtype):
    if INTERPRET:
        pytest.skip("the interpreter does not compile")
    pytest.importorskip("triton")
    from te_func.kernels import cast
    signature = {"x_ptr": "*" + x_dtype, "y_ptr": "*" + x_dtype, "b_ptr": "*" + x_dtype, "v_ptr": "*" + x_dtype,
                 "amax_bits_ptr": "*i32", "colsum_ptr": "*fp32", "M": "i32", "N": "i32"}
    ptx = _compile_for_hopper(cast._activation_kernel, signature, {"ACT": act, "HAS_BIAS": bias, "COLSUM": colsum,
                                                                   "BLOCK_M": cast.ACT_TILE_M,
                                                                   "BLOCK_N": cast.ACT_TILE_N})
    assert "atom" in ptx and (x_dtype != "bf16" or "cvt.rn.bf16" in ptx)   # rounded to nearest even


@pytest.mark.parametrize("x_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("block_n", [128, 4096, 16384])
def test_every_norm_kernel_variant_compiles_for_hopper(block_n, rms, x_dtype):
    if INTERPRET:
        pytest.skip("the interpreter does not compile")
    pytest.importorskip("triton")
    from te_func.kernels import norm
    rows = {"M": "i32", "N": "i32"}
    fwd = _compile_for_hopper(norm._norm_forward_kernel, {
        "x_ptr": "*" + x_dtype, "gamma_ptr": "*fp32", "beta_ptr": "*fp32", "y_ptr": "*" + x_dtype,
        "mean_ptr": "*fp32", "rsigma_ptr": "*fp32", "amax_bits_ptr": "*i32", **rows, "inv_n": "fp32", "eps": "fp32"},
        {"RMS": rms, "HAS_BETA": not rms, "ROWS": norm.ROWS_FORWARD, "BLOCK_N": block_n}, fp_fusion=False)
    bwd = _compile_for_hopper(norm._norm_backward_kernel, {
        "dy_ptr": "*" + x_dtype, "x_ptr": "*" + x_dtype, "mean_ptr": "*fp32", "rsigma_ptr": "*fp32",
        "gamma_ptr": "*fp32", "dx_ptr": "*" + x_dtype, "dgamma_ptr": "*fp32", "dbeta_ptr": "*fp32", **rows,
        "rows_per_program": "i32", "inv_n": "fp32"}, {"RMS": rms, "BLOCK_N": block_n}, fp_fusion=False)
    # no fused multiply-add: each product rounded, as torch's separate ops round it
    assert "atom" in fwd and "fma.rn.f32" not in fwd and "fma.rn.f32" not in bwd


@pytest.mark.parametrize("most_recent", [False, True], ids=["max", "most_recent"])
def test_delayed_kernels_compile_for_hopper(most_recent):
    if INTERPRET:
        pytest.skip("the interpreter does not compile")
    pytest.importorskip("triton")
    from te_func.kernels import delayed
    update = _compile_for_hopper(delayed._update_kernel, {
        "h_ptr": "*fp32", "scale_ptr": "*fp32", "h_out_ptr": "*fp32", "scale_out_ptr": "*fp32", "L": "i32",
        "scaled_max": "fp32"}, {"MOST_RECENT": most_recent, "BLOCK": 1024})
    record = _compile_for_hopper(delayed._record_kernel, {"h_ptr": "*fp32", "amax_ptr": "*fp32",
                                                          "h_out_ptr": "*fp32", "L": "i32"}, {"BLOCK": 1024})
    assert "div.rn.f32" in update and "st.global" in record        # the scale: one correctly rounded division


@gpu
def test_a_modules_parameters_take_the_kernels(device, kernels_on, monkeypatch):
    """Through tef.Stateful the ops get nn.Parameters as they are (fc1's bias): the kernels take them."""
    model = tef.nn.LayerNormMLP(64, 128, params_dtype=torch.bfloat16, device=device)
    shell = tef.Stateful(model, Float8CurrentScaling())
    results, real = [], kernels.activation
    monkeypatch.setattr(kernels, "activation", lambda *a, **k: results.append(real(*a, **k)) or results[-1])
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    shell(x).float().sum().backward()
    assert len(results) == 2 and all(r is not None for r in results)     # the GELU forward and backward


# --- weight-only FP8's GEMM --------------------------------------------------------------------------

# (tokens, out, in): one token, a decode batch, tokens over one block of 64 (two programs along
# them), widths that are not multiples of the tiles, and long rows that the kernel splits along K
# (its second kernel adds the splits), one of them ragged.
WEIGHT_ONLY_SHAPES = [(1, 48, 96), (16, 64, 128), (33, 40, 200), (70, 16, 64), (5, 32, 2048), (3, 40, 1100), (1, 40, 2048)]


def _ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's last place in its dtype (bf16 or fp16), elementwise."""
    ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    return (got.float() - want.float()).abs() / ulp


@gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("w_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("shape", WEIGHT_ONLY_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_weight_only_kernel_matches_the_reference_to_one_rounding(device, kernels_on, shape, w_dtype, x_dtype,
                                                                 with_bias):
    """The kernel sums the same fp32 products as te_func.gemm's reference, in another order, and
    adds the bias before rounding as it does: the results differ by at most one rounding of the
    output."""
    from te_func.gemm import _weight_only_reference
    m, n, k = shape
    x = torch.randn(m, k, device=device, dtype=x_dtype)
    w = (torch.randn(n, k, device=device) * 40).to(w_dtype)
    scale_inv = torch.tensor(0.0137, device=device)
    bias = (torch.randn(n, device=device) * 5).to(x_dtype) if with_bias else None
    before = dispatch.calls["fused"]
    got = kernels.weight_only_mm(x, w, scale_inv, bias)
    assert got is not None and dispatch.calls["fused"] == before + 1
    want = _weight_only_reference(x, w, scale_inv, bias)
    assert got.dtype == x_dtype and got.shape == (m, n)
    assert _ulps_apart(got, want).max() <= 1.0
    exact = (x.double() @ w.double().t()) * 0.0137 + (0 if bias is None else bias.double())
    assert sqnr(exact, got.double()) > 45     # the output's rounding alone: bf16 ~52 dB, fp16 ~70


def test_weight_only_kernel_leaves_what_it_does_not_take_to_the_reference(kernels_on):
    w, s = torch.randn(8, 16).to(E4M3), torch.tensor(1.0)
    assert kernels.weight_only_mm(torch.randn(4, 16), w, s) is None                      # fp32 input
    assert kernels.weight_only_mm(torch.randn(4, 16, dtype=torch.bfloat16), w.float(), s) is None   # not FP8
    assert kernels.weight_only_mm(torch.randn(0, 16, dtype=torch.bfloat16), w, s) is None      # no tokens
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert kernels.weight_only_mm(x, w, s, torch.randn(8)) is None                  # a bias of another dtype
    assert kernels.weight_only_mm(x, w, s, torch.randn(9, dtype=torch.bfloat16)) is None    # of another width
    if not INTERPRET:
        assert kernels.weight_only_mm(torch.randn(4, 16, dtype=torch.bfloat16), w, s) is None  # a CPU tensor


@pytest.mark.parametrize("x_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("w_dtype", ["fp8e4nv", "fp8e5"])
def test_weight_only_kernel_compiles_for_hopper(w_dtype, x_dtype):
    """Tokens on tensor cores (Hopper's wgmma), one token on the CUDA cores; the FP8 bytes widened
    in registers."""
    if INTERPRET:
        pytest.skip("the interpreter does not compile")
    pytest.importorskip("triton")
    from te_func.kernels import weight_only
    for split in (1, 4):
        ptx = _compile_for_hopper(weight_only._weight_only_kernel.fn, {
            "x_ptr": "*" + x_dtype, "w_ptr": "*" + w_dtype, "scale_inv_ptr": "*fp32",
            "out_ptr": "*" + (x_dtype if split == 1 else "fp32"), "M": "i32", "N": "i32", "K": "i32",
            "K_PER_SPLIT": "i32", "T_BUCKET": "i32"},
            {"SPLIT": split, "BLOCK_T": 16, "BLOCK_N": 64, "BLOCK_K": 128})
        assert "wgmma" in ptx and "cvt" in ptx
    for split in (1, 4):
        ptx = _compile_for_hopper(weight_only._gemv_kernel, {
            "x_ptr": "*" + x_dtype, "w_ptr": "*" + w_dtype, "scale_inv_ptr": "*fp32",
            "out_ptr": "*" + (x_dtype if split == 1 else "fp32"), "N": "i32", "K": "i32", "K_PER_SPLIT": "i32"},
            {"SPLIT": split, "BLOCK_N": weight_only.GEMV["BLOCK_N"], "BLOCK_K": weight_only.GEMV["BLOCK_K"]})
        assert "cvt" in ptx
    ptx = _compile_for_hopper(weight_only._sum_splits_kernel, {"partial_ptr": "*fp32", "scale_inv_ptr": "*fp32",
                                                               "out_ptr": "*" + x_dtype, "numel": "i32"},
                              {"SPLIT": 4, "BLOCK": 1024})
    assert "st.global" in ptx


@pytest.mark.parametrize("kernel", ["offsets", "batched", "runs-along-k"])
def test_the_grouped_gemm_kernels_load_fp8_in_16_byte_vectors(kernel):
    """Every grouped layout's K loop copies 16-byte vectors asynchronously into shared memory (the
    sizes and strides multiples of 16, as Triton specializes them): the runs along K start and end
    anywhere, and a mask that changed inside 16 columns made that loop load single bytes, 13x slower
    than the forward (H100)."""
    if INTERPRET:
        pytest.skip("the interpreter does not compile")
    pytest.importorskip("triton")
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from te_func.kernels import grouped_gemm
    runs = kernel == "runs-along-k"
    fn = (grouped_gemm._k_runs_kernel if runs else grouped_gemm._grouped_kernel).fn
    tiles = {"FAST_ACCUM": False, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}
    constexprs = tiles if runs else {**tiles, "OFFSETS": kernel == "offsets", "HAS_BIAS": False}
    pointers = {"a_ptr": "*fp8e5", "b_ptr": "*fp8e4nv", "offs_ptr": "*i32", "out_ptr": "*bf16"}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "*fp32" if n.endswith("_ptr") else "i32")
                 for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if n.endswith("_ptr") or n in ("M", "N", "K", "T", "lda", "ldb", "a_group_stride", "b_group_stride")}
    ptx = triton.compile(ASTSource(fn, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 8, "num_stages": 3}).asm["ptx"]
    assert "cp.async.cg.shared.global" in ptx and "wgmma.mma_async" in ptx
    assert not re.search(r"ld\.global(\.\w+)*\.(b8|u8|s8)\b", ptx)


def _absolute(t: torch.Tensor) -> torch.Tensor:
    return t.float().abs().to(t.dtype)      # exact: FP8 has a sign bit


@gpu
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], ids=str)
@pytest.mark.parametrize("layout", ["batched", "shared-weight", "offsets", "runs-along-k"])
def test_grouped_gemm_kernel_matches_the_loop_to_the_tensor_cores_accumulation(device, kernels_on, dtypes, layout):
    """The grouped FP8 GEMM's kernel against one GEMM a group (kernels off): the same products
    summed in another order, within the FP8 tensor cores' accumulation error; odd sizes cover the
    tile edges, an empty run and rows past the last run the offsets layout, runs that start and
    end inside 16 columns the runs along K."""
    from te_func.gemm import _grouped_scaled_mm
    torch.manual_seed(0)
    g, m, n, k = 3, 72, 80, 96
    b = (torch.randn(g, n, k, device=device) * 8).to(dtypes[1])
    scale_a, scale_b = torch.rand(g, device=device) + 0.5, torch.rand(g, device=device) + 0.5
    bias = torch.randn(g, n, device=device)
    offs = None
    if layout == "runs-along-k":
        # weight gradients: (M, T) x (N, T), runs of 61, 0, 83 and 44 tokens (none a whole number of
        # tiles, two starting inside 16 columns), 2 tokens past the last run; T = 190 needs padded rows
        a, b = (torch.randn(m, 190, device=device) * 8).to(dtypes[0]), (torch.randn(n, 190, device=device) * 8).to(
            dtypes[1])
        scale_a, scale_b = torch.rand(4, device=device) + 0.5, torch.rand(4, device=device) + 0.5
        offs, bias = torch.tensor([61, 61, 144, 188], device=device, dtype=torch.int32), None
    elif layout == "offsets":
        a = (torch.randn(200, k, device=device) * 8).to(dtypes[0])
        offs, bias = torch.tensor([70, 70, 190], device=device, dtype=torch.int32), None
    else:
        a = (torch.randn(g, m, k, device=device) * 8).to(dtypes[0])
        b = b[:1].expand(g, n, k) if layout == "shared-weight" else b
    before = dispatch.calls["fused"]
    got = _grouped_scaled_mm(a, b, scale_a, scale_b, torch.float32, False, bias, offs)
    assert dispatch.calls["fused"] == before + 1
    kernels.set_cast_kernels(False)
    want = _grouped_scaled_mm(a, b, scale_a, scale_b, torch.float32, False, bias, offs)
    assert got.shape == want.shape
    # FP8 tensor cores accumulate a K tile's products with less than fp32's precision (the kernel's
    # and cuBLAS's alike; a run whose length cuBLAS does not take is emulated exactly). The bound,
    # 2**-10 of the terms' magnitudes summed, is far below one term: a column read from a
    # neighbouring run, or one left out, fails it.
    size = _grouped_scaled_mm(_absolute(a), _absolute(b), scale_a, scale_b, torch.float32, False,
                              None if bias is None else bias.abs(), offs)
    assert ((got - want).abs() <= 2**-10 * size).all()
    if layout == "offsets":
        assert not got[190:].any()
    if layout == "runs-along-k":
        assert not got[1].any()
