"""Run the python examples in README.md and docs/**/*.md, and check what they print.

Every fenced block whose info string is ``python`` is executed. The blocks of
one file run in order in a single namespace, so a later block may use names
defined by an earlier one; each file is one test, with its path as the id.

What a block prints is checked: a block that prints must be followed by a
fenced block whose info string is ``output``, holding what it prints
(doctest's rules: ``...`` stands for any text, runs of whitespace compare
equal). A block that prints and has no output block fails.

Tag a block ``python no-run`` to show it without running it (for code that
needs a GPU, a network, or is deliberately incomplete).
"""

import contextlib
import doctest
import io
import linecache
import re
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# A fence of three or more backticks, closed by a fence of the same length.
_FENCE = re.compile(
    r"^(?P<fence>`{3,})[ \t]*(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_CHECKER = doctest.OutputChecker()
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _python_blocks(text):
    """[(source, expected output or None)] of the runnable blocks, in order."""
    fences = list(_FENCE.finditer(text))
    blocks = []
    for i, m in enumerate(fences):
        if m["info"].strip() != "python":
            continue
        nxt = fences[i + 1] if i + 1 < len(fences) else None
        follows = nxt is not None and nxt["info"].strip() == "output" and not text[m.end():nxt.start()].strip()
        blocks.append((m["body"], nxt["body"] if follows else None))
    return blocks


def _doc_files():
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    return [p for p in paths if p.is_file() and _python_blocks(p.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_examples(path, tmp_path, monkeypatch):
    # Docs that write files should write them here, not into the repo.
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    rel = path.relative_to(ROOT).as_posix()
    # A real module, as a script's __main__ is: torch.compile of vmap imports the module that
    # a traced function's globals name.
    module = types.ModuleType("__docs__")
    monkeypatch.setitem(sys.modules, "__docs__", module)
    namespace = module.__dict__
    for i, (src, expected) in enumerate(_python_blocks(path.read_text(encoding="utf-8"))):
        name = f"{rel}:block{i}"
        # Lets tracebacks show the failing line of the doc, not "???".
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(src, name, "exec"), namespace)
        got = printed.getvalue()
        if expected is None:
            assert not got, f"{name} prints but no ```output block follows it:\n{got}"
        else:
            assert _CHECKER.check_output(expected, got, _FLAGS), \
                f"{name} printed\n{got}\nbut its ```output block says\n{expected}"
