"""Frozen GEMM layers: a te_func GEMM layer as inference keeps it (built by `tef.freeze`).

For each GEMM it holds only what the forward GEMM reads, named as the workspace entries they
come from: the weight's cast in the forward layout and its decode factors, and under
DelayedScaling the input's fixed scale; plus the layer's other parameters (requires_grad False)
and the recipe's fingerprint. Forward is the training layer's own math (te_func.ops through
`call_forward`, without an autograd node), so it computes what the trained layer computes with
its cached casts. docs/inference.md has the entries."""
from __future__ import annotations

import typing
from typing import Any

import torch
from torch import nn

from ..functional._common import autocast_input, check_input
from ..functional._fused import norm_config
from ..functional.experts import check_routing, combine, route
from ..functional.grouped_linear import fp8_split_sizes
from ..errors import EntryMismatchError, FrozenModelError, MissingEntryError, RecipeMismatchError
from ..ops import (GemmConfig, GemmSlot, GroupedLinearFP8, LayerNormLinearFP8, LayerNormMLPFP8, LinearFP8,
                   call_forward)
from ..ops.activations import activation_spec
from ..quant import Gemm, Quantized, lower
from ..quant.workspace import FORMAT_VERSION, RECIPE_ENTRY, RECIPE_KEY, fingerprint_entry
from ..recipe import fingerprint
from ._fused import te_outputs
from .experts import Experts, gate
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear, TransposedLinear
from .module import TEModule

__all__ = ["FrozenCast", "FrozenLayer", "FrozenLinear", "FrozenLayerNormLinear", "FrozenLayerNormMLP",
           "FrozenGroupedLinear", "FrozenExperts", "FROZEN_LAYERS"]


# Every distinct static config of the frozen layers, by its repr; layers keep the names. torch.compile
# checks an object once per place it is read from: once per graph here, not per layer and call.
_CONFIGS: dict[str, Any] = {}


def _interned(config) -> str:
    """The name under which `config` (a frozen dataclass: its repr says all it holds) is in _CONFIGS."""
    name = repr(config)
    _CONFIGS.setdefault(name, config)
    return name


class FrozenCast(nn.Module):
    """One GEMM weight's forward cast: buffers `data` (out, in), `scale_inv` and NVFP4's `global_amax`."""
    data: torch.Tensor
    scale_inv: torch.Tensor
    global_amax: torch.Tensor | None

    def __init__(self, cast: Quantized):
        super().__init__()
        self.block, self.columns = cast.block, cast.columns
        self.register_buffer("data", cast.data)
        self.register_buffer("scale_inv", cast.scale_inv)
        self.register_buffer("global_amax", cast.global_amax)

    def quantized(self) -> Quantized:
        return Quantized(self.data, self.scale_inv, self.block, self.global_amax, self.columns)


