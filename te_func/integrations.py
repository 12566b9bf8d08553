"""What libraries that take a torch model need to know about te_func's layers (docs/integrations.md).

peft: te_func's Linear is not a `torch.nn.Linear`, so a LoraConfig learns it from `lora_config`;
the adapters stay plain torch layers beside the FP8 base GEMM. opacus: `register_opacus` gives
it te_func's per-sample gradient, each sample quantized on its own. HF Trainer: `TrainerMixin`
saves a `tef.Stateful` as `shell.save_pretrained` does and loads it back on resume."""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .errors import TransformError
from .frame import functional_call, init_workspaces
from .nn import GroupedLinear, LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm, TransposedLinear
from .nn.context import last_recipe
from .quant import lower
from .shell import WORKSPACES_FILE, Stateful

# Trainer (TrainerMixin on transformers.Trainer) is made on first use: see __getattr__.
__all__ = ["TrainerMixin", "lora_config", "register_opacus"]


def lora_config(config):
    """`config` (a peft LoraConfig), changed in place, with te_func's Linear and TransposedLinear
    (fan_in_fan_out, as Conv1D) registered as layers LoRA attaches to. For get_peft_model on a converted
    model, and PeftModel.from_pretrained onto one (config=lora_config(LoraConfig.from_pretrained(path)))."""
    from peft.tuners.lora import Linear as LoraLinear

    class LoraTransposedLinear(LoraLinear):
        # peft's LoRA Linear, reading the weight as stored (in, out), as it reads Conv1D's
        def __init__(self, base_layer, adapter_name, config, **kwargs):
            config.fan_in_fan_out = True
            super().__init__(base_layer, adapter_name, config=config, is_target_conv_1d_layer=True, **kwargs)

    # The subclass first: a TransposedLinear is a Linear, and peft takes the first type that matches.
    config._register_custom_module({TransposedLinear: LoraTransposedLinear, Linear: LoraLinear})
    return config


def register_opacus() -> None:
    """Give opacus the per-sample gradients of te_func's layers; call it once, before wrapping the
    model. Each sample's gradient is te_func's for that sample alone (scope="sample"). Recipes whose
    scales mix the samples in the batch's forward and input gradients (Lowering.token_local: tensor-wise
    current scaling, NVFP4, DelayedScaling) are refused when a per-sample gradient is asked for."""
    from opacus.grad_sample import register_grad_sampler
    register_grad_sampler([Linear, TransposedLinear, LayerNormLinear, LayerNormMLP, LayerNorm, RMSNorm])(
        _per_sample_grads)
    register_grad_sampler(GroupedLinear)(_refuse_grouped)


def _per_sample_grads(layer, activations: list, backprops: torch.Tensor) -> dict:
    """opacus's grad sampler: {parameter: (batch, *shape)}, by vmap over te_func's per-sample gradient."""
    recipe = last_recipe(layer)
    if not lower(recipe).token_local:
        raise TransformError(
            f"{type(layer).__name__} ran under {type(recipe).__name__}, whose scales couple the samples of a "
            f"batch: a tensor-wise scale is one number for the whole batch (current scaling, NVFP4's "
            f"per-tensor amax), DelayedScaling's comes from earlier batches' amaxes. A sample's clipped gradient "
            f"would then depend on the others, which differential privacy's accounting does not allow. Train "
            f"under opacus with MXFP8BlockScaling or Float8BlockScaling (every scale from one token's values), "
            f"or take per-sample gradients with tef.per_sample_grad(..., scope='sample'), which runs each sample "
            f"on its own under any recipe")
    bare = _WithoutHooks(layer)
    params = {f"layer.{name}": p for name, p in layer.named_parameters(recurse=False) if p.requires_grad}
    ws = init_workspaces(bare, recipe)          # the current weights' casts: the forward's weights

    def sample_loss(p, x, g):
        # d/d(out) of sum(out * g) is g: the layer's backward with the sample's output gradient
        out, _ = functional_call(bare, p, ws, (x,), recipe=recipe)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(layer).__name__}: per-sample gradients under opacus take a layer that "
                            f"returns one tensor (return_bias and return_layernorm_output off)")
        return (out.float() * g.float()).sum()

    grads = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(params, activations[0], backprops)
    return {params[name]: g for name, g in grads.items()}


