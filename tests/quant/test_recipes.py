"""Every field of TransformerEngine 2.20's recipes: accepted with TE's default, honoured or
refused by name; backward_override's two modes against references written here."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import te_func as tef
from cases import detached_params
from te_func.ops import GemmConfig
from te_func.quant import Quantized, dequantize, quantize, scheme_for
from te_func.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MMParams,
                            MXFP8BlockScaling, NVFP4BlockScaling, QParams)

# TE 2.20's fields and defaults (transformer_engine/common/recipe/__init__.py), with no NVTE_* set.
TE_DEFAULTS = {
    DelayedScaling: dict(margin=0, fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max",
                         scaling_factor_compute_algo=None, reduce_amax=True, fp8_dpa=False, fp8_mha=False,
                         backward_override=None),
    Float8CurrentScaling: dict(use_power_2_scales=False, fp8_format=Format.HYBRID,
                               fp8_quant_fwd_inp=QParams(), fp8_quant_fwd_weight=QParams(),
                               fp8_quant_bwd_grad=QParams(),
                               fp8_gemm_fprop=MMParams(False), fp8_gemm_dgrad=MMParams(True),
                               fp8_gemm_wgrad=MMParams(True), fp8_dpa=False, fp8_mha=False, backward_override=None),
    MXFP8BlockScaling: dict(margin=0, fp8_format=Format.E4M3, fp8_dpa=False, fp8_mha=False, backward_override=None,
                            enable_2d_quantization=False),
    Float8BlockScaling: dict(use_f32_scales=False, fp8_format=Format.E4M3,
                             fp8_quant_fwd_inp=QParams(power_2_scale=True),
                             fp8_quant_fwd_weight=QParams(power_2_scale=True),
                             fp8_quant_bwd_grad=QParams(power_2_scale=True), x_block_scaling_dim=1,
                             w_block_scaling_dim=2, grad_block_scaling_dim=1, fp8_gemm_fprop=MMParams(True),
                             fp8_gemm_dgrad=MMParams(True), fp8_gemm_wgrad=MMParams(True), fp8_dpa=False,
                             fp8_mha=False, backward_override=None),
    NVFP4BlockScaling: dict(disable_rht=False, disable_stochastic_rounding=False, disable_2d_quantization=False,
                            row_scaled_activation=False, nvfp4_4over6="none", nvfp4_4over6_e4m3_use_256="all",
                            nvfp4_4over6_err_mode="MAE", fp4_format=Format.E2M1, fp8_format=Format.E4M3,
                            fp8_dpa=False, fp8_mha=False, backward_override=None),
}
ENV = ("NVTE_BACKWARD_OVERRIDE", "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "NVTE_FP8_BLOCK_SCALING_FP32_SCALES",
       "NVTE_NVFP4_DISABLE_RHT", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION",
       "NVTE_NVFP4_ROW_SCALED_ACTIVATION", "NVTE_NVFP4_4OVER6", "NVTE_NVFP4_4OVER6_E4M3_USE_256",
       "NVTE_NVFP4_4OVER6_ERR_MODE")


@pytest.fixture(autouse=True)
def _no_nvte_environment(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("cls", TE_DEFAULTS, ids=lambda c: c.__name__)
def test_every_te_field_is_accepted_with_tes_default(cls):
    recipe = cls()
    assert {f.name for f in dataclasses.fields(recipe)} == set(TE_DEFAULTS[cls])
    for name, want in TE_DEFAULTS[cls].items():
        assert getattr(recipe, name) == want, name
    assert cls(**TE_DEFAULTS[cls]) == recipe and hash(cls(**TE_DEFAULTS[cls])) == hash(recipe)


@pytest.mark.parametrize("cls, env, field, value", [
    (Float8CurrentScaling, "NVTE_BACKWARD_OVERRIDE", "backward_override", "dequantized"),
    (Float8CurrentScaling, "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "use_power_2_scales", True),
    (Float8BlockScaling, "NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "use_f32_scales", True),
    (NVFP4BlockScaling, "NVTE_NVFP4_DISABLE_RHT", "disable_rht", True),
    (NVFP4BlockScaling, "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "disable_stochastic_rounding", True),
    (NVFP4BlockScaling, "NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "disable_2d_quantization", True),
])
def test_nvte_environment_variables_set_the_defaults(monkeypatch, cls, env, field, value):
    monkeypatch.setenv(env, value if isinstance(value, str) else "1")
    assert getattr(cls(), field) == value
    assert getattr(cls(**{field: TE_DEFAULTS[cls][field]}), field) == TE_DEFAULTS[cls][field]   # an argument wins


@pytest.mark.parametrize("make, match", [
    (lambda: DelayedScaling(fp8_dpa=True), r"DelayedScaling\.fp8_dpa=True .* no attention layer"),
    (lambda: Float8CurrentScaling(fp8_mha=True), r"Float8CurrentScaling\.fp8_mha=True"),
    (lambda: DelayedScaling(amax_compute_algo=lambda h: h.max()), r"amax_compute_algo .* callable"),
    (lambda: DelayedScaling(scaling_factor_compute_algo=lambda *a: 1.0), r"scaling_factor_compute_algo"),
    (lambda: DelayedScaling(backward_override="dequantized"), r"delayed scaling only supports None"),
    (lambda: Float8CurrentScaling(backward_override="fp32"), r"backward_override must be None"),
    (lambda: Float8CurrentScaling(fp8_format=Format.E5M2), r"pure E5M2 training is not supported"),
    (lambda: MXFP8BlockScaling(fp8_format=Format.E2M1), r"fp8_format must be Format.E4M3 or Format.HYBRID"),
    (lambda: Float8BlockScaling(x_block_scaling_dim=2), r"two 128x128-block operands"),
    (lambda: Float8BlockScaling(fp8_gemm_wgrad=MMParams(False)), r"fp8_gemm_wgrad.use_split_accumulator"),
    (lambda: Float8CurrentScaling(fp8_quant_bwd_grad=QParams(stochastic_rounding=True)), r"NVFP4 options"),
    (lambda: NVFP4BlockScaling(nvfp4_4over6="all"), r"nvfp4_4over6='all'.* does not implement"),
    (lambda: NVFP4BlockScaling(row_scaled_activation=True), r"row_scaled_activation"),
    (lambda: NVFP4BlockScaling(fp8_format=Format.HYBRID), r"fp8_format .* must be Format.E4M3"),
])
def test_what_te_func_cannot_honour_is_refused_naming_the_field(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_use_power_2_scales_and_use_f32_scales_set_every_roles_rounding():
    assert all(scheme_for(Float8CurrentScaling(use_power_2_scales=True), r).power_2_scale
               for r in ("input", "weight", "grad"))
    assert not any(scheme_for(Float8BlockScaling(use_f32_scales=True), r).power_2_scale
                   for r in ("input", "weight", "grad"))
    assert scheme_for(MXFP8BlockScaling(enable_2d_quantization=True), "weight").block == (32, 32)
    assert scheme_for(MXFP8BlockScaling(enable_2d_quantization=True), "input").block == (1, 32)


def test_use_split_accumulator_maps_to_each_gemms_accumulation():
    # fast accumulation = not use_split_accumulator; TE's defaults where a recipe has no MMParams
    assert GemmConfig.of(Float8CurrentScaling(), True).fast_accum == (True, False, False)
    assert GemmConfig.of(Float8CurrentScaling(fp8_gemm_fprop=MMParams(True), fp8_gemm_dgrad=MMParams(False)),
                         True).fast_accum == (False, True, False)
    assert GemmConfig.of(DelayedScaling(), True).fast_accum == (True, False, False)
    assert GemmConfig.of(Float8BlockScaling(), True).fast_accum == (False, False, False)


# --- backward_override ----------------------------------------------------------------------------

OVERRIDABLE = [pytest.param(r, id=type(r).__name__) for r in
               (Float8CurrentScaling(), MXFP8BlockScaling(), Float8BlockScaling())]


def _linear_grads(recipe, x, dy, layer):
    params = detached_params(layer)
    ws = tef.init_workspaces(layer, recipe)

    def loss_fn(p, ws, x):
        out, new_ws = tef.functional_call(layer, p, ws, (x,), recipe=recipe)
        return (out * dy).sum(), new_ws

    (grads, dx), _ = tef.grad(loss_fn, argnums=(0, 2))(params, ws, x)
    return grads, dx


@pytest.mark.parametrize("recipe", OVERRIDABLE)
def test_backward_override_high_precision_differentiates_the_original_tensors(recipe):
    """The forward is FP8, the backward torch's own: with loss = sum(out * dy), the gradients are
    dy @ W, dy.T @ x and sum(dy) exactly."""
    layer = tef.nn.Linear(64, 48)
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    grads, dx = _linear_grads(dataclasses.replace(recipe, backward_override="high_precision"), x, dy, layer)
    assert torch.equal(dx, dy @ layer.weight.detach())
    assert torch.equal(grads["weight"], dy.t() @ x)
    assert torch.equal(grads["bias"], dy.sum(0))


@pytest.mark.parametrize("recipe", OVERRIDABLE)
def test_backward_override_dequantized_differentiates_the_forwards_casts(recipe):
    """The backward GEMMs read the forward's FP8 casts of x and W, dequantized, with dy unquantized."""
    layer = tef.nn.Linear(64, 48)
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    grads, dx = _linear_grads(dataclasses.replace(recipe, backward_override="dequantized"), x, dy, layer)
    xq, _ = quantize(x, recipe, "input")
    wq, _ = quantize(layer.weight.detach(), recipe, "weight")
    assert torch.equal(dx, dy @ dequantize(wq))
    assert torch.equal(grads["weight"], dy.t() @ dequantize(xq))
    none, _ = _linear_grads(recipe, x, dy, layer)          # and it is not the FP8 backward
    assert not torch.equal(none["weight"], grads["weight"])
    assert isinstance(xq, Quantized)


def test_docs_table_names_every_field_of_every_recipe():
    # docs/recipes.md's table of fields: each field of each recipe has a row that applies to it.
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[2] / "docs" / "recipes.md").read_text()
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ") and "`" in line]
    for cls in TE_DEFAULTS:
        name = cls.__name__
        for f in dataclasses.fields(cls):
            applies = [fields for who, fields in rows
                       if name in who or who.strip() == "all" or (who.strip() == "all but NVFP4" and "NVFP4" not in name)]
            assert any(f"`{f.name}`" in re.sub(r"\(.*?\)", "", fields) for fields in applies), (name, f.name)
