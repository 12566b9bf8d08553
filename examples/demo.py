"""Train a small HuggingFace Llama, converted with tef.convert, in high precision and in FP8.

The model (random init from a config: no download) learns a toy language in which
each token follows from the previous one by a fixed rule, so the loss has
somewhere to go. The same model, data and seed for every recipe; each trains
through `tef.Stateful` with AdamW, two microbatches per step (the weights are
cast to FP8 once per step, at the first microbatch). At the end it prints a
table of losses and saves the loss curves as a PNG.

    python examples/demo.py [--steps 40] [--out demo_loss.png]

On a CPU there are no FP8 tensor cores: te_func emulates the FP8 GEMMs exactly
(same numbers as a GPU's, up to accumulation order), so this shows FP8's
numerics, not its speed. On a CUDA GPU it runs in bf16 and uses the FP8 GEMMs.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import te_func as tef
from te_func.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling)

VOCAB, SEQ, BATCH, MICROBATCHES = 64, 32, 8, 2


def recipes(high_precision: str):
    return [(high_precision, None),
            ("current", Float8CurrentScaling()),
            ("mxfp8", MXFP8BlockScaling()),
            ("block", Float8BlockScaling()),
            ("delayed", DelayedScaling(amax_history_len=16))]


def make_model(device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return tef.convert(LlamaForCausalLM(config).to(device, dtype))


def make_data(steps, device):
    """(steps, microbatches, BATCH, SEQ) token ids: token t+1 = (5 * token t + 3) mod VOCAB,
    from a random first token, with one token in sixteen replaced by noise."""
    g = torch.Generator().manual_seed(1)
    ids = torch.empty(steps, MICROBATCHES, BATCH, SEQ, dtype=torch.long)
    ids[..., 0] = torch.randint(0, VOCAB, ids.shape[:-1], generator=g)
    for t in range(1, SEQ):
        ids[..., t] = (5 * ids[..., t - 1] + 3) % VOCAB
    noise = torch.rand(ids.shape, generator=g) < 1 / 16
    ids[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=g)
    return ids.to(device)


def train(base, recipe, data, bar):
    shell = tef.Stateful(copy.deepcopy(base), recipe)
    opt = torch.optim.AdamW(shell.parameters(), lr=1e-2)
    losses = []
    for step in range(data.shape[0]):
        total = 0.0
        for i in range(MICROBATCHES):
            ids = data[step, i]
            loss = shell(input_ids=ids, labels=ids, is_first_microbatch=i == 0).loss
            (loss / MICROBATCHES).backward()
            total += loss.item() / MICROBATCHES
        opt.step()
        opt.zero_grad()
        losses.append(total)
        bar.set_postfix(loss=f"{total:.3f}")
        bar.update(1)
    return losses


def plot(curves: dict, path: str, device: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=2 if name in ("fp32", "bf16") else 1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(f"HF Llama (2 layers, hidden 64) converted with tef.convert, on {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    from tqdm import tqdm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="demo_loss.png", help="where the loss-curve PNG goes")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    high = "bf16" if dtype == torch.bfloat16 else "fp32"
    print(f"te_func demo: a 2-layer HF Llama, {args.steps} steps x {MICROBATCHES} microbatches x {BATCH} x "
          f"{SEQ} tokens, on {device} ({high} high precision)")
    if device == "cpu":
        print("No GPU here: FP8 is emulated on the CPU (exact FP8 numerics, not FP8 speed).")
    base, data = make_model(device, dtype), make_data(args.steps, device)
    curves, seconds = {}, {}
    for name, recipe in recipes(high):
        t0 = time.perf_counter()
        with tqdm(total=args.steps, desc=f"{name:>8}", ncols=80, leave=True) as bar:
            curves[name] = train(base, recipe, data, bar)
        seconds[name] = time.perf_counter() - t0
    print(f"\n{'recipe':<10}{'first':>10}{'final':>10}{'vs ' + high:>10}{'time s':>10}")
    for name, losses in curves.items():
        print(f"{name:<10}{losses[0]:>10.4f}{losses[-1]:>10.4f}{losses[-1] / curves[high][-1]:>10.3f}"
              f"{seconds[name]:>10.1f}")
    plot(curves, args.out, device)
    print(f"\nloss curves saved to {args.out}")


if __name__ == "__main__":
    main()
