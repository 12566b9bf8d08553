"""What libraries that take a torch model need to know about te_func's layers.

peft attaches LoRA to the layer types it knows; te_func's Linear is not a `torch.nn.Linear`,
so a LoraConfig learns it from `lora_config`. The adapters peft adds are plain torch layers
(high precision); the base GEMM they sit beside stays te_func's (FP8 under the shell's recipe).
docs/integrations.md shows each library's calls.
"""
from __future__ import annotations

from .nn import Linear, TransposedLinear

__all__ = ["lora_config"]


def lora_config(config):
    """`config` (a peft LoraConfig) with te_func's Linear and TransposedLinear registered as layers
    LoRA attaches to, through peft's LoRA Linear (TransposedLinear, whose weight is stored
    (in, out) as transformers' Conv1D, with fan_in_fan_out). Returns `config`, changed in place.
    Use it for get_peft_model on a converted model, and for PeftModel.from_pretrained onto one
    (config=tef.integrations.lora_config(LoraConfig.from_pretrained(path)))."""
    from peft.tuners.lora import Linear as LoraLinear

    class LoraTransposedLinear(LoraLinear):
        # peft's LoRA Linear, reading the weight as stored (in, out), as it reads Conv1D's
        def __init__(self, base_layer, adapter_name, config, **kwargs):
            config.fan_in_fan_out = True
            super().__init__(base_layer, adapter_name, config=config, is_target_conv_1d_layer=True, **kwargs)

    # The subclass first: a TransposedLinear is a Linear, and peft takes the first type that matches.
    config._register_custom_module({TransposedLinear: LoraTransposedLinear, Linear: LoraLinear})
    return config
