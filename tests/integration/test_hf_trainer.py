"""HuggingFace Trainer on a tef.Stateful, with the Trainer's defaults (remove_unused_columns
included): the shell shows its model's signature and attributes, trains in FP8, saves a folder
from_pretrained loads, and a converted model handed over without a shell says it runs in high
precision."""
from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import te_func as tef
from cases import bits, tiny_gpt2, tiny_llama
from te_func.nn import context
from te_func.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = [pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(DelayedScaling(amax_history_len=4), id="delayed")]


def shell_of(recipe):
    torch.manual_seed(0)
    return tef.Stateful(tef.convert(tiny_llama()), recipe)


def dataset(n=8, tokens=16):
    # An extra column, as a tokenized dataset has: the Trainer drops what forward does not name.
    return [{"input_ids": torch.randint(0, 128, (tokens,)), "labels": torch.randint(0, 128, (tokens,)),
             "source": torch.tensor(i)} for i in range(n)]


def trainer(model, tmp_path, steps=2, cls=Trainer, data=None, eval_data=None, **kwargs):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps,
                             report_to=[], use_cpu=True, logging_steps=1, seed=0, **{"save_strategy": "no", **kwargs})
    return cls(model=model, args=args, train_dataset=dataset() if data is None else data, eval_dataset=eval_data)


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(bits(v), bits(sb[k])) for k, v in sa.items())


def test_the_shell_shows_its_models_signature_and_attributes():
    shell = shell_of(Float8CurrentScaling())
    params = inspect.signature(shell.forward).parameters
    assert {"input_ids", "attention_mask", "labels", "is_first_microbatch"} <= set(params)
    assert shell.config is shell.model.config
    assert shell.main_input_name == "input_ids" and shell.can_generate()
    with pytest.raises(AttributeError):
        shell.no_such_attribute


@pytest.mark.parametrize("recipe", RECIPES)
def test_trainer_with_its_defaults_trains_a_shell_in_fp8(recipe, tmp_path):
    shell = shell_of(recipe)
    before = {k: v.clone() for k, v in shell.workspaces.items()}
    t = trainer(shell, tmp_path)
    assert t.args.remove_unused_columns
    t.train()
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # The recipe ran: the weight casts are new, and under DelayedScaling the histories recorded amaxes.
    key = "model.layers.0.self_attn.q_proj.weight_cast.data"
    assert not torch.equal(bits(shell.workspaces[key]), bits(before[key]))
    if isinstance(recipe, DelayedScaling):
        assert shell.workspaces["model.layers.0.self_attn.q_proj.grad_amax_history"].abs().sum() > 0


def test_save_pretrained_writes_a_folder_from_pretrained_loads_and_the_run_resumes(tmp_path):
    recipe = DelayedScaling(amax_history_len=4)
    shell = shell_of(recipe)
    ids = torch.randint(0, 128, (2, 16))
    opt = torch.optim.SGD(shell.parameters(), lr=1e-2)
    for _ in range(2):
        shell(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    shell.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)      # the model's own names: a plain HF folder
    resumed = tef.Stateful(tef.convert(model), recipe)
    resumed.load_workspaces(tmp_path)
    for k, v in shell.workspaces.items():
        assert torch.equal(bits(resumed.workspaces[k]), bits(v)), k
    a, b = shell(input_ids=ids, labels=ids).loss, resumed(input_ids=ids, labels=ids).loss
    assert torch.equal(a, b)
    a.backward()
    b.backward()
    for k, v in shell.workspaces.items():
        assert torch.equal(bits(resumed.workspaces[k]), bits(v)), k


def test_te_funcs_trainer_saves_a_folder_from_pretrained_loads_with_the_workspaces(tmp_path):
    recipe = DelayedScaling(amax_history_len=4)
    shell = shell_of(recipe)
    t = trainer(shell, tmp_path, cls=tef.integrations.Trainer)
    t.train()
    t.save_model(str(tmp_path / "final"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    resumed = tef.Stateful(tef.convert(model), recipe)
    resumed.load_workspaces(tmp_path / "final")
    assert same_state(shell, resumed)
    ids = torch.randint(0, 128, (2, 16))
    assert torch.equal(shell(input_ids=ids, labels=ids).loss, resumed(input_ids=ids, labels=ids).loss)


def test_load_pretrained_takes_sharded_tied_weights_and_the_workspaces_back_in_place(tmp_path):
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    shell = tef.Stateful(tef.convert(tiny_gpt2()), recipe)     # GPT-2 ties lm_head to the embedding
    ids = torch.randint(0, 100, (2, 8))
    shell(input_ids=ids, labels=ids).loss.backward()
    shell.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    torch.manual_seed(1)
    other = tef.Stateful(tef.convert(tiny_gpt2()), recipe)
    other.load_pretrained(tmp_path)
    assert same_state(shell, other)
    llama = shell_of(recipe)
    with pytest.raises(tef.errors.MissingEntryError, match="load_pretrained: the workspaces do not fit"):
        llama.load_pretrained(tmp_path)
    llama.save_workspaces(tmp_path)     # workspaces that fit, beside another model's weights
    with pytest.raises(KeyError, match="does not hold this shell's model"):
        llama.load_pretrained(tmp_path)


def test_load_pretrained_of_a_folder_that_does_not_fit_leaves_the_shell_as_it_was(tmp_path):
    shell = shell_of(DelayedScaling(amax_history_len=4))
    before = {k: bits(v).clone() for k, v in shell.state_dict().items()}
    shell.model.save_pretrained(tmp_path / "plain")          # the model's own folder: no workspaces
    with pytest.raises(FileNotFoundError, match="holds no te_func_workspaces.safetensors"):
        shell.load_pretrained(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="holds no te_func_workspaces.safetensors"):
        shell.load_workspaces(tmp_path / "plain")
    shell_of(Float8CurrentScaling()).save_pretrained(tmp_path / "current")     # another recipe's
    with pytest.raises(tef.errors.RecipeMismatchError, match="load_pretrained: the workspaces do not fit"):
        shell.load_pretrained(tmp_path / "current")
    after = shell.state_dict()
    assert all(torch.equal(bits(after[k]), v) for k, v in before.items())


def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                              intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                                              num_experts_per_tok=2, decoder_sparse_step=1,
                                              max_position_embeddings=64))


