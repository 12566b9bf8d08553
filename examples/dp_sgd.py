"""Differentially private SGD in FP8: per-sample gradient clipping and Gaussian noise.

    python examples/dp_sgd.py --steps 30 [--recipe current|delayed|mxfp8|block] [--scope sample|batch]
                              [--backend inductor|aot_eager|none]

Each step does what Opacus's DP-SGD does (Abadi et al. 2016): every sample's gradient
is computed on its own (tef.per_sample_grad, FP8 forward and backward), clipped to
L2 norm at most `clip` over all parameters, the clipped gradients are summed, Gaussian
noise of std `noise_multiplier * clip` is added, and the sum is divided by the batch
size. The whole step, workspaces included, is one function compiled with
fullgraph=True. The model is a small sequence classifier of torch layers converted by
tef.convert; the data are noisy copies of one random sequence per class.

The default quantization scope is "sample": each sample's FP8 scales come from that
sample alone, so its clipped gradient depends on nothing else, which the privacy
argument (one sample changes the noisy sum by at most `clip`) relies on. "batch"
shares the batch's scales (the per-sample gradients then add up to the batch
gradient) at the cost of that independence. Privacy accounting (the epsilon a run
spends) is left to an accountant such as Opacus's RDP accountant.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import te_func as tef
from te_func.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

RECIPES = {"current": Float8CurrentScaling(), "delayed": DelayedScaling(amax_history_len=16),
           "mxfp8": MXFP8BlockScaling(), "block": Float8BlockScaling(), "high": None}


class Classifier(nn.Module):
    """(..., tokens, features) -> (..., classes): a token MLP, mean over tokens, a linear head.
    Plain torch layers: `make_model` converts them to te_func's."""

    def __init__(self, features: int = 64, hidden: int = 128, classes: int = 4):
        super().__init__()
        self.embed = nn.Linear(features, features)
        self.mlp = nn.Sequential(nn.LayerNorm(features), nn.Linear(features, hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(hidden, features))
        self.head = nn.Linear(features, classes)

    def forward(self, x):
        h = F.gelu(self.embed(x))                         # (..., tokens, features)
        h = h + self.mlp(h)
        return self.head(h.mean(-2))                      # (..., classes)


def make_model() -> nn.Module:
    """The Classifier converted by tef.convert: its Linear and LayerNorm layers become te_func's;
    the head (4 outputs, not a multiple of 16, so no FP8 GEMM) stays a torch Linear."""
    return tef.convert(Classifier())


def make_data(classes: int = 4, samples: int = 256, tokens: int = 16, features: int = 64, seed: int = 0):
    """(x (samples, tokens, features), labels (samples,)): noisy copies of one sequence per class."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(classes, tokens, features, generator=g)
    labels = torch.randint(classes, (samples,), generator=g)
    return prototypes[labels] + 1.5 * torch.randn(samples, tokens, features, generator=g), labels


def global_norms(grads: dict) -> torch.Tensor:
    """Per-sample gradients {name: (batch, ...)} -> each sample's L2 norm over all of them, (batch,)."""
    return torch.stack([g.flatten(1).float().square().sum(1) for g in grads.values()]).sum(0).sqrt()


def make_step(model: nn.Module, recipe, *, clip: float, noise_multiplier: float, lr: float,
              scope: str = "sample", chunk_size: int | None = None):
    """step(params, ws, x, labels) -> (new params, new ws, stats); stats: `loss` (mean over the
    batch), `norms` (each sample's gradient norm) and `clipped_norms` (after clipping)."""

    def loss_fn(params, ws, x, labels):
        logits, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe)
        # A sum over samples: the loss of one sample, or of a whole batch (batch scope runs both).
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"), new_ws

    per_sample = tef.per_sample_value_and_grad(loss_fn, (0, 0), scope=scope, chunk_size=chunk_size)

    def step(params, ws, x, labels):
        losses, grads, new_ws = per_sample(params, ws, x, labels)      # grads: (batch, ...) each
        norms = global_norms(grads)
        factor = (clip / (norms + 1e-6)).clamp(max=1.0)                  # Opacus's clip factor
        clipped = {k: g * factor.view(-1, *([1] * (g.dim() - 1))).to(g.dtype) for k, g in grads.items()}
        batch = x.shape[0]
        noisy = {k: (g.sum(0) + noise_multiplier * clip * torch.randn_like(g[0])) / batch for k, g in clipped.items()}
        new_params = {k: p - lr * noisy[k] for k, p in params.items()}
        return new_params, new_ws, {"loss": losses.mean(), "norms": norms, "clipped_norms": global_norms(clipped)}
    return step


def data_loss(model: nn.Module, recipe, params: dict, ws: dict, x, labels) -> float:
    """Mean cross-entropy over a whole data set (no gradients, workspaces left as they are)."""
    with torch.no_grad():
        logits, _ = tef.functional_call(model, params, ws, (x,), recipe=recipe)
    return F.cross_entropy(logits, labels).item()


def train(recipe, steps: int, *, batch: int = 32, clip: float = 1.0, noise_multiplier: float = 0.5,
          lr: float = 0.5, scope: str = "sample", backend: str | None = "inductor", seed: int = 0):
    """DP-SGD for `steps` steps on minibatches drawn from make_data. Returns (the stats of every
    step (make_step), (the loss over all the data before training, after))."""
    torch.manual_seed(seed)
    model = make_model()
    x, labels = make_data(seed=seed)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ws = tef.init_workspaces(model, recipe)
    before = data_loss(model, recipe, params, ws, x, labels)
    step = make_step(model, recipe, clip=clip, noise_multiplier=noise_multiplier, lr=lr, scope=scope)
    if backend is not None:
        step = torch.compile(step, fullgraph=True, backend=backend)
    history = []
    for i in range(steps):
        idx = torch.randint(x.shape[0], (batch,))
        params, ws, stats = step(params, ws, x[idx], labels[idx])
        history.append(stats)
    return history, (before, data_loss(model, recipe, params, ws, x, labels))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--recipe", choices=RECIPES, default="current")
    parser.add_argument("--scope", choices=tef.vmapped.SCOPES, default="sample")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend, or 'none' for eager")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=0.5)
    args = parser.parse_args(argv)
    history, (before, after) = train(RECIPES[args.recipe], args.steps, clip=args.clip,
                                     noise_multiplier=args.noise_multiplier, scope=args.scope,
                                     backend=None if args.backend == "none" else args.backend)
    for i, stats in enumerate(history):
        print(f"step {i:3d}  loss {stats['loss'].item():.4f}  median per-sample norm "
              f"{stats['norms'].median().item():.3f}  clipped {(stats['norms'] > args.clip).float().mean().item():.0%}")
    print(f"loss over all the data: {before:.4f} before, {after:.4f} after")
    return history, (before, after)


if __name__ == "__main__":
    main()