class _WithoutHooks(nn.Module):
    """`layer` called without its module hooks (opacus's must not see the grad sampler's calls)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer.forward(x)


def _refuse_grouped(layer, activations: list, backprops: torch.Tensor) -> dict:
    raise TransformError("GroupedLinear: per-sample gradients need each sample's m_splits, which the batch's "
                         "m_splits do not say; compute them with tef.per_sample_grad over a function that "
                         "routes each sample")


class TrainerMixin:
    """Mixed in before a transformers Trainer for a `tef.Stateful` of a HuggingFace model: evaluation
    knows its label names, microbatches reuse a step's casts, and the shell saves and loads as
    `save_pretrained` / `load_pretrained` do. Other models save and load as the Trainer does."""

    # What the mixin reads of the Trainer it is mixed into.
    accelerator: Any
    is_fsdp_enabled: bool
    is_deepspeed_enabled: bool

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        shell = self._stateful(self.model)
        if shell is not None and self.args.label_names is None:
            # The Trainer reads label names from the model's class; the shell's names none.
            from transformers.trainer_utils import unwrap_peft_model
            from transformers.utils.generic import can_return_loss, find_labels
            model_class = type(unwrap_peft_model(shell.model))
            self.label_names, self.can_return_loss = find_labels(model_class), can_return_loss(model_class)

    def training_step(self, model, inputs, *args, **kwargs):
        # A step's first microbatch casts the weights, the others reuse them (as TE).
        shell = self._stateful(model)
        if shell is not None and shell.weight_cache and "is_first_microbatch" not in inputs:
            inputs = {**inputs, "is_first_microbatch": getattr(self, "_next_is_first", True)}
        try:
            return super().training_step(model, inputs, *args, **kwargs)
        finally:   # the optimizer steps after the microbatch that syncs the gradients
            self._next_is_first = self.accelerator.sync_gradients

    def _stateful(self, model) -> Stateful | None:
        """The shell the Trainer's model is (under its DDP / compile wrappers), or None."""
        shell = self.accelerator.unwrap_model(model)
        return shell if isinstance(shell, Stateful) else None

    def _shell(self, model=None) -> Stateful | None:
        """The shell whose HF folder this Trainer saves and loads, or None (the Trainer's own way)."""
        shell = self._stateful(self.model if model is None else model)
        if shell is None or self.is_fsdp_enabled or self.is_deepspeed_enabled:     # those save their own way
            return None
        from transformers import PreTrainedModel      # a peft model saves its adapters: the Trainer's way
        return shell if isinstance(shell.model, PreTrainedModel) else None

    def _save(self, output_dir=None, state_dict=None):
        shell = self._shell()
        if shell is None:
            return super()._save(output_dir, state_dict)
        if state_dict is not None:      # given by the caller as the shell's: the model's part
            state_dict = {k.removeprefix("model."): v for k, v in state_dict.items() if k.startswith("model.")}
        model = self.model
        self.model = shell.model        # the Trainer writes a PreTrainedModel's own folder
        try:
            super()._save(output_dir, state_dict)
        finally:
            self.model = model
        if self.args.should_save:
            shell.save_workspaces(self.args.output_dir if output_dir is None else output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        shell = self._shell(model)
        if shell is None or not os.path.isfile(os.path.join(resume_from_checkpoint, WORKSPACES_FILE)):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        shell.load_pretrained(resume_from_checkpoint)

    def _load_best_model(self):
        shell, best = self._shell(), self.state.best_model_checkpoint
        if shell is None or not os.path.isfile(os.path.join(best, WORKSPACES_FILE)):
            return super()._load_best_model()
        shell.load_pretrained(best)


def __getattr__(name: str):
    # `Trainer`, made when first asked for: importing transformers takes seconds.
    if name != "Trainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import transformers
    trainer = type("Trainer", (TrainerMixin, transformers.Trainer), {
        "__module__": __name__, "__doc__": "transformers.Trainer with TrainerMixin: a tef.Stateful saves and "
                                           "resumes as its save_pretrained and load_pretrained do."})
    globals()["Trainer"] = trainer
    return trainer
