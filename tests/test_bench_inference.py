"""`benchmarks/inference.py --quick` runs on CPU: every model at every token count, and the
frozen models' resident bytes against bf16's."""
import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("te_func_bench_inference", ROOT / "benchmarks" / "inference.py")
inference = importlib.util.module_from_spec(_spec)
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
