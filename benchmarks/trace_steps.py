"""What torch.compile interprets of te_func: dynamo's bytecode steps over eight compile-bound tests of
the suite, counted by wrapping `InstructionTranslatorBase.step` (any machine; CPU here).

    python3 benchmarks/trace_steps.py [--top 20]

The tests: tef.Stateful compiled over HF Llama, HF GPT-2, LayerNormMLP, GroupedLinear and Linear;
a compiled tef.grad step of HF Llama (skipped under delayed scaling, by the suite's choice) and of
LayerNormLinear; and the GroupedLinear routing test under MXFP8. Prints the total, te_func's share,
the wall time and the files and functions interpreted most. The count does not depend on the
machine's speed; the wall time does.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [f"tests/transforms/test_transforms.py::test_stateful_backward_equals_grad_and_compiles[{c}]" for c in
         ("HF-Llama-current", "HF-GPT2-delayed", "LayerNormMLP-swiglu-mxfp8", "GroupedLinear-block", "Linear-delayed")]
TESTS += [f"tests/transforms/test_transforms.py::test_compiled_train_step_equals_eager[{c}]" for c in
          ("HF-Llama-delayed", "LayerNormLinear-current")]
TESTS += ["tests/shell/test_stateful.py::test_grouped_linear_with_new_routing_every_step_does_not_recompile_per_routing"
          "[mxfp8]"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=20, help="how many files and functions to list")
    args = parser.parse_args(argv)
    import pytest
    from torch._dynamo import symbolic_convert

    by_file: collections.Counter = collections.Counter()
    by_function: collections.Counter = collections.Counter()
    step = symbolic_convert.InstructionTranslatorBase.step

    def counted(self):
        name = self.f_code.co_filename.split("site-packages/")[-1].replace(f"{ROOT}/", "")
        by_file[name] += 1
        by_function[(name, self.f_code.co_name)] += 1
        return step(self)
    symbolic_convert.InstructionTranslatorBase.step = counted
    start = time.perf_counter()
    status = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *(str(ROOT / t) for t in TESTS)])
    wall = time.perf_counter() - start
    total = sum(by_file.values())
    ours = sum(v for k, v in by_file.items() if k.startswith("te_func/"))
    print(f"bytecode steps: {total:,} (te_func's own files: {ours:,}); wall {wall:.1f} s")
    for k, v in by_file.most_common(args.top):
        print(f"{v:9,d}  {k}")
    print()
    for (f, fn), v in by_function.most_common(args.top):
        print(f"{v:9,d}  {f}:{fn}")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
