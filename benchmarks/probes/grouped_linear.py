"""GroupedLinear with its token counts on the device against torch's bf16 grouped GEMM: forward and
backward of one expert projection (x (T, K) routed to G experts, W (G, N, K)), ms by CUDA events
(triton's do_bench), eager, the weight casts cached (is_first_microbatch=False).

    python3 benchmarks/probes/grouped_linear.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import te_func as tef  # noqa: E402
from te_func.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

SHAPES = [(8, 4096, 14336, 16384), (128, 2048, 768, 65536)]      # experts, in, out, routed tokens


def row(g: int, k: int, n: int, t: int, dev: torch.device) -> str:
    torch.manual_seed(0)
    counts = torch.distributions.Multinomial(t, torch.ones(g)).sample().to(dev, torch.int64)
    x = torch.randn(t, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(g, n, k, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    offs = counts.cumsum(0).to(torch.int32)

    def bf16():
        torch._grouped_mm(x, w.transpose(1, 2), offs=offs).backward(dy)
    cells = [f"{do_bench(bf16):.3f}"]
    layer = tef.nn.GroupedLinear(g, k, n, bias=False, params_dtype=torch.bfloat16, device=dev)
    params = dict(layer.named_parameters())
    for recipe in (Float8CurrentScaling(), DelayedScaling()):
        ws = tef.init_workspaces(layer, recipe)

        def te(ws=ws, recipe=recipe):
            out, _ = tef.functional_call(layer, params, ws, (x, counts), recipe=recipe, is_first_microbatch=False)
            out.backward(dy)
        try:
            ms = do_bench(te)
            cells.append(f"{ms:.3f} ({float(cells[0]) / ms:.2f}x)")
        except Exception as e:      # noqa: BLE001 (a probe: say why)
            cells.append(f"{type(e).__name__}: {str(e)[:60]}")
    return f"| {g}, {k}, {n}, {t} | " + " | ".join(cells) + " |"


def main():
    dev = torch.device("cuda")
    print("| G, K, N, T | torch bf16 _grouped_mm ms | te_func current ms | te_func delayed ms |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        print(row(*shape, dev), flush=True)


if __name__ == "__main__":
    main()
