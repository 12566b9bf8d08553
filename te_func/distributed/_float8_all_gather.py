"""FP8 all-gather under FSDP2: each rank casts its shard, the ranks gather FP8 bytes.

`enable_fsdp_float8_all_gather(model, recipe)` (before `fully_shard`) makes each te_func GEMM
weight a `Float8AllGatherWeight`: its high-precision tensor everywhere (optimizer, checkpoints),
gathered in FP8 through FSDP2's all-gather extension (`fsdp_pre_all_gather` /
`fsdp_post_all_gather`, as torchao's float8 training does). Before the gather each rank casts
its shard with a scale common to all ranks (current scaling: of the all-reduced amax; delayed:
the step's scale); after it, the bytes and scale are a `Float8GatheredWeight`, whose cast the
layer takes. A tensor-wise cast is elementwise once its scale is fixed, so the gathered cast is
bit for bit one process's. The weight amax a delayed step records is the global one, so weight
histories agree on all ranks. Outside a te_func call (FSDP's re-gather for backward) the shard
is cast by the current-scaling rule; high precision or another recipe raises an error."""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from ..functional._gemm import starts_step
from ..nn import TEModule
from ..nn.context import current_frame, microbatch
from ..quant import (DelayedState, Quantized, WeightCast, delayed_update, dequantize, lower, scale_from_amax,
                     scheme_for, transpose)
from ..quant.tensor import amax_of, cast_with_scale, record_amax
from ..quant.workspace import CarriedCast
from ._fsdp import _is_dtensor

__all__ = ["Float8AllGatherWeight", "Float8GatheredWeight", "enable_fsdp_float8_all_gather"]

_aten = torch.ops.aten

# The ops FSDP shards, pads and moves a parameter with keep the subclass, so a shard can cast itself.
_KEEP_SUBCLASS = {_aten.detach.default, _aten.alias.default, _aten.empty_like.default, _aten.new_zeros.default,
                  _aten.slice.Tensor, _aten.copy_.default, _aten.view.default, _aten.as_strided.default,
                  _aten._to_copy.default, _aten._pin_memory.default, _aten.split.Tensor, _aten.clone.default}


def _wrapper(cls, like: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
    return torch.Tensor._make_wrapper_subclass(cls, like.size(), strides=like.stride(), dtype=dtype,
                                               device=like.device, requires_grad=requires_grad)


class Float8AllGatherWeight(torch.Tensor):
    """A GEMM weight FSDP all-gathers in FP8; every op but FSDP's sees the plain tensor it wraps."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe):
        return _wrapper(cls, tensor, tensor.dtype, tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, recipe):
        self._tensor = tensor
        self._recipe = recipe

    def __repr__(self):
        return f"Float8AllGatherWeight({self._tensor!r}, recipe={self._recipe!r})"

    def __tensor_flatten__(self):
        return ["_tensor"], self._recipe

    @staticmethod
    def __tensor_unflatten__(inner, recipe, outer_size, outer_stride):
        return Float8AllGatherWeight(inner["_tensor"], recipe)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        recipe = next(a._recipe for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, recipe), out)

    # --- FSDP2's all-gather extension ---------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard cast to FP8, padded to FSDP's shard size; metadata: (scale_inv, amax)."""
        s = scheme_for(self._recipe, "weight")
        local = self._tensor                                                   # (rows here, in)
        with torch.no_grad():
            amax = amax_of(local)      # an empty shard (more ranks than rows) gives 0, of the same dtype
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())   # the whole weight's
            scale = _delayed_scale(self._recipe, module, self)
            if scale is None:
                scale = scale_from_amax(amax, s.fp8_max, s.amax_epsilon, s.power_2_scale)
            q = cast_with_scale(local, scale, s)
            rows = -(-outer_size[0] // mesh.size())                            # FSDP pads every shard to this
            # The FP8 bytes as uint8: not every backend's all-gather takes the float8 dtypes (gloo does not).
            data = q.data.view(torch.uint8)
            if data.shape[0] < rows:
                data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data,), (q.scale_inv, amax)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs                                            # (padded rows, in) uint8
        scale_inv, amax = metadata
        if out is not None:            # FSDP reuses the buffer the bytes were gathered into
            out._scale_inv, out._amax = scale_inv, amax
            return None
        fp8 = data.view(scheme_for(self._recipe, "weight").dtype)
        return Float8GatheredWeight(fp8, scale_inv, amax, self._recipe, param_dtype), (data,)


def _param_name(module, shard) -> str:
    # FSDP names the module, not the parameter: find which (sharded) parameter this shard is.
    for name, p in module.named_parameters(recurse=False):
        if p is shard or (_is_dtensor(p) and p._local_tensor is shard):
            return name
    raise RuntimeError("te_func: an FP8 all-gather weight is not a parameter of the module FSDP named")


def _delayed_scale(recipe, module, shard):
    """The DelayedScaling scale this step's cast of `shard` uses, as the running call's GEMM will."""
    if not lower(recipe).keeps_history:
        return None
    frame = current_frame()
    owner = None if frame is None or frame.workspaces is None else frame.owners.get(id(module))
    if owner is None:
        return None
    if frame.recipe != recipe:
        raise ValueError(f"{type(module).__name__}'s weights are all-gathered in FP8 for {recipe!r}, but the model "
                         f"runs with {frame.recipe!r}: enable FP8 all-gather with the recipe you train with")
    prefix = f"{owner[0]}." if owner[0] else ""
    name = _param_name(module, shard)
    value = lambda key: frame.updates.get(prefix + key, frame.workspaces[prefix + key])  # noqa: E731
    state = DelayedState(value(f"{name}_amax_history").detach(), value(f"{name}_scale").detach())
    # As the layer will decide it, with the frame's update_state: FSDP all-gathers under no_grad.
    start = starts_step(microbatch(frame, owner)[0], frame.update_state)
    return delayed_update(state, recipe, "weight").scale if start else state.scale


