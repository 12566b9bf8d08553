"""The layers' math between one autograd boundary: tensors in, tensors out, by name."""
from .boundary import (GradContext, backward_differentiable, call, call_forward, first_order_only, higher_order,
                       on_backward)
from .gemm_layer import GemmConfig, GemmSlot, backward_gemm, forward_gemm
from .grouped_linear import GroupedLinearFP8, GroupedLinearRunsFP8
from .layernorm_linear import LayerNormLinearFP8
from .layernorm_mlp import LayerNormMLPFP8
from .linear import LinearFP8

__all__ = ["GradContext", "call", "call_forward", "on_backward", "higher_order", "first_order_only",
           "backward_differentiable", "GemmConfig", "GemmSlot", "backward_gemm", "forward_gemm", "LinearFP8",
           "LayerNormLinearFP8", "LayerNormMLPFP8", "GroupedLinearFP8",
           "GroupedLinearRunsFP8"]