class FrozenLayer(nn.Module):
    """What the frozen layers share: their state, the checks of a call and of a checkpoint.
    source: the te_func layer (its GEMM weights are not read); casts / input_scales: GEMM weight
    name -> forward cast / DelayedScaling input scale; weight_only_tokens: as tef.freeze's."""
    features_attr = "in_features"      # the option that names the input's last dim
    # The source's options a call reads (copied from it in __init__), and the cast's buffers.
    in_features: int
    out_features: int
    hidden_size: int
    num_gemms: int
    normalization: str
    eps: float
    zero_centered_gamma: bool
    activation: str
    activation_params: dict | None
    return_bias: bool
    return_layernorm_output: bool

    def __init__(self, source: TEModule, recipe, casts: dict, input_scales: dict, weight_only_tokens: int = 0,
                 weight_meta: dict | None = None):
        super().__init__()
        self.layer = f"frozen {type(source).__name__}"
        # The source's options (in_features, eps, activation, return_bias, ...), as plain attributes.
        for k, v in vars(source).items():
            if not k.startswith("_") and k != "training":
                setattr(self, k, v)
        self.recipe, self.weight_only_tokens = recipe, weight_only_tokens
        # GEMM weight parameter name -> (shape, dtype) of the trained parameter (_gemm_weight below).
        self._weight_meta = dict(weight_meta or {})
        self.gemm_specs = tuple(source.gemms())
        # What a call reads, as strings of this layer's own: torch.compile guards every shared object
        # read through two layers (a Python check per layer and call), and a getattr that misses (an
        # input-scale buffer, named only where it exists) by raising AttributeError on every call.
        self._recipe_name = type(recipe).__name__
        delayed = lower(recipe).keeps_history
        self._gemm_names = tuple((g.weight, f"{g.prefix}input_scale" if delayed else None)
                                 for g in self.gemm_specs)
        weights = {source.gemm_param(g.weight) for g in self.gemm_specs}
        for name, p in source._parameters.items():
            if name not in weights:
                self.register_parameter(name, None if p is None else nn.Parameter(p.detach(), requires_grad=False))
        for g in self.gemm_specs:
            self.add_module(f"{g.weight}_cast", FrozenCast(casts[g.weight]))
            if delayed:
                self.register_buffer(f"{g.prefix}input_scale", input_scales[g.weight])
        # Each input scale's reciprocal, made here (and on each load), not by every call.
        self._make_input_scale_invs()
        self.register_load_state_dict_post_hook(_after_load)
        self.register_buffer(RECIPE_KEY, fingerprint_entry(recipe, casts[self.gemm_specs[0].weight].data.device))
        # Both GEMM configs a call can pick, made once: FP8 x FP8, and weight-only for few tokens.
        gemm = tuple(GemmConfig.of(recipe, save_input=False, weight_only=w) for w in (False, True))
        self._config_names = tuple(_interned(c) for c in gemm)
        norm: tuple = ()
        if hasattr(self, "normalization"):      # the norm-fused layers
            norm = (norm_config(self.layer, self.normalization, self.eps, self.zero_centered_gamma),)
            self._norm_name = _interned(norm[0])
        self._configs = gemm + norm   # kept for a pickle of the layer to bring into another process's table

    def __setstate__(self, state):
        super().__setstate__(state)
        for config in self._configs:        # unpickled in a process that has not made them yet
            _interned(config)
        self._make_input_scale_invs()       # pickled by a te_func that kept none
        if _after_load not in self._load_state_dict_post_hooks.values():
            self.register_load_state_dict_post_hook(_after_load)

    def _make_input_scale_invs(self):
        """Non-persistent buffers `{scale}_inv`: each input scale's reciprocal, as the cast computes it."""
        for _, scale_name in self._gemm_names:
            if scale_name is not None:
                self.register_buffer(scale_name + "_inv", torch.reciprocal(getattr(self, scale_name)),
                                     persistent=False)

    # --- a call -------------------------------------------------------------------------------

    def _params(self) -> dict:
        return {k: p for k, p in self._parameters.items() if p is not None}

    def _tokens(self, inp: torch.Tensor) -> torch.Tensor:
        """The checked input in autocast's dtype (as the training layer takes it)."""
        features = getattr(self, self.features_attr)
        check_input(self.layer, inp, features, self._params(), recipe=self._recipe_name)
        if torch.is_grad_enabled() and inp.requires_grad:
            raise FrozenModelError(f"{self.layer}: a frozen model (tef.freeze) is for inference only: it keeps "
                                   f"no high-precision weights and computes no gradients, and its input requires "
                                   f"grad. Call it under torch.no_grad() or torch.inference_mode() on inputs that "
                                   f"do not require grad; to train, train the model itself and freeze it afterwards")
        device = self.get_submodule(f"{self._gemm_names[0][0]}_cast").data.device
        if inp.device != device:
            raise ValueError(f"{self.layer}: input is on {inp.device} but the frozen weights are on {device}; "
                             f"move one of them (frozen.to(device) or inp.to(device))")
        return autocast_input(inp)

    def _slots(self, tokens) -> tuple[tuple[GemmSlot, ...], dict]:
        """(one slot per GEMM, their tensors by name) for `tokens` tokens, weight-only by the shape."""
        weight_only = self.weight_only_tokens > 0 and tokens <= self.weight_only_tokens
        cfg = _CONFIGS[self._config_names[int(weight_only)]]
        slots, tensors = [], {}
        for weight, scale_name in self._gemm_names:
            slot = GemmSlot(cfg, Gemm(weight))
            # Weight-only GEMMs do not quantize their input: its scale is not read (nor guarded).
            scale, scale_inv = (None, None) if scale_name is None or weight_only else \
                (getattr(self, scale_name), getattr(self, scale_name + "_inv"))
            cast = typing.cast(FrozenCast, self.get_submodule(f"{weight}_cast"))
            tensors.update(slot.forward_inputs(cast.quantized(), scale, scale_inv))
            slots.append(slot)
        return tuple(slots), tensors

    # --- a checkpoint -------------------------------------------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        own = {**{k: v for k, v in self._parameters.items() if v is not None}, **self._buffers,
               **{f"{n}.{k}": v for n, m in self._modules.items() for k, v in m._buffers.items()}}
        if any(prefix + k in state_dict for k in own):
            self._upgrade_format2(state_dict, prefix, own)
            self._check_checkpoint(state_dict, prefix, own)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @staticmethod
    def _upgrade_format2(state_dict, prefix, own):
        # Workspace format 2 kept MXFP8's scales as float8_e8m0fnu; format 3 keeps their bytes.
        made_for = state_dict.get(prefix + RECIPE_KEY)
        if made_for is None or tuple(made_for.shape) != RECIPE_ENTRY.shape or made_for.dtype != RECIPE_ENTRY.dtype \
                or made_for.device.type == "meta" or int(made_for[0]) != 2:
            return
        for k in own:
            t = state_dict.get(prefix + k)
            if t is not None and t.dtype == torch.float8_e8m0fnu:
                state_dict[prefix + k] = t.view(torch.uint8)
        state_dict[prefix + RECIPE_KEY] = torch.stack([torch.full_like(made_for[0], FORMAT_VERSION), made_for[1]])

    def _check_checkpoint(self, state_dict, prefix, own):
        where = prefix.rstrip(".") or "(root)"
        made_for = state_dict.get(prefix + RECIPE_KEY)
        if made_for is None:
            raise MissingEntryError(f"{self.layer} at {where!r}: the checkpoint has no {prefix + RECIPE_KEY!r} entry, "
                                    f"so which recipe made its FP8 casts is unknown: it is not a frozen te_func "
                                    f"checkpoint (save one with frozen.state_dict())", entry=prefix + RECIPE_KEY)
        if tuple(made_for.shape) != RECIPE_ENTRY.shape or made_for.dtype != RECIPE_ENTRY.dtype or \
                made_for.device.type == "meta":
            raise EntryMismatchError(f"{self.layer} at {where!r}: checkpoint entry {prefix + RECIPE_KEY!r} is not a "
                                     f"te_func recipe fingerprint ({RECIPE_ENTRY.shape} int64)",
                                     entry=prefix + RECIPE_KEY, expected=RECIPE_ENTRY.shape, got=tuple(made_for.shape))
        version, fp = made_for.tolist()
        if version != FORMAT_VERSION or fp != fingerprint(self.recipe):
            raise RecipeMismatchError(f"{self.layer} at {where!r}: this frozen checkpoint was made for another recipe "
                                      f"(or other recipe options, or te_func format {version}) than {self.recipe!r}; "
                                      f"its FP8 casts cannot be read under this one. Freeze with the checkpoint's "
                                      f"recipe, or freeze the trained model again with this one", recipe=self.recipe)
        for k, v in own.items():
            t = state_dict.get(prefix + k)
            if t is not None and (tuple(t.shape) != tuple(v.shape) or t.dtype != v.dtype):
                raise EntryMismatchError(f"{self.layer} at {where!r}: checkpoint entry {prefix + k!r} has shape "
                                         f"{tuple(t.shape)} and dtype {t.dtype}, but this layer holds "
                                         f"{tuple(v.shape)} {v.dtype}: the checkpoint is of another model",
                                         entry=prefix + k, expected=(tuple(v.shape), v.dtype),
                                         got=(tuple(t.shape), t.dtype))

    def extra_repr(self) -> str:
        return f"recipe={self.recipe!r}, weight_only_tokens={self.weight_only_tokens}"


