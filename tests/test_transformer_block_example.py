"""examples/transformer_block.py runs with every recipe and its loss goes down."""
import importlib.util
import math
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "transformer_block.py"


def _load():
    spec = importlib.util.spec_from_file_location("transformer_block", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_transformer_block_trains_with_every_recipe():
    results = _load().main(steps=3)
    assert set(results) == {"high", "current", "mxfp8", "block", "delayed"}
    for name, losses in results.items():
        assert len(losses) == 3 and all(math.isfinite(v) for v in losses), name
        assert losses[-1] < losses[0], (name, losses)
