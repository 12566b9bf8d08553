"""examples/dp_sgd.py: DP-SGD in FP8 trains compiled, and clips every sample's gradient right."""
import torch

import te_func as tef
from cases import load_example


def _load():
    return load_example("dp_sgd")


def test_dp_sgd_trains_compiled_in_fp8():
    """torch.compile(fullgraph=True) of the whole step (per-sample FP8 gradients, clipping, noise,
    update), Float8CurrentScaling: the loss goes down over a few noisy steps."""
    torch._dynamo.reset()
    dp = _load()
    history, (before, after) = dp.train(dp.RECIPES["current"], steps=8, batch=16, lr=1.0, backend="aot_eager")
    assert len(history) == 8 and all(torch.isfinite(s["loss"]) for s in history)
    assert after < 0.9 * before, (before, after)


def test_dp_sgd_clips_each_sample_to_the_clip_norm():
    """Each sample's gradient norm over all parameters is that of tef.grad on the sample alone;
    after clipping it is at most the clip norm, and unchanged where it was below."""
    dp = _load()
    recipe = dp.RECIPES["current"]
    model = dp.make_model()
    x, labels = dp.make_data(samples=8)
    params, ws = {k: v.detach() for k, v in model.named_parameters()}, tef.init_workspaces(model, recipe)
    probe = dp.make_step(model, recipe, clip=1e9, noise_multiplier=0.0, lr=0.0)
    norms = probe(params, ws, x, labels)[2]["norms"]
    clip = norms.median().item()                   # half the samples above it, half below
    _, _, stats = dp.make_step(model, recipe, clip=clip, noise_multiplier=1.0, lr=0.1)(params, ws, x, labels)
    assert torch.equal(stats["norms"], norms)

    def loss_fn(p, w, xi, yi):
        logits, new_w = tef.functional_call(model, p, w, (xi,), recipe=recipe)
        return torch.nn.functional.cross_entropy(logits[None], yi[None], reduction="sum"), new_w

    for i in range(len(x)):
        alone, _ = tef.grad(loss_fn)(params, ws, x[i], labels[i])
        want = torch.sqrt(sum(g.double().square().sum() for g in alone.values()))
        assert torch.allclose(norms[i].double(), want, rtol=1e-5), i
    below, above = norms < clip, norms > clip
    assert below.any() and above.any()
    assert torch.equal(stats["clipped_norms"][below], norms[below])
    assert (stats["clipped_norms"][above] <= clip * (1 + 1e-6)).all()
    assert torch.allclose(stats["clipped_norms"][above], torch.full_like(norms[above], clip), rtol=1e-5)
