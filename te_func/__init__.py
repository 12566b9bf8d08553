"""te_func: TransformerEngine's PyTorch layers as pure functions.

Each layer is a pure function `(params, workspaces) -> (out, new_workspaces)`
used through `tef.functional_call`; `tef.Stateful` threads the workspaces
through training steps for code that wants a plain nn.Module.

The package's layers, each importing only those below it:

    freeze.py    freeze: an inference copy holding FP8 weight casts only (nn/frozen.py's layers)
    integrations.py  what libraries that take a torch model need to know of te_func (peft, opacus, HF Trainer)
    shell.py     Stateful: the only place anything is mutated
    vmapped.py   per-sample gradients and ensembles: vmap with workspaces folded, stacked, unstacked
    convert.py   convert: a torch model's layers swapped for te_func's, every tensor kept
    frame.py     functional_call, init_workspaces, autocast, grad: workspace entries by module path
    backward_state.py  what a backward produces besides gradients, and how it comes back
    distributed/ torch.distributed: FSDP2's weights, FP8 all-gather, amax reduction, tensor parallelism,
                 checkpoints
    nn/          modules: parameter holders with TE's names; forward calls one functional op
    functional/  per-op functions: tensors and an op-local workspace dict in, (out, new workspace) out
    ops/         the layers' math behind one autograd boundary: tensors in and out by name
    gemm.py      FP8 and FP4 GEMMs: torch._scaled_mm where the device has it, exact emulation elsewhere
    quant/       scaling math, quantize / dequantize, cached weight casts, delayed-scaling state,
                 and the workspace format (quant/workspace.py)
    kernels/     fused Triton casts (and the GELU's pass) for eager CUDA tensors, bit-identical to the torch code
    recipe.py    the recipes: frozen, hashable dataclasses
    errors.py    one class per misuse te_func detects (imported by any layer)

Promises: nothing passed to a functional call is mutated; the same inputs give
the same outputs; compiled results equal eager ones; a workspace made for
another recipe, or with entries another model's layers would have, is refused
with an error naming the entry.
"""
from . import _compat, distributed, errors, functional, integrations, nn, quant, recipe
from .errors import Error
from .convert import convert, fp8_pays
from .frame import (autocast, functional_call, grad, init_workspaces, upgrade_workspaces, validate_workspaces,
                    value_and_grad, workspace_spec)
from .functional._common import set_check_finite
from .ops import higher_order
from .shell import Stateful
from .vmapped import (fold_workspaces, per_sample_grad, per_sample_value_and_grad, stack_module_state,
                      stack_workspaces, unstack_module_state, unstack_workspaces)
from .freeze import freeze, frozen_layers
from .checkpoint import checkpoint

_compat.guard_cpu_loop_split_at_compile()

__all__ = ["Error", "errors", "integrations", "distributed", "functional", "nn", "quant", "recipe", "convert",
           "fp8_pays", "autocast", "functional_call", "grad", "higher_order", "init_workspaces", "value_and_grad",
           "workspace_spec", "validate_workspaces", "upgrade_workspaces", "Stateful", "set_check_finite",
           "per_sample_grad", "per_sample_value_and_grad", "fold_workspaces", "stack_workspaces", "unstack_workspaces",
           "stack_module_state", "unstack_module_state", "freeze", "frozen_layers", "checkpoint"]