def _gemm_weight(name: str) -> property:
    """`layer.<name>` for a frozen GEMM weight: an empty `meta` tensor of the trained parameter's shape
    and dtype. Model code reads it for its dtype (T5 casts activations to `wo.weight.dtype`), and a
    frozen model must do what the trained one did; computing with it fails."""
    def get(self):
        meta = (getattr(self, "_weight_meta", None) or {}).get(name)
        if meta is None:
            raise AttributeError(f"{type(self).__name__} keeps no {name!r}: only its FP8 cast, {name}_cast")
        return torch.empty(meta[0], dtype=meta[1], device="meta")
    return property(get, doc=f"A meta tensor with the shape and dtype of the trained layer's {name!r}.")


def _after_load(layer: FrozenLayer, incompatible_keys):
    # A load_state_dict post-hook: the input scales may be new (or, with assign=True, the first real ones).
    layer._make_input_scale_invs()


class FrozenLinear(FrozenLayer):
    """Frozen Linear and TransposedLinear: returns what the source layer returns."""

    def forward(self, inp: torch.Tensor, *, is_first_microbatch: bool | None = None):
        inp = self._tokens(inp)
        x = inp.reshape(-1, self.in_features)                                       # (tokens, in)
        (slot,), t = self._slots(x.shape[0])
        out = call_forward(LinearFP8(slot), x=x, bias=None if self.return_bias else self.bias, **t)["out"]
        out = out.reshape(*inp.shape[:-1], self.out_features)
        return (out, self.bias) if self.return_bias else out

    weight = _gemm_weight("weight")