@pytest.mark.parametrize("make", [pytest.param(tiny_llama, id="llama"), pytest.param(tiny_qwen3_moe, id="moe")])
@pytest.mark.parametrize("cls", [pytest.param(Trainer, id="transformers"),
                                 pytest.param("te_func", id="te_func")])
def test_resume_from_checkpoint_continues_the_run_bit_identically(cls, make, tmp_path):
    cls = tef.integrations.Trainer if cls == "te_func" else cls
    recipe, data = DelayedScaling(amax_history_len=4), dataset(16)
    torch.manual_seed(0)
    through = tef.Stateful(tef.convert(make()), recipe)
    trainer(through, tmp_path / "a", steps=4, cls=cls, data=data, save_strategy="steps", save_steps=2).train()
    checkpoint = tmp_path / "a" / "checkpoint-2"
    # te_func's Trainer writes each checkpoint as a from_pretrained folder; transformers' the shell's state_dict
    assert (checkpoint / "config.json").exists() == (cls is not Trainer)
    torch.manual_seed(1)            # other weights: the resume must load them
    resumed = tef.Stateful(tef.convert(make()), recipe)
    assert not same_state(through, resumed)
    trainer(resumed, tmp_path / "b", steps=4, cls=cls, data=data, save_strategy="steps",
            save_steps=2).train(resume_from_checkpoint=str(checkpoint))
    assert same_state(through, resumed)


def test_te_funcs_trainer_evaluates_the_models_loss(tmp_path):
    # transformers' Trainer reads label names from the model's class, and the shell's names none
    shell = shell_of(Float8CurrentScaling())
    plain = trainer(shell, tmp_path, eval_data=dataset(4))
    assert plain.label_names == [] and "eval_loss" not in plain.evaluate()
    ours = trainer(shell, tmp_path, cls=tef.integrations.Trainer, eval_data=dataset(4))
    assert ours.label_names == ["labels"] and torch.isfinite(torch.tensor(ours.evaluate()["eval_loss"]))


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_funcs_trainer_casts_the_weights_once_a_step_under_gradient_accumulation(recipe, tmp_path):
    runs = {}
    for cls in (Trainer, tef.integrations.Trainer):
        shell = shell_of(recipe)
        trainer(shell, tmp_path, steps=2, cls=cls, data=dataset(16), gradient_accumulation_steps=2).train()
        runs[cls] = shell
    plain, ours = runs[Trainer], runs[tef.integrations.Trainer]
    history = "model.layers.0.self_attn.q_proj.weight_amax_history"
    if isinstance(recipe, DelayedScaling):     # a step a history slot, as TE's: not one per microbatch
        assert (ours.workspaces[history] != 0).sum() == 2 and (plain.workspaces[history] != 0).sum() == 4
    else:                                       # the casts reused within a step are the ones made again
        assert same_state(plain, ours)


def test_load_best_model_at_end_takes_the_best_checkpoints_weights_and_workspaces_back(tmp_path):
    recipe = DelayedScaling(amax_history_len=4)
    shell = shell_of(recipe)
    ranks = iter([1.0, 0.0])        # the first evaluation (step 2) is the best: not the last state
    t = trainer(shell, tmp_path, steps=4, cls=tef.integrations.Trainer, data=dataset(16), eval_data=dataset(4),
                save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                metric_for_best_model="rank", greater_is_better=True)
    t.compute_metrics = lambda _: {"rank": next(ranks)}
    t.train()
    assert t.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    best, last = shell_of(recipe), shell_of(recipe)
    best.load_pretrained(tmp_path / "checkpoint-2")
    last.load_pretrained(tmp_path / "checkpoint-4")
    assert same_state(shell, best) and not same_state(shell, last)


def test_a_converted_model_without_a_shell_says_once_that_it_runs_in_high_precision(tmp_path, monkeypatch):
    monkeypatch.setattr(context, "_told_outside_frames", False)
    torch.manual_seed(0)
    model = tef.convert(tiny_llama())
    with pytest.warns(tef.errors.HighPrecisionWarning, match=r"high precision.*tef\.Stateful\(model, recipe\)"):
        trainer(model, tmp_path, steps=1).train()
    with pytest.warns() as later:
        import warnings
        warnings.warn("marker")
        model(input_ids=torch.randint(0, 128, (1, 4)))
    assert not any(issubclass(w.category, tef.errors.HighPrecisionWarning) for w in later)


def test_a_frozen_model_with_te_func_norms_runs_without_the_warning(monkeypatch):
    # A frozen model calls its norms outside any frame, and a norm computes the same under any recipe.
    monkeypatch.setattr(context, "_told_outside_frames", False)
    torch.manual_seed(0)
    frozen = tef.freeze(torch.nn.Sequential(tef.nn.LayerNorm(32), tef.nn.Linear(32, 32)), Float8CurrentScaling())
    with pytest.warns() as seen:
        import warnings
        warnings.warn("marker")
        with torch.no_grad():
            frozen(torch.randn(2, 32))
    assert not any(issubclass(w.category, tef.errors.HighPrecisionWarning) for w in seen)
    assert not context._told_outside_frames
