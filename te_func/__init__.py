"""te_func: TransformerEngine's PyTorch layers as pure functions.

Each layer is a pure function `(params, workspaces) -> (out, new_workspaces)`
used through `tef.functional_call`; `tef.Stateful` threads the workspaces
through training steps for code that wants a plain nn.Module.

The package's layers, each importing only those below it:

    shell.py     Stateful: the only place anything is mutated
    frame.py     functional_call, init_workspaces, autocast, grad: workspace entries by module path
    nn/          modules: parameter holders with TE's names; forward calls one functional op
    functional/  per-op functions: tensors and an op-local workspace dict in, (out, new workspace) out
    ops/         autograd Functions: tensors in, tensors out (no dicts, no modules, no global state)
    gemm.py      FP8 and FP4 GEMMs: torch._scaled_mm where the device has it, exact emulation elsewhere
    quant/       scaling math, quantize / dequantize, cached weight casts, delayed-scaling state
    kernels/     fused Triton casts for eager CUDA tensors, bit-identical to quant's torch code
    recipe.py    the recipes: frozen, hashable dataclasses

Promises: nothing passed to a functional call is mutated; the same inputs give
the same outputs; compiled results equal eager ones; a workspace made for
another recipe, or with entries another model's layers would have, is refused
with an error naming the entry.
"""
from . import functional, nn, quant, recipe
from .frame import (autocast, functional_call, grad, init_workspaces, upgrade_workspaces, validate_workspaces,
                    value_and_grad, workspace_spec)
from .functional._common import set_check_finite
from .shell import Stateful

__all__ = ["functional", "nn", "quant", "recipe", "autocast", "functional_call", "grad",
           "init_workspaces", "value_and_grad", "workspace_spec", "validate_workspaces",
           "upgrade_workspaces", "Stateful", "set_check_finite"]
