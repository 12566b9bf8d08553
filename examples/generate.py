"""Freeze a converted HuggingFace Llama for FP8 inference and generate with a KV cache.

The model is a random init from a LlamaConfig (no download). It is converted with
tef.convert, frozen with tef.freeze (each GEMM weight kept as its FP8 cast only),
and both the bf16 model and the frozen one run greedy `generate()`; the script
prints tokens/s and the resident bytes of each.

    python examples/generate.py                       # a tiny model on the CPU
    python examples/generate.py --device cuda --size 1b [--compile] [--weight-only-tokens 1]

`--compile` generates as transformers compiles decoding: a static KV cache, and each
one-token step through `torch.compile(fullgraph=True, mode="reduce-overhead")` (CUDA
graphs), for both models; `--skip-guards` then times it with dynamo's guard check off
(docs/inference.md, "Serving under reduce-overhead"). On a CPU FP8 is emulated (exact
numerics, not FP8 speed).
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

import te_func as tef
from te_func.recipe import DelayedScaling, Float8CurrentScaling

SIZES = {   # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 128, 2, 4, 2, 128),
    "1b": (2048, 8192, 16, 32, 8, 32000),
    "8b-4layers": (4096, 14336, 4, 32, 8, 32000),
}


def make_model(size: str, device, dtype):
    hidden, inter, layers, heads, kv, vocab = SIZES[size]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device, dtype).eval()


def resident_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def tokens_per_s(model, prompt, new_tokens, device, compiled: bool, skip_guards: bool = False) -> float:
    # transformers compiles the decode step itself when the cache is static (its "auto-compile").
    kw = dict(cache_implementation="static", compile_config=CompileConfig(fullgraph=True)) if compiled else {}

    def run():
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)
    with torch.no_grad():
        run()                                           # warm-up (compiles, when compiled)
        if device.type == "cuda":
            torch.cuda.synchronize()
        # The same generate() was warmed up: every graph it calls is compiled (docs/inference.md).
        stance = torch.compiler.set_stance(skip_guard_eval_unsafe=True) if skip_guards else contextlib.nullcontext()
        with stance:
            t0 = time.perf_counter()
            out = run()
            if device.type == "cuda":
                torch.cuda.synchronize()
    return prompt.shape[0] * new_tokens / (time.perf_counter() - t0), out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--recipe", choices=("current", "delayed"), default="current")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--weight-only-tokens", type=int, default=0,
                        help="calls of at most this many tokens run weight-only FP8 (0: never; 1: the "
                             "one-token decode step, docs/inference.md)")
    parser.add_argument("--compile", action="store_true",
                        help="static KV cache, decode steps compiled with CUDA graphs (transformers' auto-compile)")
    parser.add_argument("--skip-guards", action="store_true",
                        help="after the warm-up, time generate() with dynamo's guard check off "
                             "(torch.compiler.set_stance(skip_guard_eval_unsafe=True)), for both models")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    recipe = Float8CurrentScaling() if args.recipe == "current" else DelayedScaling()

    # Built on the CPU and frozen onto the device: only FP8 casts (and the non-GEMM tensors) move.
    base = make_model(args.size, "cpu", dtype)
    converted = tef.convert(base)
    workspaces = tef.init_workspaces(converted, recipe) if isinstance(recipe, DelayedScaling) else None
    frozen = tef.freeze(converted, recipe, workspaces=workspaces, device=device,
                        weight_only_tokens=args.weight_only_tokens)
    reference = make_model(args.size, device, dtype)   # the same init: plain torch, bf16

    vocab = SIZES[args.size][-1]
    prompt = torch.randint(0, vocab, (args.batch, args.prompt_tokens), device=device)
    rows = []
    for name, model in ((f"{dtype}".removeprefix("torch."), reference), (f"frozen {args.recipe}", frozen)):
        rate, out = tokens_per_s(model, prompt, args.new_tokens, device, args.compile, args.skip_guards)
        rows.append((name, rate, resident_bytes(model), out))
    print(f"HF Llama {args.size} on {device}: batch {args.batch}, {args.prompt_tokens} prompt tokens, "
          f"{args.new_tokens} new, weight_only_tokens={args.weight_only_tokens}, compiled={args.compile}, "
          f"skip_guards={args.skip_guards}")
    print(f"{'model':<18}{'tokens/s':>12}{'resident MiB':>15}")
    for name, rate, size, _ in rows:
        print(f"{name:<18}{rate:>12.1f}{size / 2**20:>15.1f}")
    same = (rows[0][3] == rows[1][3]).float().mean().item()
    print(f"frozen / bf16: {rows[1][1] / rows[0][1]:.2f}x tokens/s, {rows[1][2] / rows[0][2]:.2f}x memory; "
          f"{same:.0%} of generated tokens agree")


if __name__ == "__main__":
    main()
