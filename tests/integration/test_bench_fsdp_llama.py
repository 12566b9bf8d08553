"""benchmarks/fsdp_llama.py's logic that needs no GPU: variants, the config, the conversion, the record."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import te_func as tef

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("te_func_bench_fsdp_llama", ROOT / "benchmarks" / "fsdp_llama.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench           # its dataclasses look their module up there
_spec.loader.exec_module(bench)


def test_variants_cover_bf16_torchao_and_te_func_with_and_without_fp8_all_gather():
    names = [v.name for v in bench.selected(bench.parse_args([]))]
    assert names == ["bf16", "torchao-tensorwise-fp8ag", "te-current", "te-current-fp8ag", "te-delayed",
                     "te-delayed-fp8ag"]
    assert [v.name for v in bench.selected(bench.parse_args(["--only", "te-delayed, bf16"]))] == ["bf16",
                                                                                                 "te-delayed"]
    with pytest.raises(SystemExit, match="unknown variants"):
        bench.selected(bench.parse_args(["--only", "te-mxfp8"]))


def test_llama_config_follows_the_arguments():
    kwargs = bench.llama_config_kwargs(bench.parse_args(["--layers", "2", "--hidden", "256", "--seq", "128"]))
    assert kwargs["num_hidden_layers"] == 2 and kwargs["hidden_size"] == 256
    assert kwargs["max_position_embeddings"] == 128


def test_the_filter_converts_linear_layers_but_the_head_and_odd_sizes():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(32, 64)
            self.odd = nn.Linear(30, 16)             # not a multiple of 16: stays
            self.block = nn.Sequential(nn.Linear(64, 32, bias=False))
            self.lm_head = nn.Linear(32, 48)         # the output head: stays

        def forward(self, x):
            return self.lm_head(self.block(self.up(x)))

    model = Tiny()
    x = torch.randn(4, 32)
    before = model(x)
    tef.convert(model, module_filter_fn=bench.convertible)
    assert isinstance(model.up, tef.nn.Linear) and isinstance(model.block[0], tef.nn.Linear)
    assert model.block[0].bias is None
    assert type(model.odd) is nn.Linear and type(model.lm_head) is nn.Linear
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)    # recipe None: the same function


def test_result_line_reports_tokens_per_gpu_and_peak_memory():
    args = bench.parse_args(["--batch", "2", "--seq", "1024"])
    line = bench.result_line(bench.VARIANTS[2], args, 8, [0.5, 0.25, 0.75], 3 * 2**30)
    assert line["tokens_per_s_per_gpu"] == 2 * 1024 / 0.5
    assert line["peak_mem_gib_per_gpu"] == 3.0 and line["world_size"] == 8 and line["variant"] == "te-current"
    json.dumps(line)


def test_it_refuses_to_run_without_gpus(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="runs on GPUs"):
        bench.main(["--only", "bf16"])
