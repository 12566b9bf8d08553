"""examples/demo.py trains a converted HF Llama under every recipe and saves its loss curves."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_demo_trains_with_every_recipe_and_saves_the_plot(tmp_path):
    pytest.importorskip("transformers")
    png = tmp_path / "loss.png"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "4", "--out", str(png)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any("FP8 is emulated on the CPU" in l for l in lines) or "cuda" in lines[0]
    start = lines.index(next(l for l in lines if l.startswith("recipe"))) + 1
    table = [l for l in lines[start:] if l.strip() and not l.startswith("loss curves")]
    names = [row.split()[0] for row in table]
    assert names[1:] == ["current", "mxfp8", "block", "delayed"] and names[0] in ("fp32", "bf16")
    first, final = [float(row.split()[1]) for row in table], [float(row.split()[2]) for row in table]
    for f0, f1 in zip(first, final):
        assert f1 < f0                              # every recipe learns
    for f1 in final[1:]:                            # and follows the high-precision run closely
        assert abs(f1 - final[0]) < 0.05 * final[0], table
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert re.search(r"loss curves saved to .*loss\.png", proc.stdout)
