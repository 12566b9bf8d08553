"""A layer called twice in one forward (weight tying) runs its second call as a
later microbatch of the same step: one weight cast, one delayed-scaling step."""
import torch
from torch import nn

import te_func as tef
import te_func.quant.weight as qweight
from te_func.recipe import DelayedScaling, Float8CurrentScaling


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = tef.nn.Linear(16, 16)

    def forward(self, x):
        return self.block(torch.relu(self.block(x)))


def _run(model, recipe, ws, x, first):
    params = dict(model.named_parameters())
    return tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=first)


def test_shared_layer_casts_its_weight_once_per_call(monkeypatch):
    calls = []
    original = qweight.quantize_with_transpose
    monkeypatch.setattr(qweight, "quantize_with_transpose", lambda *a, **k: calls.append(1) or original(*a, **k))
    model, recipe = Tied(), Float8CurrentScaling()
    ws = tef.init_workspaces(model, recipe)
    calls.clear()
    _run(model, recipe, ws, torch.randn(4, 16), True)
    assert len(calls) == 1


def test_shared_layer_under_delayed_scaling_starts_one_step_and_records_both_amaxes():
    model, recipe = Tied(), DelayedScaling(amax_history_len=4)
    with torch.no_grad():
        model.block.weight.normal_(0.0, 1.0)     # the second call's input outgrows the first's
    ws = tef.init_workspaces(model, recipe)
    x = torch.randn(4, 16)
    out, new_ws = _run(model, recipe, ws, x, True)
    hidden = torch.relu(model.block(x))          # outside a frame: high precision
    history = new_ws["block.input_amax_history"]
    # One roll (slot 0 is this step's), and slot 0 holds the larger of the two inputs' amaxes.
    assert torch.count_nonzero(history) == 1
    expected = torch.maximum(x.abs().amax(), hidden.abs().amax())
    assert torch.allclose(history[0], expected, rtol=0.1)   # hidden went through an FP8 GEMM
    assert hidden.abs().amax() > 2 * x.abs().amax()   # so slot 0 shows the second call
    assert torch.isfinite(out).all()
