"""How long torch.compile takes on one Experts layer's forward and backward, on any device (CPU
here): dynamo interprets te_func's Python once per GEMM, 2 per expert.

    python3 benchmarks/probes/experts_compile.py 128 current
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import te_func as tef  # noqa: E402
from te_func.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402


def main():
    experts, rid = int(sys.argv[1]), sys.argv[2]
    recipe = DelayedScaling() if rid == "delayed" else Float8CurrentScaling()
    layer = tef.nn.Experts(experts, 64, 32)
    x = torch.randn(512, 64, requires_grad=True)
    weights, index = torch.topk(torch.softmax(torch.randn(512, experts), -1), min(8, experts), -1)
    ws, params = tef.init_workspaces(layer, recipe), dict(layer.named_parameters())
    fwd = torch.compile(lambda x, index, weights, ws: tef.functional_call(
        layer, params, ws, (x, index, weights), recipe=recipe, is_first_microbatch=False)[0], fullgraph=True)
    start = time.perf_counter()
    fwd(x, index, weights, ws).sum().backward()
    print(f"{experts} experts, {rid}: compile and first step {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