class FrozenLayerNormLinear(FrozenLayer):
    """Frozen LayerNormLinear: returns what the source layer returns."""

    def forward(self, inp: torch.Tensor, *, is_first_microbatch: bool | None = None):
        inp = self._tokens(inp)
        x = inp.reshape(-1, self.in_features)                                       # (tokens, in)
        (slot,), t = self._slots(x.shape[0])
        norm = _CONFIGS[self._norm_name]
        res = call_forward(LayerNormLinearFP8(slot, norm), x=x, ln_weight=self.layer_norm_weight,
                           ln_bias=self.layer_norm_bias, bias=None if self.return_bias else self.bias, **t)
        out = res["out"].reshape(*inp.shape[:-1], self.out_features)
        ln_out = res["ln_out"].reshape(inp.shape) if self.return_layernorm_output else None
        return te_outputs(out, self.bias, ln_out, self.return_bias, self.return_layernorm_output)

    weight = _gemm_weight("weight")


class FrozenLayerNormMLP(FrozenLayer):
    """Frozen LayerNormMLP: returns what the source layer returns."""
    features_attr = "hidden_size"

    def forward(self, inp: torch.Tensor, *, is_first_microbatch: bool | None = None):
        inp = self._tokens(inp)
        x = inp.reshape(-1, self.hidden_size)                                       # (tokens, hidden)
        (fc1, fc2), t = self._slots(x.shape[0])
        op = LayerNormMLPFP8(fc1, fc2, _CONFIGS[self._norm_name],
                             activation_spec(self.activation, self.activation_params))
        res = call_forward(op, x=x, ln_weight=self.layer_norm_weight,
                           ln_bias=self.layer_norm_bias, fc1_bias=self.fc1_bias,
                           fc2_bias=None if self.return_bias else self.fc2_bias, **t)
        out = res["out"].reshape(inp.shape)
        ln_out = res["ln_out"].reshape(inp.shape) if self.return_layernorm_output else None
        return te_outputs(out, self.fc2_bias, ln_out, self.return_bias, self.return_layernorm_output)

    fc1_weight = _gemm_weight("fc1_weight")
    fc2_weight = _gemm_weight("fc2_weight")


