"""te_func: TransformerEngine's PyTorch layers as pure functions.

Each layer is a pure function `(params, workspaces) -> (out, new_workspaces)`
used through `tef.functional_call`; `tef.Stateful` threads the workspaces
through training steps for code that wants a plain nn.Module.
"""
from . import functional, nn, quant, recipe
from .frame import autocast, functional_call, grad, init_workspaces, value_and_grad
from .functional._common import set_check_finite, set_fp8_min_gemm_size
from .shell import Stateful

__all__ = ["functional", "nn", "quant", "recipe", "autocast", "functional_call", "grad",
           "init_workspaces", "value_and_grad", "Stateful", "set_fp8_min_gemm_size",
           "set_check_finite"]
