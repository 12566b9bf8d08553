"""The private torch internals te_func reads: torch.func's transform levels and wrappers, the
autograd engine's running backward, the one torch bug it works around (inductor's C++ loop
split), and the vmap rule for Tensor.view(dtype) torch 2.11 lacks. What subclasses or hooks into
torch (nn.Module's dicts, FSDP's hooks, TP styles), torch._scaled_mm and dynamo's public-by-use
hooks stay where they are used.

Checked on torch 2.11 and 2.13. A torch upgrade that moves them breaks here first:
tests/transforms/ run every path through them."""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys

import torch
from torch._C import _functorch
from torch._functorch import pyfunctorch

__all__ = ["transform_levels", "current_level", "tensor_level", "is_wrapped", "is_batched", "is_grad_tracking",
           "unwrap", "max_to_level", "is_batched_anywhere", "base_tensor", "requires_grad", "forward_ad_active",
           "functorch_disabled", "backward_task_id", "queue_backward_callback", "guard_cpu_loop_split",
           "guard_cpu_loop_split_at_compile", "when_imported", "when_compiler_imported", "allow_in_graph",
           "assume_constant_result", "ensure_view_dtype_batching"]


def transform_levels() -> list[str]:
    """The torch.func transforms active now, outermost first: "grad", "jvp", "vmap", "functionalize"."""
    kinds = {pyfunctorch.GradInterpreter: "grad", pyfunctorch.JvpInterpreter: "jvp",
             pyfunctorch.VmapInterpreter: "vmap", pyfunctorch.FunctionalizeInterpreter: "functionalize"}
    return [kinds.get(type(i), type(i).__name__) for i in pyfunctorch.retrieve_all_functorch_interpreters()]


def current_level() -> int | None:
    """The torch.func transform level code runs at now, None outside any."""
    return _functorch.maybe_current_level()


def tensor_level(t: torch.Tensor) -> int:
    """The torch.func level that wraps `t` (-1 for a plain tensor)."""
    return _functorch.maybe_get_level(t)


def is_wrapped(t: torch.Tensor) -> bool:
    """Whether `t` is wrapped by a torch.func transform (grad, vmap or jvp)."""
    return _functorch.is_functorch_wrapped_tensor(t)


def is_batched(t: torch.Tensor) -> bool:
    """Whether `t`'s outermost wrapper is vmap's."""
    return _functorch.is_batchedtensor(t)


def is_grad_tracking(t: torch.Tensor) -> bool:
    """Whether `t`'s outermost wrapper is a grad level's."""
    return _functorch.is_gradtrackingtensor(t)


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """`t` without its outermost torch.func wrapper."""
    return _functorch.get_unwrapped(t)


def max_to_level(t: torch.Tensor, level: int) -> torch.Tensor:
    """`t` as a tensor of torch.func level `level` (or below): each vmap wrapper above it taken off
    with an elementwise max over its batch dim, every other wrapper taken off as it is."""
    while _functorch.is_functorch_wrapped_tensor(t) and _functorch.maybe_get_level(t) > level:
        if _functorch.is_batchedtensor(t):
            bdim = _functorch.maybe_get_bdim(t)
            t = _functorch.get_unwrapped(t).amax(dim=bdim)
        else:
            t = _functorch.get_unwrapped(t)
    return t


def is_batched_anywhere(t: torch.Tensor) -> bool:
    """Whether any torch.func wrapper of `t` is vmap's."""
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_batchedtensor(t):
            return True
        t = _functorch.get_unwrapped(t)
    return False


def functorch_disabled():
    """A context in which torch.func's transforms see nothing (a kernel launch on plain tensors)."""
    return torch._C._DisableFuncTorch()


def backward_task_id() -> int:
    """The id of the autograd backward running now, -1 outside one."""
    return torch._C._current_graph_task_id()


