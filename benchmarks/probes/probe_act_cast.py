"""Probe: the GELU output's current-scaling cast at decode sizes in one launch, and FP8 accumulation.

    python3 benchmarks/probes/probe_act_cast.py     # on the GPU; writes $OUT/act_cast.json (default /tmp)

Part 1. Under Float8CurrentScaling a frozen LayerNormMLP casts GELU(fc1 out + bias) with a scale
from its amax, so the cast waits for a reduction over the whole tensor: inductor runs that as a
split reduction and a cast kernel. At (16, 14336) each launch costs more than its bytes. Compared,
each replayed from a CUDA graph:
  inductor   te_func's torch code (`activation_forward`, `quantize_scheme`) compiled;
  kernels    te_func's eager kernels (GELU + amax in one pass, then the cast): two launches;
  one launch a cooperative kernel: every program computes its tile's GELU and max, writes the max
             into its own slot, waits at a grid barrier, takes the max of the slots and casts its
             tile from registers. The bits must equal `kernels`'.
Part 2. Triton's FP8 `tl.dot` on sm_90 accumulates in the tensor cores' reduced precision unless
`max_num_imprecise_acc` says otherwise (Triton's default there is 2**30: never promoted). The error
of each accumulation against float64, next to cuBLAS's `_scaled_mm` with and without fast
accumulation, on the same FP8 operands.

Not used by te_func; results in docs/benchmarks.md, "Decode casts in one launch".
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from te_func.kernels import cast as K  # noqa: E402
from te_func.ops.activations import activation_forward, activation_spec  # noqa: E402
from te_func.quant import quantize_scheme, scheme_for  # noqa: E402
from te_func.recipe import Float8CurrentScaling  # noqa: E402
from inference import captured  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _grid_barrier(bar_ptr, nprog):
    # Sense-reversing barrier on (count, generation) int32: the last program to arrive resets the
    # count and opens the next generation. Atomics are acq_rel at GPU scope, so what any program
    # stored before arriving is seen by every program after leaving.
    gen = tl.atomic_add(bar_ptr + 1, 0)
    if tl.atomic_add(bar_ptr, 1) == nprog - 1:
        tl.atomic_xchg(bar_ptr, 0)
        tl.atomic_add(bar_ptr + 1, 1)
    else:
        while tl.atomic_add(bar_ptr + 1, 0) == gen:
            pass


@triton.jit
def _gelu_cast_one_launch(x_ptr, b_ptr, out_ptr, scale_inv_ptr, slots_ptr, bar_ptr, numel, N, fp8_max,
                          amax_epsilon, FP8: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr,
                          SLOTS: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    a = K._round_to(x.to(tl.float32) + tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32), x.dtype)
    v = tl.where(mask, K._round_to(K._gelu(a), x.dtype), 0.0)
    m = tl.max(tl.where(v != v, 0.0, tl.abs(v)).to(tl.int32, bitcast=True), axis=0)
    tl.atomic_xchg(slots_ptr + pid, m)     # an atomic: thread 0's, ordered before its arrival
    _grid_barrier(bar_ptr, nprog)
    s = tl.arange(0, SLOTS)
    slots = tl.load(slots_ptr + s, mask=s < nprog, other=0, volatile=True)
    amax = tl.max(slots, axis=0).to(tl.float32, bitcast=True)
    scale = K._scale_from_amax(amax, fp8_max, amax_epsilon, POW2)
    if pid == 0:
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0 + tl.zeros_like(scale), scale))
    w = v * scale
    q = tl.minimum(tl.maximum(w, -fp8_max), fp8_max).to(FP8).to(tl.uint8, bitcast=True)
    sign = ((w.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    tl.store(out_ptr + offs, tl.where(w != w, sign | 0x7F, q), mask=mask)


class OneLaunch:
    def __init__(self, dev):
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.bar = torch.zeros(2, dtype=torch.int32, device=dev)
        self.slots = torch.empty(triton.next_power_of_2(self.sms), dtype=torch.int32, device=dev)

    def __call__(self, h, b, scheme):
        numel = h.numel()
        block = max(1024, triton.next_power_of_2(triton.cdiv(numel, self.sms)))
        grid = triton.cdiv(numel, block)
        out = torch.empty(h.shape, dtype=scheme.dtype, device=h.device)
        scale_inv = torch.empty((), dtype=torch.float32, device=h.device)
        fp8 = K._FP8[scheme.dtype][0]
        _gelu_cast_one_launch[(grid,)](h, b, out.view(torch.uint8), scale_inv, self.slots, self.bar, numel,
                                       h.shape[1], scheme.fp8_max, scheme.amax_epsilon, FP8=fp8,
                                       POW2=scheme.power_2_scale, BLOCK=block, SLOTS=self.slots.numel(),
                                       num_warps=8, enable_fp_fusion=False, launch_cooperative_grid=True)
        return out, scale_inv


def part1(dev, res):
    from triton.testing import do_bench
    act, scheme = activation_spec("gelu"), scheme_for(Float8CurrentScaling(), "input")

    def torch_code(h, b):
        q, _ = quantize_scheme(activation_forward(act, h + b), scheme)
        return q.data, q.scale_inv
    compiled = torch.compile(torch_code, fullgraph=True)

    def kernels(h, b):
        v, bits, _ = K.activation(h, None, "gelu", False, b)
        data, _, scale_inv, _ = K.cast(v, scheme.dtype, scheme.fp8_max, scheme.amax_epsilon,
                                       scheme.power_2_scale, None, False, amax=bits)
        return data, scale_inv
    one = OneLaunch(dev)
    for m in (1, 16, 64, 128):
        torch.manual_seed(m)
        h = torch.randn(m, 14336, device=dev, dtype=torch.bfloat16) * 2
        b = torch.randn(14336, device=dev, dtype=torch.bfloat16) * 0.1
        row = {"tokens": m}
        ref = kernels(h, b)
        for name, fn in (("inductor", compiled), ("kernels", kernels), ("one_launch", lambda h_, b_: one(h_, b_, scheme))):
            try:
                got = fn(h, b)
                row[f"{name}_bits_equal_kernels"] = bool(torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
                                                          and torch.equal(got[1], ref[1]))
                replay = captured(lambda x: fn(x, b), h)
                got = replay(h)
                row[f"{name}_graph_bits_equal"] = bool(torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)))
                for _ in range(3):     # replays reuse the barrier: it must reset itself
                    got = replay(h)
                torch.cuda.synchronize()
                row[f"{name}_us"] = 1000 * do_bench(lambda: replay(h), warmup=100, rep=500, return_mode="median")
            except Exception as e:      # noqa: BLE001 - a probe reports what failed
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        res.append(row)


@triton.jit
def _fp8_dot(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             IMPRECISE: tl.constexpr):
    pid_n = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(b_ptr + rn[None, :] * K + (k0 + rk)[:, None])
        if IMPRECISE < 0:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=rm[:, None] < M)


def part2(dev, res):
    for m, n, k in ((16, 14336, 4096), (16, 4096, 14336), (64, 4096, 14336), (128, 4096, 14336)):
        torch.manual_seed(k)
        a = (torch.randn(m, k, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        ref = a.double() @ w.double().t()
        one = torch.ones((), device=dev)

        def err(c):
            c = c.double()
            return {"norm_rel": ((c - ref).norm() / ref.norm()).item(),
                    "max_abs_over_rms": ((c - ref).abs().max() / ref.pow(2).mean().sqrt()).item()}
        row = {"m": m, "n": n, "k": k}
        for fast in (True, False):
            row[f"scaled_mm_fast_accum_{fast}"] = err(torch._scaled_mm(a, w.t(), one, one, out_dtype=torch.float32,
                                                                      use_fast_accum=fast))
        bm = max(16, triton.next_power_of_2(m))
        for imprecise in (-1, 0, 32, 128):
            c = torch.empty(m, n, device=dev)
            try:
                _fp8_dot[(n // 128,)](a, w, c, m, n, k, BLOCK_M=bm, BLOCK_N=128, BLOCK_K=128, IMPRECISE=imprecise,
                                      num_warps=4, num_stages=3)
                row[f"triton_imprecise_{'default' if imprecise < 0 else imprecise}"] = err(c)
            except Exception as e:      # noqa: BLE001
                row[f"triton_imprecise_{imprecise}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        res.append(row)


def main():
    dev = torch.device("cuda")
    res = {"act_cast": [], "accumulation": []}
    part2(dev, res["accumulation"])
    with torch.no_grad():
        part1(dev, res["act_cast"])
    json.dump(res, open(f"{OUT}/act_cast.json", "w"), indent=1)


if __name__ == "__main__":
    main()
