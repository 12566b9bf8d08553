"""Probe: a frozen LayerNormMLP at few tokens in three kernels, against bf16 and tef.freeze.

    python3 benchmarks/probes/probe_decode_fused.py   # on the GPU; writes $OUT/fused_mlp.json (default /tmp)

Two LayerNormMLP 4096x14336 blocks under current scaling, each as: LayerNorm + amax + cast
(inductor), fc1's FP8 GEMM with bias, GELU(tanh) and the GELU output's amax (an atomic max)
in its epilogue, fc2's FP8 GEMM casting its bf16 input on load with the scale from that
amax (K split), and one kernel summing the splits with the bias. Timed replayed from one
CUDA graph against the bf16 torch block and tef.freeze's (Float8CurrentScaling), same
process. Not used by te_func, and not exact: its weights are random FP8 casts of its own,
its output is compared to a torch emulation (printed "err", norm-relative), not to
te_func's bits (docs/benchmarks.md, "Decode kernels probed").
"""
import json, os, sys
import torch, triton, triton.language as tl
from triton.language.extra import libdevice
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import te_func as tef
from te_func.recipe import Float8CurrentScaling
from inference import TorchMLP, captured, frozen_blocks
OUT = os.environ.get("OUT", "/tmp")
E4M3 = 448.0
_INTERP = tl.constexpr(os.environ.get('TRITON_INTERPRET') == '1')


@triton.jit
def _tanh(x):
    if _INTERP:
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0
    else:
        return libdevice.tanh(x)


@triton.jit
def fc1_gelu(x_ptr, w_ptr, sx_ptr, sw_ptr, b_ptr, h_ptr, amax_ptr, M, N, K,
             BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        w = tl.load(w_ptr + rows[:, None] * K + k[None, :])
        xt = tl.load(x_ptr + toks[None, :] * K + k[:, None], mask=toks[None, :] < M, other=0.0)
        acc = tl.dot(w, xt, acc)
    y = (acc * (tl.load(sx_ptr) * tl.load(sw_ptr))).to(tl.bfloat16)
    y = (y.to(tl.float32) + tl.load(b_ptr + rows)[:, None].to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    g = (0.5 * y * (1.0 + _tanh(0.7978845608028654 * (y + 0.044715 * y * y * y)))).to(tl.bfloat16)
    where = toks[None, :] < M
    tl.store(h_ptr + toks[None, :] * N + rows[:, None], g, mask=where)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.where(where, tl.abs(g.to(tl.float32)), 0.0), 1), 0))


