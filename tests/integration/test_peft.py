"""peft on te_func models, as peft's docs drive a plain model: LoRA put on a converted model
(tef.integrations.lora_config tells peft te_func's Linear), trained with the base GEMM in FP8 and
the adapters in high precision, saved and loaded as peft adapters, merged and unloaded; and
LoRA first, converted second."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import te_func as tef
from cases import sqnr, tiny_gpt2, tiny_llama, tiny_mixtral
from te_func.recipe import DelayedScaling, Float8CurrentScaling

MODELS = [pytest.param(tiny_llama, ["q_proj", "v_proj"], id="llama"),
          pytest.param(tiny_gpt2, ["c_attn"], id="gpt2"),      # Conv1D: a TransposedLinear once converted
          # a mixture of experts: the adapters on attention, the frozen experts' GEMMs in FP8 beside them
          pytest.param(lambda: tiny_mixtral(layers=1), ["q_proj", "v_proj"], id="mixtral")]
RECIPES = [pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(DelayedScaling(amax_history_len=4), id="delayed")]


def converted(make):
    torch.manual_seed(0)        # the same base weights for every copy
    return tef.convert(make())


def lora(model, targets):
    return get_peft_model(model, tef.integrations.lora_config(LoraConfig(target_modules=targets, r=4,
                                                                          init_lora_weights=False)))


def logits(model, recipe, ids):
    ws = tef.init_workspaces(model, recipe)
    with torch.no_grad():
        return tef.functional_call(model, dict(model.named_parameters()), ws, (), {"input_ids": ids},
                                   recipe=recipe)[0].logits


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("make,targets", MODELS)
def test_lora_on_a_converted_model_trains_its_adapters_beside_an_fp8_base(make, targets, recipe):
    model = lora(converted(make), targets)
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in k for k in trainable)
    base = {k: p.detach().clone() for k, p in model.named_parameters() if not p.requires_grad}
    shell = tef.Stateful(model, recipe)
    # The base GEMM is te_func's, under the recipe: its weight cast is in the workspaces.
    assert any(k.endswith(f"{targets[0]}.base_layer.weight_cast.data") for k in shell.workspaces)
    ids = torch.randint(0, 100, (2, 8))
    ref = logits(model, None, ids)
    assert 18 < sqnr(ref, logits(model, recipe, ids)) < 200        # FP8, not high precision
    opt = torch.optim.AdamW([p for p in shell.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = shell(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in shell.parameters() if p.requires_grad)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, base[k]) for k, p in model.named_parameters() if k in base)   # the base stays


@pytest.mark.parametrize("make,targets", MODELS)
def test_adapters_save_and_load_onto_a_converted_model(make, targets, tmp_path):
    model = lora(converted(make), targets)
    model.save_pretrained(tmp_path)
    config = tef.integrations.lora_config(LoraConfig.from_pretrained(tmp_path))
    loaded = PeftModel.from_pretrained(converted(make), tmp_path, config=config)
    ids = torch.randint(0, 100, (2, 8))
    recipe = Float8CurrentScaling()
    assert torch.equal(logits(model, recipe, ids), logits(loaded, recipe, ids))


@pytest.mark.parametrize("make,targets", MODELS)
def test_merge_and_unload_leaves_te_func_layers_and_the_old_shell_says_what_changed(make, targets):
    model = lora(converted(make), targets)
    shell = tef.Stateful(model, DelayedScaling(amax_history_len=4))
    ids = torch.randint(0, 100, (2, 8))
    shell(input_ids=ids, labels=ids).loss.backward()
    unmerged = logits(model, None, ids)
    merged = model.merge_and_unload()
    assert not any("lora_" in k for k, _ in merged.named_parameters())
    assert torch.allclose(logits(merged, None, ids), unmerged, atol=1e-5)
    with pytest.raises(tef.errors.MissingEntryError, match=r"te_func layers changed.*shell\.reset_workspaces\(\)"):
        shell(input_ids=ids)
    fresh = tef.Stateful(merged, DelayedScaling(amax_history_len=4))
    fresh(input_ids=ids, labels=ids).loss.backward()


def test_lora_first_then_convert_puts_the_base_layers_in_fp8():
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj", "v_proj"], r=4))
    tef.convert(model)
    assert isinstance(model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.base_layer"),
                      tef.nn.Linear)
    shell = tef.Stateful(model, Float8CurrentScaling())
    ids = torch.randint(0, 100, (2, 8))
    shell(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in shell.parameters() if p.requires_grad)
