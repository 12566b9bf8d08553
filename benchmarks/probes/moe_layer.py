"""One mixture-of-experts layer's experts, forward and backward: te_func's Experts (FP8, counts on the
device) against the same experts in torch bf16 `_grouped_mm` (transformers' grouped_mm forward:
sort, gather, two grouped GEMMs, weighting, sum), both compiled, ms by CUDA events (triton's
do_bench) and the peak memory of one step. Routing: a fixed random top-k of a router's softmax.

    python3 benchmarks/probes/moe_layer.py [--eager] [8] [128]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import te_func as tef  # noqa: E402
from te_func.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

SHAPES = [(128, 2048, 768, 8, 16384), (8, 4096, 14336, 2, 16384)]   # experts, hidden, intermediate, top-k, tokens


def bf16_experts(x, index, weights, gate_up, down):
    """transformers' grouped_mm_experts_forward, in torch alone."""
    k, e = index.shape[1], gate_up.shape[0]
    ids = index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    offs = torch.cumsum(torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
        0, ids, torch.ones_like(ids, dtype=torch.int32)), 0, dtype=torch.int32)
    h = torch._grouped_mm(x[order // k], gate_up.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, -1)
    y = torch._grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1)[order].unsqueeze(-1)
    return torch.empty_like(y).index_copy(0, order, y).view(-1, k, y.shape[-1]).sum(1).to(x.dtype)


def profile(name: str, fn) -> None:
    """The step's GPU kernels by total time (--profile)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    fn()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print(f"\n{name}, 3 steps:\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                                               max_name_column_width=70), flush=True)


def measure(fn) -> tuple[float, float]:
    if "--profile" in sys.argv:
        profile(getattr(fn, "label", "step"), fn)
        return do_bench(fn, rep=20), 0.0
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return do_bench(fn), peak


def row(e, hidden, inter, k, tokens, compiled: bool) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layer = tef.nn.Experts(e, hidden, inter, params_dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.softmax(torch.randn(tokens, e, device=dev), -1)
    weights, index = torch.topk(probs, k, -1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    dy = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
    wrap = (lambda f: torch.compile(f, fullgraph=True)) if compiled else (lambda f: f)

    base_fwd = wrap(bf16_experts)

    def bf16():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        base_fwd(x, index, weights, layer.gate_up_proj, layer.down_proj).backward(dy)
    bf16.label = "torch bf16"
    ms0, mem0 = measure(bf16)
    cells = [f"{ms0:.3f} / {mem0:.2f}"]
    print(f"| {e}, {hidden}, {inter}, top-{k}, {tokens} | {cells[0]} |", end="", flush=True)
    params = dict(layer.named_parameters())
    for recipe in (Float8CurrentScaling(), DelayedScaling()):
        ws = tef.init_workspaces(layer, recipe)
        fwd = wrap(lambda x, index, weights, ws, recipe=recipe: tef.functional_call(
            layer, params, ws, (x, index, weights), recipe=recipe, is_first_microbatch=False)[0])

        def te(fwd=fwd, ws=ws):
            x.grad = None
            layer.zero_grad(set_to_none=True)
            fwd(x, index, weights, ws).backward(dy)
        te.label = f"te_func {type(recipe).__name__}"
        if "--profile" in sys.argv and isinstance(recipe, DelayedScaling):
            continue
        try:
            ms, mem = measure(te)
            cells.append(f"{ms:.3f} / {mem:.2f} ({ms0 / ms:.2f}x)")
        except Exception as err:      # noqa: BLE001 (a probe: say why)
            cells.append(f"{type(err).__name__}: {str(err)[:80]}")
        print(f" {cells[-1]} |", end="", flush=True)
    print(flush=True)


def main():
    compiled = "--eager" not in sys.argv
    print(f"{'compiled (fullgraph)' if compiled else 'eager'}; ms / peak GiB of one fwd+bwd step")
    print("| experts, hidden, intermediate, top-k, tokens | torch bf16 _grouped_mm | te_func current | "
          "te_func delayed |")
    print("|---|---|---|---|")
    only = [a for a in sys.argv[1:] if a.isdigit()]         # experts counts to run, e.g. 8
    for shape in SHAPES:
        if not only or str(shape[0]) in only:
            row(*shape, compiled)


if __name__ == "__main__":
    main()
