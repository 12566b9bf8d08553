"""Run the python examples in README.md and docs/**/*.md.

Every fenced block whose info string is ``python`` is executed. The blocks of
one file run in order in a single namespace, so a later block may use names
defined by an earlier one; each file is one test, with its path as the id.

Tag a block ``python no-run`` to show it without running it (for code that
needs a GPU, a network, or is deliberately incomplete).
"""

import linecache
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

# A fence of three or more backticks, closed by a fence of the same length.
_FENCE = re.compile(
    r"^(?P<fence>`{3,})[ \t]*(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)


def _python_blocks(text):
    return [m["body"] for m in _FENCE.finditer(text) if m["info"].strip() == "python"]


def _doc_files():
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    return [p for p in paths if p.is_file() and _python_blocks(p.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_examples(path, tmp_path, monkeypatch):
    # Docs that write files should write them here, not into the repo.
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    rel = path.relative_to(ROOT).as_posix()
    namespace = {"__name__": "__docs__"}
    for i, src in enumerate(_python_blocks(path.read_text(encoding="utf-8"))):
        name = f"{rel}:block{i}"
        # Lets tracebacks show the failing line of the doc, not "???".
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        exec(compile(src, name, "exec"), namespace)
