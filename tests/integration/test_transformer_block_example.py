"""examples/transformer_block.py runs with every recipe and its loss goes down."""
import math

from cases import load_example


def test_transformer_block_trains_with_every_recipe():
    results = load_example("transformer_block").main(steps=3)
    assert set(results) == {"high", "current", "mxfp8", "block", "delayed"}
    for name, losses in results.items():
        assert len(losses) == 3 and all(math.isfinite(v) for v in losses), name
        assert losses[-1] < losses[0], (name, losses)
