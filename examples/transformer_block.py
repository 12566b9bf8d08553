"""A pre-norm transformer block built from te_func layers, trained functionally.

    x -> LayerNormLinear (fused QKV) -> causal attention -> Linear + residual
      -> LayerNormMLP (swiglu) + residual

Each recipe trains the same initial block for a few steps with
tef.value_and_grad and plain SGD, printing the loss.

    python examples/transformer_block.py --steps 20
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

import te_func as tef
from te_func.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

# "high": high precision (the parameters' dtype, float32 here).
RECIPES = {"high": None, "current": Float8CurrentScaling(), "mxfp8": MXFP8BlockScaling(),
           "block": Float8BlockScaling(), "delayed": DelayedScaling(amax_history_len=16)}


class Block(nn.Module):
    def __init__(self, hidden: int = 64, heads: int = 4, ffn: int = 128):
        super().__init__()
        self.heads = heads
        self.qkv = tef.nn.LayerNormLinear(hidden, 3 * hidden)
        self.proj = tef.nn.Linear(hidden, hidden)
        self.mlp = tef.nn.LayerNormMLP(hidden, ffn, normalization="RMSNorm", activation="swiglu")

    def forward(self, x):                                       # x: (batch, seq, hidden)
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)                  # each (batch, seq, hidden)
        q, k, v = (t.reshape(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # (batch, heads, seq, head_dim)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(x)


def train(block: nn.Module, recipe, steps: int, lr: float = 2.0, seed: int = 0) -> list[float]:
    """SGD on a next-token-like regression: predict x shifted by one position."""
    gen = torch.Generator().manual_seed(seed)
    params = {k: v.detach().clone() for k, v in block.named_parameters()}
    ws = tef.init_workspaces(block, recipe)

    def loss_fn(params, ws, x, y):
        out, new_ws = tef.functional_call(block, params, ws, (x,), recipe=recipe)
        return F.mse_loss(out, y), new_ws

    step = tef.value_and_grad(loss_fn)
    x = torch.randn(4, 16, 64, generator=gen)
    y = torch.roll(x, -1, dims=1)
    losses = []
    for _ in range(steps):
        loss, grads, ws = step(params, ws, x, y)
        params = {k: p - lr * grads[k] for k, p in params.items()}
        losses.append(loss.item())
    return losses


def main(steps: int = 10) -> dict[str, list[float]]:
    torch.manual_seed(0)
    block = Block()
    results = {}
    for name, recipe in RECIPES.items():
        losses = train(copy.deepcopy(block), recipe, steps)
        results[name] = losses
        print(f"{name:8s} " + " ".join(f"{v:.4f}" for v in losses))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    main(parser.parse_args().steps)