class Float8GatheredWeight(CarriedCast):
    """The unsharded weight FSDP gathered in FP8 (data, scale_inv, the whole weight's amax): a te_func
    GEMM takes its cast from it; any other computation with it raises."""

    @staticmethod
    def __new__(cls, data, scale_inv, amax, recipe, dtype):
        return _wrapper(cls, data, dtype)

    def __init__(self, data, scale_inv, amax, recipe, dtype):
        self._data, self._scale_inv, self._amax, self._recipe = data, scale_inv, amax, recipe

    def __repr__(self):
        return f"Float8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, recipe={self._recipe!r})"

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv", "_amax"], (self._recipe, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8GatheredWeight(inner["_data"], inner["_scale_inv"], inner["_amax"], *meta)

    def te_func_weight_cast(self, s, state: DelayedState | None):
        """(WeightCast, new_state): the gathered bytes and their transpose, the whole weight's amax recorded."""
        if s != scheme_for(self._recipe, "weight"):
            raise ValueError(f"this weight was all-gathered in FP8 for {self._recipe!r} and cannot be cast as "
                             f"{s}: run the model with the recipe FP8 all-gather was enabled for")
        # A row-major copy: FSDP refills its all-gather buffer while the cast stays in the workspaces.
        q = Quantized.tensorwise(self._data.clone(memory_format=torch.contiguous_format), self._scale_inv.clone())
        return WeightCast(q, transpose(q)), None if state is None else record_amax(state, self._amax)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        w = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        if func in (_aten.detach.default, _aten.alias.default):
            return cls(w._data, w._scale_inv, w._amax, w._recipe, w.dtype)
        # FSDP trims the padding; a TransposedLinear reads weight.t(), whose cast is the transposed bytes.
        if func in (_aten.as_strided.default, _aten.view.default, _aten.t.default, _aten.transpose.int):
            data = func(w._data, *args[1:], **kwargs)
            return cls(data, w._scale_inv, w._amax, w._recipe, w.dtype)
        if func in (_aten.empty_like.default, _aten.zeros_like.default):  # a gradient buffer
            return torch.zeros(w.shape, dtype=kwargs.get("dtype") or w.dtype, device=w.device)
        if func in (_aten.isfinite.default, _aten.isnan.default, _aten.isinf.default):   # set_check_finite
            return func(dequantize(Quantized.tensorwise(w._data, w._scale_inv)))
        raise RuntimeError(
            f"te_func: {func} was called on a weight that FSDP all-gathered in FP8 for {w._recipe!r}; such a "
            f"weight only feeds te_func's FP8 GEMMs under that recipe. A high-precision (recipe=None) or "
            f"other-recipe call, or a non-te_func use of the weight, needs the model without "
            f"enable_fsdp_float8_all_gather")


def enable_fsdp_float8_all_gather(model: nn.Module, recipe) -> nn.Module:
    """Make FSDP all-gather every te_func GEMM weight of `model` in FP8 under `recipe` (tensor-wise);
    call it before `fully_shard`. Returns `model`, its GEMM weights Float8AllGatherWeights (tied
    weights stay as they are)."""
    if recipe is None or not lower(recipe).tensorwise:
        raise ValueError(f"FP8 all-gather covers the tensor-wise recipes (Float8CurrentScaling, DelayedScaling), got "
                         f"{type(recipe).__name__}: a block-scaled weight's blocks would have to follow FSDP's shard "
                         f"boundaries (MXFP8's columnwise blocks cross them), see docs/distributed.md")
    if recipe.backward_override == "high_precision":
        raise ValueError("FP8 all-gather with backward_override='high_precision': the backward would need the "
                         "high-precision weight, which is not gathered; use backward_override=None or 'dequantized'")
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for path, m in model.named_modules():
        if not isinstance(m, TEModule):
            continue
        for g in m.gemms():
            if m.gemm_param(g.weight) != g.weight:
                # Experts' 3-D parameters, one slice per GEMM: FSDP gathers them in high precision.
                continue
            p = getattr(m, g.weight)
            if uses[id(p)] > 1:
                # A tied weight (GPT-2's lm_head) needs its high-precision values elsewhere.
                continue
            if _is_dtensor(p):
                raise ValueError(f"enable_fsdp_float8_all_gather: {path}.{g.weight} is already a DTensor; call it "
                                 f"before fully_shard (and tensor parallelism is not covered)")
            if isinstance(p, Float8AllGatherWeight):
                raise ValueError(f"enable_fsdp_float8_all_gather was already applied to {path or 'the model'}")
            m.register_parameter(g.weight, nn.Parameter(Float8AllGatherWeight(p.data, recipe),
                                                        requires_grad=p.requires_grad))
        m.register_state_dict_post_hook(_plain_in_state_dict)
    return model


def _plain_in_state_dict(module, state_dict, prefix, local_metadata):
    # Checkpoints hold the plain values (sharing storage), loadable with or without FP8 all-gather.
    for k, v in state_dict.items():
        if k.startswith(prefix) and "." not in k[len(prefix):]:
            state_dict[k] = _unwrapped(v)


def _unwrapped(v):
    if isinstance(v, Float8AllGatherWeight):
        return v._tensor
    if _is_dtensor(v) and isinstance(v._local_tensor, Float8AllGatherWeight):
        from torch.distributed.tensor import DTensor
        with torch.no_grad():
            return DTensor.from_local(v._local_tensor._tensor, v.device_mesh, v.placements, run_check=False,
                                      shape=v.shape, stride=v.stride())
    return v
