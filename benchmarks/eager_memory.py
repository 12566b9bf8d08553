"""The peak memory of an eager step on any device, CPU included: the bytes of the storages its ops
allocate that are alive at once.

    python3 benchmarks/eager_memory.py --shape 4096,1024,3584 --out eager_memory.json

Each variant's forward+backward (as `benchmarks/run.py` builds it, eagerly) runs once under a
dispatch mode that records every storage an op returns and polls which of them are still alive:
the step's growth over what it started with, as allocated (no allocator rounding or caching),
plus the step's resident bytes (parameters, workspaces, inputs), as run.py adds them.

Eager allocations do not depend on the device but where the kernels do. Off CUDA (`--as-gpu`,
the default there) te_func's FP8 GEMMs and tensor-wise casts are counted as the GPU runs them:
cuBLAS's `_scaled_mm` and te_func's fused cast, activation and norm kernels allocate only their
outputs, where the CPU's exact emulation dequantizes both GEMM operands to fp32, its torch-code
cast makes an fp32 product and its GELU and norm formulas fp32 temporaries. Scaling the shape
with its ratios kept (tokens : hidden : ffn) scales every tensor by the same factor, so the
ratios to torch bf16 are those of the full-size shape. (The GPU's allocator measures lower than
this count for te_func: 1.22x bf16 against 1.305x counted, H200, 2026-12-02.)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch._C import _functorch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import te_func.ops.gemm_layer as gemm_layer  # noqa: E402
import te_func.kernels as te_kernels  # noqa: E402
import te_func.ops.normalization as normalization  # noqa: E402
import te_func.quant.tensor as quant_tensor  # noqa: E402
from te_func.ops.activations import activation_backward, activation_forward, activation_spec  # noqa: E402
from bench_cases import Inputs, Workload, build  # noqa: E402

VARIANTS = ("torch-bf16", "te-bf16", "te-current", "te-delayed")


class LiveStorages(TorchDispatchMode):
    """Counts the bytes of the storages that ops return, alive at once; `peak` is the most."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def _alive(self) -> int:
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        return sum(n for _, n in self.live.values())

    def record(self, out):
        for t in tree_leaves(out):
            while isinstance(t, torch.Tensor) and _functorch.is_functorch_wrapped_tensor(t):
                t = _functorch.get_unwrapped(t)      # under tef.grad: the tensor under the wrapper
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                key, known = s.data_ptr(), self.live.get(s.data_ptr())
                if key and (known is None or known[0].expired()):     # new, or a freed one's address
                    self.live[key] = (StorageWeakRef(s), s.nbytes())
        self.peak = max(self.peak, self._alive())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.peak = max(self.peak, self._alive())    # what the op's inputs left, before its outputs exist
        out = func(*args, **(kwargs or {}))
        self.record(out)
        return out

    def as_one_kernel(self, fn):
        """fn counted as one kernel that allocates only what it returns."""
        def call(*args, **kwargs):
            self.peak = max(self.peak, self._alive())
            with _disable_current_modes():
                out = fn(*args, **kwargs)
            self.record(out)
            return out
        return call


def _cast_as_the_kernels_do(x, dtype, fp8_max, amax_epsilon, power_2_scale, scale, with_transpose, amax=None):
    """te_func.kernels.tensorwise_cast's results by te_func.quant's torch code (bit-identical)."""
    amax = quant_tensor.amax_of(x) if amax is None else amax
    if scale is None:
        scale = quant_tensor.scale_from_amax(amax, fp8_max, amax_epsilon, power_2_scale)
    data = quant_tensor._cast(x, scale, types.SimpleNamespace(dtype=dtype, fp8_max=fp8_max))     # what _cast reads of a Scheme
    data_t = data.t().contiguous() if with_transpose else None
    return data, data_t, torch.reciprocal(scale.float()), amax


_GELU = activation_spec("gelu")


def _activation_as_the_kernel_does(x, act, y=None, column_sums=False, bias=None):
    """te_func.kernels.activation's results by te_func.ops.activations' formulas (bit-identical)."""
    if bias is not None:
        x, y = (x + bias, y) if act == "gelu" else (x, y + bias)
    v = activation_forward(_GELU, x) if act == "gelu" else activation_backward(_GELU, x, y)
    return v, quant_tensor.amax_of(v), v.sum(0) if column_sums else None


def _norm_forward_as_the_kernel_does(x, gamma, beta, eps, rms):
    """te_func.kernels.norm_forward's results by te_func.ops.normalization's torch code."""
    y, mean, rsigma = normalization.norm_forward(x, gamma, beta, normalization.NormConfig(
        "RMSNorm" if rms else "LayerNorm", eps))
    y = y.to(x.dtype)
    return y, mean, rsigma, quant_tensor.amax_of(y)


def _norm_backward_as_the_kernel_does(dy, x, mean, rsigma, gamma):
    """te_func.kernels.norm_backward's results by te_func.ops.normalization's torch code (the kernel
    keeps no (tokens, hidden) temporary: only its outputs count)."""
    x_hat = normalization._normalized(x, mean, rsigma, torch.float32)
    dx = normalization._norm_dx(dy, x_hat, gamma, rsigma, mean is not None).to(x.dtype)
    return dx, (dy * x_hat).sum(0), dy.sum(0, dtype=torch.float32)


class _AsGpu:
    """While entered, `mode` counts te_func's GEMMs, tensor-wise casts, fused activations and norms
    as single GPU kernels."""

    def __init__(self, mode: LiveStorages):
        self.mode, self.saved = mode, []

    def __enter__(self):
        for owner, name, fn in ((gemm_layer, "gemm", gemm_layer.gemm),
                                (quant_tensor, "tensorwise_cast", _cast_as_the_kernels_do),
                                (te_kernels, "activation", _activation_as_the_kernel_does),
                                (te_kernels, "norm_forward", _norm_forward_as_the_kernel_does),
                                (te_kernels, "norm_backward", _norm_backward_as_the_kernel_does)):
            self.saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, self.mode.as_one_kernel(fn))

    def __exit__(self, *exc):
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)


def eager_peak(variant: str, shape: tuple[int, int, int], device, as_gpu: bool) -> dict:
    w = Workload(f"eager_mlp_{'x'.join(map(str, shape))}", "mlp", shape, compiled=False)
    step = build(variant, w, Inputs(device), compile_ok=False)
    step.fn()                           # first call: the workspaces' first casts, lazy inits
    step.reset()
    mode = LiveStorages()
    with mode, (_AsGpu(mode) if as_gpu else contextlib.nullcontext()):
        out = step.fn()
        del out
    return {"variant": variant, "shape": list(shape), "device": str(device), "as_gpu": as_gpu,
            "growth_bytes": mode.peak, "resident_bytes": step.resident_bytes,
            "peak_gib": round((mode.peak + step.resident_bytes) / 2**30, 4)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4096,1024,3584", help="tokens,hidden,ffn")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--as-gpu", action=argparse.BooleanOptionalAction, default=None,
                   help="count te_func's GEMMs and casts as the GPU's kernels (default: off CUDA)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    device = torch.device(args.device)
    as_gpu = device.type != "cuda" if args.as_gpu is None else args.as_gpu
    rows = [eager_peak(v, shape, device, as_gpu) for v in args.variants.split(",")]
    total = lambda r: r["growth_bytes"] + r["resident_bytes"]  # noqa: E731
    base = next((total(r) for r in rows if r["variant"] == "torch-bf16"), None)
    for r in rows:
        if base:
            r["x_bf16"] = round(total(r) / base, 4)
        print(json.dumps(r), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
