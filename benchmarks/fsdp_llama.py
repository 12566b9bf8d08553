"""FSDP2 training of a HuggingFace Llama on N GPUs: bf16 vs torchao float8 vs te_func.

    torchrun --standalone --nproc_per_node 8 benchmarks/fsdp_llama.py [--layers 4] [--only te-current,...]

A LlamaForCausalLM, randomly initialized from a config (bf16 parameters), every
decoder layer and the root under `fully_shard`, compiled (`torch.compile` of the
whole model, or of te_func's Stateful shell around it), trained with AdamW on
random tokens. Rank 0 prints one JSON line per variant: tokens/s per GPU (the
median step after warm-up) and the peak memory of the busiest GPU.

Variants:
    bf16                      the model as HuggingFace builds it
    torchao-tensorwise-fp8ag  torchao's convert_to_float8_training, tensorwise, FP8 all-gather,
                              scales precomputed after each optimizer step (one all-reduce)
    te-current[-fp8ag]        te_func Linear layers, Float8CurrentScaling, without / with FP8 all-gather
    te-delayed[-fp8ag]        te_func Linear layers, DelayedScaling, without / with FP8 all-gather

Only nn.Linear layers are converted (not lm_head, nor layers whose sizes are not
multiples of 16), as torchao's float8 training converts them. transformers and
torchao are imported only when a variant needs them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# NVLink SHARP and multicast off, in this process and any it starts.
for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _value)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # te_func from this checkout

import torch  # noqa: E402
from torch import nn  # noqa: E402


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str                   # "bf16", "torchao" or "te"
    recipe: str | None = None   # te_func: "current" or "delayed"
    fp8_all_gather: bool = False


VARIANTS = [Variant("bf16", "bf16"),
            Variant("torchao-tensorwise-fp8ag", "torchao", fp8_all_gather=True),
            Variant("te-current", "te", "current"), Variant("te-current-fp8ag", "te", "current", True),
            Variant("te-delayed", "te", "delayed"), Variant("te-delayed-fp8ag", "te", "delayed", True)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2, help="sequences per GPU and step")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--only", default="", help="comma-separated variant names")
    return p.parse_args(argv)


def selected(args) -> list[Variant]:
    """The variants `--only` names (all without it), in VARIANTS' order."""
    if not args.only:
        return list(VARIANTS)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(names) - {v.name for v in VARIANTS}
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose among {[v.name for v in VARIANTS]}")
    return [v for v in VARIANTS if v.name in names]


def llama_config_kwargs(args) -> dict:
    """LlamaConfig's arguments for the model this run trains."""
    return dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                max_position_embeddings=args.seq, torch_dtype="bfloat16", attn_implementation="sdpa")


def convertible(module: nn.Module, fqn: str) -> bool:
    """Which nn.Linear layers run in FP8: not the output head; sizes multiples of 16 (FP8 GEMMs)."""
    return (isinstance(module, nn.Linear) and not fqn.endswith("lm_head")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def result_line(variant: Variant, args, world: int, step_seconds: list[float], peak_bytes: int) -> dict:
    """The JSON record of one variant: tokens/s per GPU from the median step, peak GiB on the busiest GPU."""
    median = statistics.median(step_seconds)
    return {"variant": variant.name, "status": "ok", "world_size": world,
            "tokens_per_s_per_gpu": round(args.batch * args.seq / median, 1),
            "step_ms": round(median * 1e3, 2), "peak_mem_gib_per_gpu": round(peak_bytes / 2**30, 3),
            "layers": args.layers, "hidden": args.hidden, "seq": args.seq, "batch_per_gpu": args.batch,
            "compiled": not args.no_compile}


# --- what needs GPUs ------------------------------------------------------------------------

def _recipe(name: str):
    from te_func.recipe import DelayedScaling, Float8CurrentScaling
    return {"current": Float8CurrentScaling(), "delayed": DelayedScaling()}[name]


def build(variant: Variant, args, device):
    """(train step callable, model) for `variant`: sharded, compiled, with its optimizer."""
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    import te_func as tef

    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(LlamaConfig(**llama_config_kwargs(args))).to(torch.bfloat16)
    after_step = None
    if variant.kind == "torchao":
        from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                    precompute_float8_dynamic_scale_for_fsdp)
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                   module_filter_fn=convertible)
        after_step = lambda: precompute_float8_dynamic_scale_for_fsdp(model)  # noqa: E731
    elif variant.kind == "te":
        tef.convert(model, module_filter_fn=convertible)
        if variant.fp8_all_gather:
            tef.distributed.enable_fsdp_float8_all_gather(model, _recipe(variant.recipe))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    runner = tef.Stateful(model, _recipe(variant.recipe)) if variant.kind == "te" else model
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-5, fused=True)
    forward = runner if args.no_compile else torch.compile(runner)

    def step(tokens):
        loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        return loss

    return step, model


def run_variant(variant: Variant, args, device, world: int) -> dict:
    import torch.distributed as dist
    step, model = build(variant, args, device)
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=g)
    for _ in range(args.warmup):
        step(tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(tokens)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    # the slowest rank's steps and the busiest GPU's memory
    times = torch.tensor(seconds, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    peak = torch.tensor([torch.cuda.max_memory_allocated()], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del step, model
    return result_line(variant, args, world, times.tolist(), int(peak.item()))


def main(argv=None):
    args = parse_args(argv)
    variants = selected(args)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fsdp_llama.py runs on GPUs: start it with torchrun on a CUDA machine")
    import torch.distributed as dist
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    try:
        for variant in variants:
            try:
                line = run_variant(variant, args, device, dist.get_world_size())
            except Exception as e:   # one variant's failure (a missing package) does not stop the others
                line = {"variant": variant.name, "status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
            if dist.get_rank() == 0:
                print(json.dumps(line), flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