def queue_backward_callback(fn) -> None:
    """Runs `fn` when the running backward ends."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def base_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` with every torch.func wrapper taken off: the tensor plain autograd sees."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


def requires_grad(t: torch.Tensor) -> bool:
    """Whether any autograd level tracks `t`, also one under a torch.func wrapper (vmap's)."""
    while True:
        if t.requires_grad:
            return True
        if not _functorch.is_functorch_wrapped_tensor(t):
            return False
        t = _functorch.get_unwrapped(t)


def forward_over_forward() -> bool:
    """Whether a torch.func forward-mode level (jvp, jacfwd) runs inside another, eagerly. torch
    2.13 gets such second derivatives wrong, with no error, through a Function's jvp rule
    (pytorch/pytorch#197867) and through F.layer_norm (#198017): te_func avoids both there."""
    return (not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()
            and transform_levels().count("jvp") >= 2)


def forward_ad_active() -> bool:
    """Whether plain autograd's forward mode (torch.autograd.forward_ad.dual_level) is on."""
    return torch.autograd.forward_ad._current_level >= 0


# --- the compiler, when something imports it ---------------------------------------------------
# torch._dynamo (and sympy with it) takes seconds to import: eager users never pay it. What te_func
# tells the compiler is told when its module is imported (by torch.compile, export or the user).

_DYNAMO = "torch._dynamo"
_CPP_CODEGEN = "torch._inductor.codegen.cpp"
_on_import: dict[str, list] = {}


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Runs a module's `_on_import` callbacks right after the module has executed."""

    def find_spec(self, name, path=None, target=None):
        if not _on_import.get(name):        # nothing (left) to run for it
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _run_callbacks(name)
        spec.loader.exec_module = exec_module       # type: ignore[method-assign]  # this import only
        return spec


def _run_callbacks(name: str) -> None:
    callbacks = _on_import.get(name, [])
    while callbacks:
        callbacks.pop(0)()


def when_imported(name: str, fn) -> None:
    """Runs `fn` now if module `name` is imported, else right after it is."""
    _on_import.setdefault(name, []).append(fn)
    if name in sys.modules:
        _run_callbacks(name)
    elif not any(isinstance(f, _ImportWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportWatch())


def when_compiler_imported(fn) -> None:
    """Runs `fn` now if torch._dynamo is imported, else right after it is."""
    when_imported(_DYNAMO, fn)


def allow_in_graph(fn):
    """torch._dynamo.allow_in_graph(fn), once the compiler is imported; returns fn."""
    when_compiler_imported(lambda: torch._dynamo.allow_in_graph(fn))
    return fn


def assume_constant_result(fn):
    """torch.compiler.assume_constant_result(fn), without importing the compiler: the mark it sets."""
    fn._dynamo_marked_constant = True
    return fn


def guard_cpu_loop_split_at_compile() -> None:
    """`guard_cpu_loop_split` once inductor's C++ code generator is imported. Not a compile-start
    callback: torch._dynamo.reset() drops those, and a later compile would run unguarded."""
    when_imported(_CPP_CODEGEN, guard_cpu_loop_split)


def guard_cpu_loop_split() -> None:
    """Skips inductor's C++ loop split where torch's own check of it fails.

    The split checks that the fused loops have as many dims, not that they are as long, then asserts
    it: block recipes' two casts of a gradient stop the compile (docs/functional.md has the repro).
    The assertion comes before any node changes, so returning the nodes gives the unsplit kernel.
    Any other assertion propagates."""
    try:
        from torch._inductor.codegen.cpp import CppScheduling
    except ImportError:     # a torch without inductor's C++ backend has nothing to guard
        return
    split = getattr(CppScheduling, "try_loop_split", None)
    if split is None or getattr(split, "skips_mismatched_ranges", False):
        return

    @functools.wraps(split)
    def guarded(self, nodes):
        try:
            return split(self, nodes)
        except AssertionError as e:
            if not _mismatched_ranges(e):
                raise
            return nodes
    guarded.skips_mismatched_ranges = True          # type: ignore[attr-defined]  # the patch's mark
    CppScheduling.try_loop_split = guarded          # type: ignore[method-assign]  # the patch itself


def _mismatched_ranges(e: AssertionError) -> bool:
    # try_loop_split's assertion carries the two loops' ranges: a pair of dicts
    (arg,) = e.args if len(e.args) == 1 else (None,)
    return isinstance(arg, tuple) and len(arg) == 2 and all(isinstance(r, dict) for r in arg)

# --- a vmap rule for Tensor.view(dtype) on torches that have none (2.11) ------------------------
# The scaling math reads fp32 bits with x.view(torch.int32) (quant/scheme.py). torch 2.11 has no
# vmap rule for that view ("Batching rule not implemented for aten::view.dtype"): te_func registers
# one there for views between dtypes of one element size, the batch dim where it was.

view_dtype_rule_registered = False      # whether this process runs te_func's rule
_view_dtype_library = None              # kept alive: the registration lasts as long as this object


def _has_view_dtype_rule() -> bool:
    try:
        torch.vmap(lambda t: t.view(torch.int32))(torch.zeros(2, 1))
    except RuntimeError:
        return False
    return True


def _view_dtype(info, in_dims, x, dtype):
    if x.element_size() != torch.empty((), dtype=dtype).element_size():
        raise RuntimeError(f"te_func's vmap rule for Tensor.view(dtype) takes dtypes of one element size, "
                           f"not {x.dtype} -> {dtype}")
    return x.view(dtype), in_dims[0]


def ensure_view_dtype_batching(force: bool = False) -> bool:
    """Register the rule where torch lacks one (or with `force`); returns whether it is on."""
    global view_dtype_rule_registered, _view_dtype_library
    if view_dtype_rule_registered or (not force and _has_view_dtype_rule()):
        return view_dtype_rule_registered
    try:    # functorch's helper behind torch.library.register_vmap
        from torch._functorch.autograd_function import custom_function_call_vmap_helper
        from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
    except ImportError:     # a torch without it: its own behaviour, the error above included
        return False
    op = torch.ops.aten.view.dtype

    def batched(keyset, x, dtype):
        return custom_function_call_vmap_helper(retrieve_current_functorch_interpreter(), _view_dtype, op, x, dtype)
    _view_dtype_library = torch.library.Library("aten", "IMPL")
    _view_dtype_library.impl("view.dtype", batched, "FuncTorchBatched", with_keyset=True)
    view_dtype_rule_registered = True
    return view_dtype_rule_registered
