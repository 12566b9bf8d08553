"""`benchmarks/inference.py --quick` runs on CPU: every model at every token count, and the
frozen models' resident bytes against bf16's."""
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("te_func_bench_inference", ROOT / "benchmarks" / "inference.py")
inference = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = inference         # torch.compile imports the module of what it traces
_spec.loader.exec_module(inference)


def test_quick_inference_benchmark_times_every_model_and_counts_its_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)   # the CPU path, on any machine
    out = tmp_path / "inference.json"
    inference.main(["--quick", "--tokens", "1,16", "--weight-only-tokens", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    models = {"bf16", "fp8 current", "fp8 current weight-only<=1", "fp8 delayed", "fp8 delayed weight-only<=1"}
    assert set(data["ms"]) == {"eager/1", "eager/16"}
    for row in data["ms"].values():
        assert set(row) == models and all(ms > 0 for ms in row.values())
    assert data["host_us"] == {}        # host time is taken under reduce-overhead only
    resident = data["resident_bytes"]
    # FP8 weights, one layout, plus the norms' and biases' bf16 values and the scales.
    for name in models - {"bf16"}:
        assert 0.5 < resident[name] / resident["bf16"] < 0.53, (name, resident)


def test_host_time_per_call_counts_every_call():
    calls = []
    us = inference.host_us_per_call(lambda x: calls.append(x), torch.zeros(1), calls=7)
    assert len(calls) == 8 and us > 0     # one warm-up call, then the timed ones


def test_quick_compiled_run_with_the_guard_check_skipped_and_a_static_input(tmp_path, monkeypatch):
    """The reduce-overhead path of the benchmark on CPU (aot_eager stands in for inductor, which
    needs a C++ compiler): warm-up calls, then the timed ones under skip_guard_eval_unsafe, on an
    input marked a static address; every model gets a time and a host time."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    compile_ = torch.compile
    modes = []

    def aot_eager(model, mode=None, **kw):
        modes.append(mode)
        return compile_(model, backend="aot_eager", **kw)
    monkeypatch.setattr(torch, "compile", aot_eager)
    stances, marked, set_stance, mark = [], [], torch.compiler.set_stance, torch._dynamo.mark_static_address

    def recording_stance(*args, **kw):
        stances.append(kw)
        return set_stance(*args, **kw)

    def recording_mark(t, *args, **kw):
        marked.append(tuple(t.shape))
        return mark(t, *args, **kw)
    monkeypatch.setattr(torch.compiler, "set_stance", recording_stance)
    monkeypatch.setattr(torch._dynamo, "mark_static_address", recording_mark)
    out = tmp_path / "inference.json"
    inference.main(["--quick", "--modes", "reduce-overhead", "--tokens", "4", "--weight-only-tokens", "0",
                    "--skip-guards", "--static-input", "--out", str(out)])
    data = json.loads(out.read_text())
    models = {"bf16", "fp8 current", "fp8 delayed"}
    assert modes == ["reduce-overhead"] * 3 and data["skip_guards"] and data["static_input"]
    assert stances == [{"skip_guard_eval_unsafe": True}] * 3 and marked == [(4, 64)]
    times = data["ms"]["reduce-overhead/4"]
    assert set(times) == models and all(ms > 0 for ms in times.values())
    assert set(data["host_us"]["reduce-overhead/4"]) == models
