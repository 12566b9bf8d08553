"""`benchmarks/run.py --quick` runs on CPU and writes a result row for every variant."""
import importlib.util
import json
from pathlib import Path

import torch

import te_func as tef
from te_func.quant import scheme_for

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("te_func_bench_run", ROOT / "benchmarks" / "run.py")
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)      # puts benchmarks/ on sys.path, whose modules are all named bench_*
cases = run.cases


# One workload of each kind but the eager twins and the second shapes (CI time).
ONLY = ["mlp_32x16x32/", "linear_", "train8_cache_", "infer_", "weight_cast_", "llama_quick/"]


def test_quick_benchmark_writes_a_row_per_variant_and_workload(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)   # the CPU path, on any machine
    run.main(["--quick", "--out", str(tmp_path), "--only", ",".join(ONLY)])
    data = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["workload"], r["variant"]): r for r in data["results"]}
    workloads = [w for w in cases.workloads(quick=True) if any(s in f"{w.name}/" for s in ONLY)]
    assert {w.kind for w in workloads} == {"mlp", "linear", "train8_cache", "infer", "cast", "llama"}
    assert set(rows) == {(w.name, v) for w in workloads for v in cases.VARIANTS}
    # Every variant that exists in this checkout ran: bf16 torch and te_func's
    # stateless recipes are always here; the others may record why they could not run.
    for w in workloads:
        for v in ("torch-bf16", "te-current", "te-mxfp8", "te-block"):
            r = rows[(w.name, v)]
            if w.kind == "cast" and v == "torch-bf16":
                assert r["status"] == "n/a"
                continue
            assert r["status"] == "ok", r
            assert r["median_ms"] > 0
        assert rows[(w.name, "torch-bf16")].get("vs_bf16") in (None, 1.0)
    for r in data["results"]:
        assert r["status"] in ("ok", "error", "n/a", "skipped")
        assert r["status"] != "error" or r["error"], r
    md = (tmp_path / "results.md").read_text()
    for v in cases.VARIANTS:
        assert f"| {v} |" in md
    assert (tmp_path / "speedup.png").exists() or (tmp_path / "speedup.png.missing").exists()



def test_the_profiler_tells_gemms_from_the_casts_named_after_them():
    # Inductor names a kernel by the ops it feeds as well: the cast before a _scaled_mm is
    # "triton_poi_fused__scaled_mm_..." and must count as non-GEMM time.
    spec = importlib.util.spec_from_file_location("te_func_bench_profile", ROOT / "benchmarks" / "profile_step.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    assert profile.is_gemm("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT")
    assert profile.is_gemm("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64")
    assert profile.is_gemm("triton_tem_fused_mm_0")
    assert not profile.is_gemm("triton_poi_fused__scaled_mm__to_copy_abs_clamp_clone_t_where_5")
    assert not profile.is_gemm("triton_red_fused__to_copy_abs_amax_isnan_scalar_tensor_where_15")
    assert not profile.is_gemm("void at::native::vectorized_elementwise_kernel<8, at::native::MulFunctor>")


def test_the_peak_finder_lists_what_is_alive_at_the_peak_with_its_maker():
    spec = importlib.util.spec_from_file_location("te_func_bench_peak", ROOT / "benchmarks" / "memory_at_peak.py")
    peak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peak)
    gen = [{"filename": "/tmp/torchinductor_u/ab/cab.py", "line": 7, "name": "call"},
           {"filename": "/x/te_func/frame.py", "line": 3, "name": "f"}]
    ours = [{"filename": "/usr/lib/torch/nn.py", "line": 1, "name": "g"}, {"filename": "/x/te_func/ops/gemm.py",
                                                                            "line": 9, "name": "h"}]
    events = [{"action": "alloc", "addr": 1, "size": 100, "frames": gen},
              {"action": "alloc", "addr": 2, "size": 50, "frames": ours},
              {"action": "free_requested", "addr": 1, "size": 100},      # not free until completed
              {"action": "alloc", "addr": 3, "size": 30, "frames": []},
              {"action": "free_completed", "addr": 1, "size": 100},
              {"action": "alloc", "addr": 4, "size": 120, "frames": ours},
              {"action": "free_completed", "addr": 4, "size": 120}]
    assert peak.alive_at_peak(events) == (200, [(120, "gemm.py:9 h"), (50, "gemm.py:9 h"), (30, "?")])
    assert peak.alive_at_peak(events[:4]) == (180, [(100, "cab.py:7 call"), (50, "gemm.py:9 h"), (30, "?")])


def _eager_memory():
    spec = importlib.util.spec_from_file_location("te_func_bench_memory", ROOT / "benchmarks" / "eager_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_memory_counter_counts_what_is_alive_at_once():
    mem = _eager_memory()
    with mem.LiveStorages() as mode:
        a = torch.ones(1000)                # 4000 bytes
        b = torch.ones(500) * 2             # ones (2000) and the product (2000) alive at once: 8000
        del a, b
        c = torch.ones(1500)                # after a and b went: 6000, under the peak
    assert mode.peak == 8000 and c.numel() == 1500
    # A te_func GEMM and cast counted as the GPU's kernels: only their outputs
    x, s = torch.randn(64, 32), scheme_for(tef.recipe.Float8CurrentScaling(), "input")
    with mem.LiveStorages() as mode, mem._AsGpu(mode):
        q, q_t, _ = mem.quant_tensor.quantize_with_transpose(x, s)
    assert q.data.shape == q_t.data.shape[::-1] == (64, 32)
    assert mode.peak == 2 * 64 * 32 + 4 + 4        # both FP8 copies, scale_inv and amax (fp32 each)


def test_eager_memory_runs_on_cpu():
    mem = _eager_memory()
    rows = [mem.eager_peak(v, (64, 32, 64), torch.device("cpu"), as_gpu=True) for v in ("torch-bf16", "te-current")]
    for r in rows:      # at least the fc1 output (tokens x ffn, bf16) is alive in each step
        assert r["growth_bytes"] >= 64 * 64 * 2 and r["resident_bytes"] > 0
