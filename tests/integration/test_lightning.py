"""Lightning on a te_func model, as its docs drive a plain one: a LightningModule holding a
tef.Stateful trains in FP8 under Trainer.fit (validation under inference_mode included), and a
run resumed from a ModelCheckpoint continues bit-identically, FP8 state included."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import te_func as tef
from cases import bits
from te_func.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = [pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(DelayedScaling(amax_history_len=4), id="delayed")]


class Regressor(L.LightningModule):
    def __init__(self, recipe, accumulate=1):
        super().__init__()
        model = torch.nn.Sequential(tef.nn.LayerNormLinear(32, 64), torch.nn.GELU(), tef.nn.Linear(64, 16))
        self.shell = tef.Stateful(model, recipe)
        self.accumulate = accumulate

    def training_step(self, batch, batch_idx):
        x, y = batch
        # A step's first microbatch casts the weights; the others reuse the casts.
        out = self.shell(x, is_first_microbatch=batch_idx % self.accumulate == 0)
        loss = torch.nn.functional.mse_loss(out, y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.shell(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(n=16):            # two batches an epoch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x[:, :16])), batch_size=8)


def fit(module, root, steps, resume=None, **kwargs):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(root), **kwargs)
    trainer.fit(module, data(), data(), ckpt_path=resume)
    return trainer


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(bits(v), bits(sb[k])) for k, v in sa.items())


@pytest.mark.parametrize("recipe", RECIPES)
def test_fit_trains_the_shell_in_fp8_with_validation_under_inference_mode(recipe, tmp_path):
    torch.manual_seed(0)
    module = Regressor(recipe)
    before = {k: v.clone() for k, v in module.shell.workspaces.items()}
    trainer = fit(module, tmp_path, steps=6, enable_checkpointing=False)
    assert trainer.global_step == 6 and torch.isfinite(trainer.callback_metrics["val_loss"])
    key = "0.weight_cast.data"
    assert not torch.equal(bits(module.shell.workspaces[key]), bits(before[key]))
    if isinstance(recipe, DelayedScaling):       # backward amaxes recorded after validation ran
        assert module.shell.workspaces["2.grad_amax_history"].abs().sum() > 0
    assert not any(v.is_inference() for v in module.shell.workspaces.values())


def test_gradient_accumulation_reuses_the_weight_casts_within_a_step(tmp_path):
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    module = Regressor(recipe, accumulate=2)
    fit(module, tmp_path, steps=2, accumulate_grad_batches=2, enable_checkpointing=False, limit_val_batches=0)
    # two optimizer steps of two microbatches each: the weight history rolled once per step
    history = module.shell.workspaces["0.weight_amax_history"]
    assert (history != 0).sum() == 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_run_resumed_from_a_checkpoint_continues_bit_identically(recipe, tmp_path):
    torch.manual_seed(0)
    through = Regressor(recipe)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)  # each epoch
    fit(through, tmp_path / "a", steps=4, callbacks=[checkpoints])
    torch.manual_seed(1)        # other weights: the resume must load them
    resumed = Regressor(recipe)
    assert not same_state(through, resumed)
    fit(resumed, tmp_path / "b", steps=4, resume=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"),
        enable_checkpointing=False)
    assert same_state(through, resumed)
