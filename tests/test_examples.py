"""examples/demo.py runs and reports a loss for every recipe."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_trains_with_every_recipe():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "3"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    table = lines[lines.index(next(l for l in lines if l.startswith("recipe"))) + 1:]
    names = [row.split()[0] for row in table]
    assert names[1:] == ["current", "mxfp8", "block", "delayed"] and names[0] in ("fp32", "bf16")
    finals = [float(row.split()[2]) for row in table]
    for final in finals[1:]:       # FP8 training follows the high-precision run closely
        assert abs(final - finals[0]) < 0.05 * finals[0], table
    steps = [l for l in lines if re.match(r"\s+step\s+\d+\s+loss \d", l)]
    assert len(steps) == 3 * len(table)