class FrozenGroupedLinear(FrozenLayer):
    """Frozen GroupedLinear: forward(inp, m_splits) as the source layer's."""

    def forward(self, inp: torch.Tensor, m_splits, *, is_first_microbatch: bool | None = None):
        inp = self._tokens(inp)
        x = inp.reshape(-1, self.in_features)                                       # (tokens, in)
        sizes = fp8_split_sizes(m_splits, self.num_gemms, x.shape[0], self._recipe_name, self.layer)
        slots, t = self._slots(x.shape[0])
        res = call_forward(GroupedLinearFP8(slots), x=x, **{f"m{i}": m for i, m in enumerate(sizes)},
                           **{f"bias{i}": getattr(self, f"bias{i}") for i in range(self.num_gemms)}, **t)
        return res["out"].reshape(*inp.shape[:-1], self.out_features)


class FrozenExperts(FrozenLayer):
    """Frozen Experts: forward(hidden_states, top_k_index, top_k_weights) as the source layer's under
    its recipe. Each expert's token count is read on the host (as FrozenGroupedLinear's m_splits),
    so under torch.compile it stops with that error; see docs/layers.md, "Experts"."""
    features_attr = "hidden_dim"
    num_experts: int
    hidden_dim: int
    up_name: str
    has_gate: bool
    down_proj_bias: torch.Tensor | None

    def __init__(self, source: TEModule, *args, **kwargs):
        super().__init__(source, *args, **kwargs)
        assert isinstance(source, Experts)
        self.act_fn, self._custom_gate = source.act_fn, source._custom_gate

    def _grouped(self, slots, x: torch.Tensor, sizes: list, bias: torch.Tensor | None, t: dict) -> torch.Tensor:
        biases = {f"bias{i}": None if bias is None else bias[i] for i in range(self.num_experts)}
        return call_forward(GroupedLinearFP8(slots), x=x, **{f"m{i}": m for i, m in enumerate(sizes)}, **biases,
                            **t)["out"]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        inp = self._tokens(hidden_states)
        check_routing(self.layer, inp, top_k_index, top_k_weights)
        x = inp.reshape(-1, self.hidden_dim)                                        # (tokens, hidden)
        if torch.compiler.is_compiling():
            raise ValueError(f"{self.layer}: a frozen model reads each expert's token count on the host, which "
                             f"torch.compile cannot trace under FP8; run the frozen model eagerly, or compile the "
                             f"trained model's forward (tef.functional_call under torch.no_grad), whose counts stay "
                             f"on the device under current and delayed scaling")
        k, n = top_k_index.shape[-1], self.num_experts
        order, counts = route(top_k_index, n)
        sizes = fp8_split_sizes(counts, n, order.shape[0], self._recipe_name, self.layer)
        slots, t = self._slots(order.shape[0])
        h = self._grouped(slots[:n], x[order // k], sizes, getattr(self, f"{self.up_name}_bias"), t)
        y = self._grouped(slots[n:], gate(self, h), sizes, self.down_proj_bias, t)
        return combine(y, top_k_weights, order, inp.dtype).reshape(hidden_states.shape)

    gate_up_proj = _gemm_weight("gate_up_proj")
    up_proj = _gemm_weight("up_proj")
    down_proj = _gemm_weight("down_proj")


# Each te_func GEMM layer's frozen form (exact types: a subclass may compute something else).
FROZEN_LAYERS = {Linear: FrozenLinear, TransposedLinear: FrozenLinear, LayerNormLinear: FrozenLayerNormLinear,
                 LayerNormMLP: FrozenLayerNormMLP, GroupedLinear: FrozenGroupedLinear, Experts: FrozenExperts}
