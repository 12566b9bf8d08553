"""opacus on te_func models, as opacus's docs drive a plain model (GradSampleModule,
PrivacyEngine.make_private), with te_func's grad samplers registered
(tef.integrations.register_opacus): per-sample gradients from te_func's own FP8 path that add
up to the batch's, a sample's gradient untouched by the other samples (as a DP auditor checks),
and the recipes whose scales mix the samples refused."""
from __future__ import annotations

import pytest
import torch
from opacus import GradSampleModule, PrivacyEngine

import te_func as tef
from te_func.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                            NVFP4BlockScaling)

tef.integrations.register_opacus()

TOKEN_LOCAL = [pytest.param(MXFP8BlockScaling(), id="mxfp8"), pytest.param(Float8BlockScaling(), id="block")]
MIXING = [pytest.param(Float8CurrentScaling(), id="current"), pytest.param(DelayedScaling(), id="delayed"),
          pytest.param(NVFP4BlockScaling(), id="nvfp4")]


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(tef.nn.LayerNormMLP(128, 256), tef.nn.Linear(128, 64))


def per_sample_grads(recipe, x, y, m=None):
    m = model() if m is None else m
    gsm = GradSampleModule(tef.Stateful(m, recipe), loss_reduction="sum")
    ((gsm(x) - y) ** 2).sum().backward()
    return ({n: p.grad_sample.clone() for n, p in m.named_parameters()},
            {n: p.grad.clone() for n, p in m.named_parameters()})


@pytest.mark.parametrize("recipe", TOKEN_LOCAL)
def test_per_sample_gradients_come_from_the_fp8_path_and_add_up_to_the_batch_gradient(recipe):
    x, y = torch.randn(4, 32, 128), torch.randn(4, 32, 64)
    samples, batch = per_sample_grads(recipe, x, y)
    assert set(samples) == set(batch)
    for name, g in batch.items():
        assert samples[name].shape == (4, *g.shape)
        assert torch.allclose(samples[name].sum(0), g, rtol=1e-4, atol=1e-5), name
    # FP8: not the high-precision per-sample gradients opacus's own fallback would compute.
    hp, _ = per_sample_grads(None, x, y)
    assert not torch.allclose(samples["1.weight"], hp["1.weight"], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("recipe", TOKEN_LOCAL)
def test_a_samples_gradient_does_not_move_when_the_other_samples_change(recipe):
    x, y = torch.randn(4, 32, 128), torch.randn(4, 32, 64)
    first, _ = per_sample_grads(recipe, x, y)
    x2, y2 = x.clone(), y.clone()
    x2[1:], y2[1:] = 1000 * torch.randn(3, 32, 128), torch.randn(3, 32, 64)
    again, _ = per_sample_grads(recipe, x2, y2)
    for name in first:
        assert torch.equal(first[name][0], again[name][0]), name


@pytest.mark.parametrize("recipe", MIXING)
def test_recipes_whose_scales_mix_the_samples_are_refused(recipe):
    x, y = torch.randn(4, 32, 128), torch.randn(4, 32, 64)
    with pytest.raises(tef.errors.TransformError, match=r"differential privacy.*MXFP8BlockScaling"):
        per_sample_grads(recipe, x, y)


def test_make_private_trains_a_shell():
    data = torch.utils.data.TensorDataset(torch.randn(32, 16, 128), torch.randn(32, 16, 64))
    shell = tef.Stateful(model(), MXFP8BlockScaling())
    opt = torch.optim.SGD(shell.parameters(), lr=0.05)
    shell, opt, loader = PrivacyEngine().make_private(
        module=shell, optimizer=opt, data_loader=torch.utils.data.DataLoader(data, batch_size=8),
        noise_multiplier=0.5, max_grad_norm=1.0)
    losses = []
    for x, y in loader:
        loss = ((shell(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses and all(torch.isfinite(torch.tensor(losses)))


def test_a_converted_llama_gets_per_sample_gradients_free_of_the_other_samples():
    from cases import tiny_llama
    torch.manual_seed(0)
    llama = tef.convert(tiny_llama())
    gsm = GradSampleModule(tef.Stateful(llama, MXFP8BlockScaling()), loss_reduction="sum")

    def run(ids):
        for p in llama.parameters():
            p.grad, p.grad_sample = None, None
        gsm(input_ids=ids, labels=ids).loss.backward()
        return ({n: p.grad_sample.clone() for n, p in llama.named_parameters() if p.grad_sample is not None},
                {n: p.grad for n, p in llama.named_parameters()})

    ids = torch.randint(0, 128, (4, 32))
    samples, batch = run(ids)
    q = "model.layers.0.self_attn.q_proj.weight"        # a te_func Linear, FP8 under the recipe
    assert samples[q].shape == (4, *batch[q].shape)
    assert torch.allclose(samples[q].sum(0), batch[q], rtol=1e-3, atol=1e-5)
    other = ids.clone()
    other[1:] = torch.randint(0, 128, (3, 32))
    again, _ = run(other)
    assert all(torch.equal(samples[n][0], again[n][0]) for n in samples)


def test_without_register_opacus_its_fallback_says_it_runs_in_high_precision_and_names_the_fix(monkeypatch):
    from te_func.nn import context
    for layer in (tef.nn.Linear, tef.nn.LayerNormMLP):
        monkeypatch.delitem(GradSampleModule.GRAD_SAMPLERS, layer)
    monkeypatch.setattr(context, "_told_outside_frames", False)
    x, y = torch.randn(4, 32, 128), torch.randn(4, 32, 64)
    with pytest.warns(tef.errors.HighPrecisionWarning, match=r"inside a torch\.func transform.*register_opacus\(\)"):
        per_sample_grads(MXFP8BlockScaling(), x, y)
