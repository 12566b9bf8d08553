"""te_func: TransformerEngine's PyTorch layers as pure functions.

Each layer is a pure function `(params, workspaces) -> (out, new_workspaces)` used through
`tef.functional_call`; `tef.Stateful` threads the workspaces through training steps. Nothing
passed to a functional call is mutated; compiled results equal eager ones; a workspace made for
another recipe or model is refused with an error naming the entry. docs/architecture.md draws
the floors the package is built in."""
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

__version__ = "0.1.0"

__all__ = ["__version__", "Error", "errors", "integrations", "distributed", "functional", "nn", "quant", "recipe",
           "convert", "fp8_pays", "autocast", "functional_call", "grad", "higher_order", "init_workspaces",
           "value_and_grad", "workspace_spec", "validate_workspaces", "upgrade_workspaces", "Stateful",
           "set_check_finite", "per_sample_grad", "per_sample_value_and_grad", "fold_workspaces", "stack_workspaces",
           "unstack_workspaces", "stack_module_state", "unstack_module_state", "freeze", "frozen_layers",
           "checkpoint"]
