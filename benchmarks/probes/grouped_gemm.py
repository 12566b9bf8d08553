"""The grouped FP8 GEMM against its loop and bf16: per-sample weight-gradient shapes (G samples of
(M, K) x (N, K)), one number each (ms, CUDA events via triton's do_bench), printed as a table.

    python3 benchmarks/probes/grouped_gemm.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from te_func import kernels  # noqa: E402
from te_func.gemm import _grouped_scaled_mm  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(32, 4096, 1024, 512), (32, 1024, 4096, 512), (32, 512, 4096, 1024), (8, 4096, 4096, 4096)]


def row(g: int, m: int, n: int, k: int, dev: torch.device) -> str:
    a, b = torch.randn(g, m, k, device=dev), torch.randn(g, n, k, device=dev)
    a16, b16t = a.bfloat16(), b.bfloat16().transpose(1, 2)
    a8, b8, a5 = a.to(E4M3), b.to(E4M3), a.to(E5M2)
    sa, sb = torch.rand(g, device=dev) + 0.5, torch.rand(g, device=dev) + 0.5
    bf16 = do_bench(lambda: torch.bmm(a16, b16t))
    grouped = do_bench(lambda: _grouped_scaled_mm(a8, b8, sa, sb, torch.bfloat16, False))
    mixed = do_bench(lambda: _grouped_scaled_mm(a5, b8, sa, sb, torch.bfloat16, False))
    kernels.set_cast_kernels(False)
    loop = do_bench(lambda: _grouped_scaled_mm(a8, b8, sa, sb, torch.bfloat16, False))
    kernels.set_cast_kernels(True)
    # torch's CUTLASS grouped GEMM (E4M3 x E4M3 only): rowwise scales, a per-tensor one repeated.
    row_a, col_b = sa[:, None].expand(g, m).contiguous(), sb[:, None].expand(g, n).contiguous()
    try:
        def torch_grouped():
            return torch._scaled_grouped_mm(a8, b8.transpose(1, 2), row_a, col_b, out_dtype=torch.bfloat16)
        want = _grouped_scaled_mm(a8, b8, sa, sb, torch.bfloat16, False).float()
        err = ((torch_grouped().float() - want).norm() / want.norm()).item()
        cutlass = f"{do_bench(torch_grouped):.4f} (rel. diff {err:.1e})"
    except Exception as e:      # noqa: BLE001 (a probe: say why)
        cutlass = f"{type(e).__name__}: {str(e)[:80]}"
    return (f"| {g}, {m}, {n}, {k} | {bf16:.4f} | {loop:.4f} | {grouped:.4f} | {bf16 / grouped:.2f} | {mixed:.4f} "
            f"| {cutlass} |")


def main():
    dev = torch.device("cuda")
    print("| G, M, N, K | bf16 bmm ms | FP8 loop ms | FP8 grouped ms | grouped x bf16 | E5M2 x E4M3 grouped ms "
          "| torch._scaled_grouped_mm ms |")
    print("|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        print(row(*shape, dev), flush=True)


if __name__ == "__main__":
    main()
