"""Tensor parallelism with DTensor: te_func layers under `parallelize_module`.

torch's ColwiseParallel and RowwiseParallel shard only nn.Linear and nn.Embedding; the styles
here shard te_func's layers the same way (and fall back to torch's for those two): Colwise
(Linear, LayerNormLinear: Shard(0)), Rowwise (Linear: Shard(1)) and LayerNormMLPParallel
(Megatron's MLP). Every quantized tensor's amax is then a reduction over its shards, so a scale
is the one a single process computes; outputs equal a single process's up to fp32 rounding of
the row-wise partial sums. Block recipes are refused on sharded weights (docs/distributed.md)."""
from __future__ import annotations

from functools import partial

from torch import nn

from .. import nn as te_nn
from ..quant import lower

__all__ = ["style", "check_layouts"]

_NORM_PARAMS = ("layer_norm_weight", "layer_norm_bias")


def _torch_styles():
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    return TorchColwise, TorchRowwise, ParallelStyle


def _check_single_output(module, style: str):
    for flag in ("return_bias", "return_layernorm_output"):
        if getattr(module, flag, False):
            raise ValueError(f"{style}: {type(module).__name__}({flag}=True) returns a tuple, which the style's "
                             f"output layout cannot describe; build the layer with {flag}=False")


def _shard(module: nn.Module, mesh, placements: dict):
    """Replace each parameter of `module` by a DTensor laid out as `placements[name]` (Replicate if absent)."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements.get(name, Replicate())
        dist_param = nn.Parameter(distribute_tensor(param.data, mesh, [placement]), requires_grad=param.requires_grad)
        module.register_parameter(name, dist_param)


def _make_styles():
    TorchColwise, TorchRowwise, ParallelStyle = _torch_styles()
    from torch.distributed.tensor import Replicate, Shard, distribute_module

    class ColwiseParallel(TorchColwise):
        """torch's ColwiseParallel, also for te_func's Linear and LayerNormLinear (same arguments)."""

        def _apply(self, module, device_mesh):
            if not isinstance(module, (te_nn.Linear, te_nn.LayerNormLinear)):
                return super()._apply(module, device_mesh)
            _check_single_output(module, "ColwiseParallel")
            return distribute_module(
                module, device_mesh,
                lambda name, m, mesh: _shard(m, mesh, {"weight": Shard(0), "bias": Shard(0)}) if m is module else None,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    class RowwiseParallel(TorchRowwise):
        """torch's RowwiseParallel, also for te_func's Linear (same arguments)."""

        def _apply(self, module, device_mesh):
            if isinstance(module, te_nn.LayerNormLinear):
                raise ValueError("RowwiseParallel: a LayerNormLinear's norm needs whole rows of its input; "
                                 "shard it column-wise (te_func.distributed.ColwiseParallel)")
            if not isinstance(module, te_nn.Linear):
                return super()._apply(module, device_mesh)
            _check_single_output(module, "RowwiseParallel")
            self.desired_input_layouts = (Shard(-1),)
            return distribute_module(
                module, device_mesh,
                lambda name, m, mesh: _shard(m, mesh, {"weight": Shard(1)}) if m is module else None,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    class LayerNormMLPParallel(ParallelStyle):
        """te_func's LayerNormMLP sharded as Megatron's MLP: fc1 Shard(0), fc2_weight Shard(1), the rest
        replicated. input_layouts / output_layouts: Replicate(), or Shard(d) for sequence parallelism;
        use_local_output: return the local part rather than a DTensor."""

        def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True):
            super().__init__()
            self.input_layouts = (input_layouts or Replicate(),)
            self.output_layouts = (output_layouts or Replicate(),)
            self.use_local_output = use_local_output

        def _apply(self, module, device_mesh):
            if not isinstance(module, te_nn.LayerNormMLP):
                raise TypeError(f"LayerNormMLPParallel shards te_func.nn.LayerNormMLP, got {type(module).__name__}")
            _check_single_output(module, "LayerNormMLPParallel")
            # The input as a whole (fc1 is column-wise), the output from fc2's partial sums.
            return distribute_module(
                module, device_mesh,
                lambda name, m, mesh: _shard(m, mesh, {"fc1_weight": Shard(0), "fc1_bias": Shard(0),
                                                       "fc2_weight": Shard(1)}) if m is module else None,
                partial(TorchColwise._prepare_input_fn, self.input_layouts, (Replicate(),)),
                partial(TorchRowwise._prepare_output_fn, self.output_layouts, self.use_local_output))

    return ColwiseParallel, RowwiseParallel, LayerNormMLPParallel


_STYLES = None


def style(name: str):
    """The style class `name`, made on first use (torch.distributed.tensor is imported only then)."""
    global _STYLES
    if _STYLES is None:
        _STYLES = dict(zip(("ColwiseParallel", "RowwiseParallel", "LayerNormMLPParallel"), _make_styles()))
    return _STYLES[name]


def check_layouts(model: nn.Module, recipe, units: dict) -> None:
    """Refuse a recipe te_func cannot run on the DTensor-sharded (tensor-parallel) weights of `model`."""
    if lower(recipe).tensorwise:
        return
    from torch.distributed.tensor import DTensor, Shard

    from ._fsdp import is_fsdp_managed
    for path, m in model.named_modules():
        if not isinstance(m, te_nn.TEModule) or is_fsdp_managed(path, units):
            continue
        for g in m.gemms():
            w = getattr(m, m.gemm_param(g.weight))
            if isinstance(w, DTensor) and any(isinstance(p, Shard) for p in w.placements):
                raise ValueError(
                    f"{type(recipe).__name__} cannot quantize {path + '.' if path else ''}{m.gemm_param(g.weight)}, "
                    f"laid out as "
                    f"{tuple(w.placements)}: its scaling blocks would have to follow the shard boundaries. Under "
                    f"tensor parallelism use a tensor-wise recipe (Float8CurrentScaling, DelayedScaling)")