@triton.jit
def fc2_cast(h_ptr, amax_ptr, w_ptr, part_ptr, M, N, K, K_PER_SPLIT,
             BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    scale = 448.0 / tl.load(amax_ptr)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        k = k0 + ks
        w = tl.load(w_ptr + rows[:, None] * K + k[None, :])
        ht = tl.load(h_ptr + toks[None, :] * K + k[:, None], mask=toks[None, :] < M, other=0.0)
        hq = tl.clamp(ht.to(tl.float32) * scale, -448.0, 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        acc = tl.dot(w, hq, acc)
    tl.store(part_ptr + (pid_k * M + toks[None, :]) * N + rows[:, None], acc, mask=toks[None, :] < M)


@triton.jit
def sum_bias(part_ptr, amax_ptr, sw_ptr, b_ptr, out_ptr, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    numel = M * N
    acc = tl.load(part_ptr + i, mask=i < numel, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * numel + i, mask=i < numel, other=0.0)
    y = (acc * ((tl.load(amax_ptr) / 448.0) * tl.load(sw_ptr))).to(tl.bfloat16)
    y = (y.to(tl.float32) + tl.load(b_ptr + i % N, mask=i < numel, other=0.0).to(tl.float32)).to(tl.bfloat16)
    tl.store(out_ptr + i, y, mask=i < numel)


def ln_cast(x, w, b):
    ln = torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    amax = ln.abs().amax().float()
    s = E4M3 / amax
    return (ln.float() * s).clamp(-E4M3, E4M3).to(torch.float8_e4m3fn), (1.0 / s).reshape(())


ln_cast_c = torch.compile(ln_cast, fullgraph=True)


class Fused:
    def __init__(self, hidden, ffn, dev, cfg1, cfg2):
        self.layers = []
        for _ in range(2):
            w1 = torch.randn(ffn, hidden, device=dev) * 0.02
            w2 = torch.randn(hidden, ffn, device=dev) * 0.02
            s1, s2 = E4M3 / w1.abs().max(), E4M3 / w2.abs().max()
            self.layers.append(dict(
                lnw=torch.ones(hidden, device=dev, dtype=torch.bfloat16), lnb=torch.zeros(hidden, device=dev, dtype=torch.bfloat16),
                w1=(w1 * s1).to(torch.float8_e4m3fn), s1=(1 / s1).reshape(()), b1=torch.randn(ffn, device=dev, dtype=torch.bfloat16) * 0.1,
                w2=(w2 * s2).to(torch.float8_e4m3fn), s2=(1 / s2).reshape(()), b2=torch.randn(hidden, device=dev, dtype=torch.bfloat16) * 0.1))
        self.cfg1, self.cfg2, self.hidden, self.ffn = cfg1, cfg2, hidden, ffn

    def __call__(self, x):
        m = x.shape[0]
        bt = max(16, triton.next_power_of_2(m))
        for L in self.layers:
            xq, sx = ln_cast_c(x, L["lnw"], L["lnb"])
            amax = torch.zeros((), device=x.device)
            h = torch.empty((m, self.ffn), device=x.device, dtype=torch.bfloat16)
            bn1, bk1, st1 = self.cfg1
            fc1_gelu[(self.ffn // bn1,)](xq, L["w1"], sx, L["s1"], L["b1"], h, amax, m, self.ffn, self.hidden,
                                         BLOCK_T=bt, BLOCK_N=bn1, BLOCK_K=bk1, num_warps=4, num_stages=st1)
            bn2, bk2, st2, split = self.cfg2
            part = torch.empty((split, m, self.hidden), device=x.device)
            fc2_cast[(self.hidden // bn2, split)](h, amax, L["w2"], part, m, self.hidden, self.ffn, self.ffn // split,
                                                  BLOCK_T=bt, BLOCK_N=bn2, BLOCK_K=bk2, num_warps=4, num_stages=st2)
            out = torch.empty((m, self.hidden), device=x.device, dtype=torch.bfloat16)
            sum_bias[(triton.cdiv(m * self.hidden, 1024),)](part, amax, L["s2"], L["b2"], out, m, self.hidden,
                                                            SPLIT=split, BLOCK=1024)
            x = out
        return x


def check(f, x):
    got, y = f(x), x
    q = lambda t: ((t.float() * (448 / t.float().abs().max())).clamp(-448, 448).to(torch.float8_e4m3fn).float() * (t.float().abs().max() / 448))
    for L in f.layers:
        ln = q(torch.nn.functional.layer_norm(y, (y.shape[-1],), L["lnw"], L["lnb"], 1e-5))
        h = (ln @ (L["w1"].float() * L["s1"]).t()).to(torch.bfloat16).float() + L["b1"].float()
        g = q(torch.nn.functional.gelu(h.to(torch.bfloat16).float(), approximate="tanh").to(torch.bfloat16))
        y = ((g @ (L["w2"].float() * L["s2"]).t()).to(torch.bfloat16).float() + L["b2"].float()).to(torch.bfloat16)
    return ((got.float() - y.float()).norm() / y.float().norm()).item()


def graph_ms(fn, x):
    """fn(x) captured once into a CUDA graph (inference.py's `captured`), its replay timed."""
    from triton.testing import do_bench
    replay = captured(fn, x)
    return do_bench(lambda: replay(x), warmup=100, rep=500, return_mode="median")


def main():
    dev = torch.device("cuda")
    hidden, ffn = 4096, 14336
    torch.manual_seed(0)
    bf16 = torch.compile(torch.nn.Sequential(TorchMLP(hidden, ffn, dev), TorchMLP(hidden, ffn, dev)), fullgraph=True)
    frozen = torch.compile(frozen_blocks(Float8CurrentScaling(), hidden, ffn, dev, 0), fullgraph=True)
    res = []
    for m in (16, 64):
        x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            row = {"m": m, "bf16": graph_ms(bf16, x), "frozen_current": graph_ms(frozen, x)}
            for cfg1 in ((128, 128, 4), (128, 256, 3), (64, 128, 5), (64, 256, 4)):
                for cfg2 in ((128, 128, 4, 4), (128, 256, 3, 4), (64, 128, 4, 2), (128, 128, 4, 8), (64, 256, 4, 4)):
                    f = Fused(hidden, ffn, dev, cfg1, cfg2)
                    try:
                        if cfg2 == (128, 128, 4, 4):
                            print("err", cfg1, check(f, x), flush=True)
                        row[f"fused {cfg1} {cfg2}"] = graph_ms(f, x)
                    except Exception as e:
                        print("fail", cfg1, cfg2, type(e).__name__, str(e)[:300], flush=True)
        best = min((v, k) for k, v in row.items() if k.startswith("fused"))
        print(json.dumps({k: row[k] for k in ("m", "bf16", "frozen_current")}), "best", best, flush=True)
        res.append(row)
    json.dump(res, open(f"{OUT}/fused_mlp.json", "w"), indent=1)


if __name__ == "__main__":
    main()
