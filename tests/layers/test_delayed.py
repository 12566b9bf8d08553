"""DelayedScaling end to end: amax histories and scales of every role, in every driver.

The reference below is written from TransformerEngine's delayed-scaling
formulas (shared/DESIGN.md), in numpy float32, and from te_func's documented
step semantics (docs/delayed.md): a call with is_first_microbatch True or None
starts a step (each role's scale recomputed from its history, the history
rolled), later microbatches add their amaxes to slot 0 by max, a weight-cast
cache hit records nothing, and the gradient role records in backward. It never
calls te_func: the amaxes it is fed are read from the tensors the layers see
(forward hooks and output-gradient hooks on an eager run), and it predicts
every history and scale, which each driver must match bit for bit.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

import te_func as tef
from te_func.recipe import DelayedScaling, Float8CurrentScaling, Format

ROLES = ("input", "weight", "grad")
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
FLT_MAX = np.finfo(np.float32).max
LAYERS = ("0", "2")                                           # the te_func layers of `make_model`
SCHEDULE = (1, 3, 1, 2, 1, 1)                                 # microbatches per step
LR = 0.5


# =============================================================================
# Reference
# =============================================================================

def fp8_max(fmt: Format, role: str) -> float:
    """HYBRID: E4M3 forward, E5M2 for gradients."""
    e5m2 = fmt is Format.E5M2 or (fmt is Format.HYBRID and role == "grad")
    return E5M2_MAX if e5m2 else E4M3_MAX


class RefState:
    """One role's amax history and scale, as TE's amax_and_scale_update keeps them."""

    def __init__(self, recipe: DelayedScaling, role: str):
        self.recipe, self.fp8_max = recipe, np.float32(fp8_max(recipe.fp8_format, role))
        self.history = np.zeros(recipe.amax_history_len, np.float32)
        self.scale = np.float32(1.0)

    def start_step(self):
        """TE's fused update (delayed_scaling.cu, kernel_bulk): a step whose amax (slot 0)
        is 0 changes nothing; else amax = the fmax over the history (NaN skipped) or slot 0,
        scale = (fp8_max * 2**-margin) / amax where amax is finite and > 0, FLT_MAX where
        that overflows, and the history rolls by one with slot 0 zeroed."""
        r, last = self.recipe, self.history[0]
        if last == 0:
            return
        if r.amax_compute_algo == "max":
            amax = np.float32(np.max(np.where(np.isnan(self.history), np.float32(0), self.history)))
        else:
            amax = last
        if amax > 0 and np.isfinite(amax):
            with np.errstate(over="ignore"):
                scale = np.float32(self.fp8_max * np.float32(2.0 ** -r.margin)) / amax
            self.scale = scale if np.isfinite(scale) else FLT_MAX
        self.history = np.roll(self.history, -1)
        self.history[0] = 0.0

    def record(self, amax):
        # fmax: a NaN amax is no amax (TE's amax kernels skip NaN elements)
        self.history[0] = np.fmax(self.history[0], np.float32(amax))


def first_flag(n_micro: int, i: int):
    """is_first_microbatch of microbatch i of a step of n: None alone, else True then False."""
    return None if n_micro == 1 else i == 0


def simulate(recipe, schedule, keys, amax, entry):
    """Predicted state after each step: list of {entry name: np value}.

    keys: the (owner, role) pairs that have a state; amax(step, micro, owner, role): the
    amax that tensor had; entry(owner, role): the state's entry name before `_amax_history`.
    """
    states = {(o, r): RefState(recipe, r) for o, r in keys}
    snapshots = []
    for step, n in enumerate(schedule):
        for i in range(n):
            first = first_flag(n, i)
            for (owner, role), st in states.items():
                if first is not False:
                    st.start_step()
                if role == "weight" and first is False:
                    continue                           # the cached cast is reused: nothing measured
                st.record(amax(step, i, owner, role))
        snapshots.append({f"{entry(o, r)}_{k}": np.copy(getattr(st, attr)) for (o, r), st in states.items()
                          for k, attr in (("amax_history", "history"), ("scale", "scale"))})
    return snapshots


# =============================================================================
# The model and the drivers
# =============================================================================

def make_model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(tef.nn.Linear(32, 48), torch.nn.GELU(), tef.nn.Linear(48, 16))


def make_data(schedule):
    g = torch.Generator().manual_seed(99)
    return [[(torch.randn(8, 32, generator=g) * (1 + s), torch.randn(8, 16, generator=g)) for _ in range(n)]
            for s, n in enumerate(schedule)]


def state_of(ws) -> dict:
    return {k: v.detach().clone() for k, v in ws.items() if k.endswith(("_amax_history", "_scale"))
            and "_cast." not in k}


def run_stateful(recipe, schedule, compiled=False, observe=False):
    """Eager (or compiled) tef.Stateful, .backward() per microbatch, SGD per step.
    Returns (losses, state after each step, observed amaxes or None)."""
    model = make_model()
    shell = tef.Stateful(model, recipe)
    call = torch.compile(shell, fullgraph=True, backend="aot_eager") if compiled else shell
    opt = torch.optim.SGD(shell.parameters(), lr=LR)
    observed, current = [], {}
    if observe:
        for layer in LAYERS:
            model.get_submodule(layer).register_forward_hook(
                lambda mod, args, out, layer=layer: _observe(mod, args, out, layer, current))
    losses, snaps = [], []
    for step, mbs in enumerate(make_data(schedule)):
        observed.append([])
        for i, (x, y) in enumerate(mbs):
            current.clear()
            loss = torch.nn.functional.mse_loss(call(x, is_first_microbatch=first_flag(len(mbs), i)), y)
            loss.backward()
            observed[-1].append(dict(current))
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        snaps.append(state_of(shell.workspaces))
    return losses, snaps, observed if observe else None


def _observe(mod, args, out, layer, current):
    current[(layer, "input")] = args[0].detach().abs().max().item()
    current[(layer, "weight")] = mod.weight.detach().abs().max().item()
    out.register_hook(lambda g: current.__setitem__((layer, "grad"), g.abs().max().item()))


def run_functional(recipe, schedule, compiled=False):
    """tef.value_and_grad threading new_ws through the microbatches, SGD per step."""
    model = make_model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    ws = tef.init_workspaces(model, recipe)

    def loss_fn(p, ws, x, y, first):
        out, new_ws = tef.functional_call(model, p, ws, (x,), recipe=recipe, is_first_microbatch=first)
        return torch.nn.functional.mse_loss(out, y), new_ws

    step = tef.value_and_grad(loss_fn)
    if compiled:
        step = torch.compile(step, fullgraph=True, backend="aot_eager")
    losses, snaps = [], []
    for mbs in make_data(schedule):
        acc = {k: torch.zeros_like(v) for k, v in params.items()}
        for i, (x, y) in enumerate(mbs):
            loss, grads, ws = step(params, ws, x, y, first_flag(len(mbs), i))
            assert grads.keys() == params.keys()          # the states never show up as gradients
            acc = {k: acc[k] + grads[k] for k in acc}
            losses.append(loss)
        params = {k: p - LR * acc[k] for k, p in params.items()}
        snaps.append(state_of(ws))
    return losses, snaps


def assert_state_matches(got: dict, want: dict, where: str):
    assert got.keys() == want.keys(), where
    for k, v in want.items():
        assert torch.equal(got[k], torch.from_numpy(np.asarray(v, np.float32))), (where, k, got[k], v)


def check_against_reference(recipe, snaps, schedule=SCHEDULE):
    _, _, observed = run_stateful(recipe, schedule, observe=True)
    want = simulate(recipe, schedule, [(l, r) for l in LAYERS for r in ROLES],
                    lambda s, i, l, r: observed[s][i][(l, r)], lambda l, r: f"{l}.{r}")
    for step, (got, w) in enumerate(zip(snaps, want)):
        assert_state_matches(got, w, f"after step {step}")
    return want


# =============================================================================
# Every driver follows the reference
# =============================================================================

DRIVERS = {
    "stateful": lambda r: run_stateful(r, SCHEDULE)[:2],
    "functional": lambda r: run_functional(r, SCHEDULE),
    "stateful-compiled": lambda r: run_stateful(r, SCHEDULE, compiled=True)[:2],
    "functional-compiled": lambda r: run_functional(r, SCHEDULE, compiled=True),
}


@pytest.mark.parametrize("driver", DRIVERS)
def test_every_driver_follows_the_reference_bit_for_bit(driver):
    """Two Linear layers, 6 steps of 1-3 microbatches: all 12 histories and scales after
    every step equal the reference's, and the grad histories are not zero."""
    torch._dynamo.reset()
    recipe = DelayedScaling(amax_history_len=4)         # short, so that the roll wraps around
    losses, snaps = DRIVERS[driver](recipe)
    want = check_against_reference(recipe, snaps)
    for layer in LAYERS:
        grad_history = snaps[-1][f"{layer}.grad_amax_history"]
        assert (grad_history > 0).all() and snaps[-1][f"{layer}.grad_scale"] != 1
    assert want[-1]["0.input_amax_history"][0] > 0
    ref_losses, _, _ = run_stateful(recipe, SCHEDULE)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))


RECIPE_VARIANTS = {
    "margin-2-most-recent": DelayedScaling(margin=2, amax_history_len=4, amax_compute_algo="most_recent"),
    "history-1": DelayedScaling(amax_history_len=1),
    "history-1024-default": DelayedScaling(),
    "e4m3-margin-1": DelayedScaling(margin=1, fp8_format=Format.E4M3, amax_history_len=3),
}


@pytest.mark.parametrize("name", RECIPE_VARIANTS)
@pytest.mark.parametrize("driver", ["stateful", "functional"])
def test_recipe_options_follow_the_reference(name, driver):
    recipe = RECIPE_VARIANTS[name]
    _, snaps = DRIVERS[driver](recipe)
    check_against_reference(recipe, snaps)


# =============================================================================
# The update rule at its edges
# =============================================================================

UPDATE_CASES = {           # history (slot 0 first), previous scale
    "max-of-window": ([0.5, 2.0, 0.0, 3.0], 7.0),
    "all-zero-keeps-scale": ([0.0, 0.0, 0.0, 0.0], 7.0),
    "inf-keeps-scale": ([1.0, float("inf"), 0.0, 2.0], 7.0),
    "nan-keeps-scale": ([1.0, 2.0, float("nan"), 2.0], 7.0),
    "tiny-amax-gives-fp32-max": ([1e-45, 0.0, 0.0, 0.0], 7.0),
    "length-1": ([3.0], 7.0),
    "length-1-zero": ([0.0], 7.0),
}


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("case", UPDATE_CASES)
def test_delayed_update_follows_the_reference(case, role, margin, algo):
    from te_func.quant import DelayedState, delayed_update
    history, scale = UPDATE_CASES[case]
    recipe = DelayedScaling(margin=margin, amax_history_len=len(history), amax_compute_algo=algo)
    ref = RefState(recipe, role)
    ref.history, ref.scale = np.array(history, np.float32), np.float32(scale)
    ref.start_step()
    state = DelayedState(torch.tensor(history), torch.tensor(scale))
    new = delayed_update(state, recipe, role)
    assert torch.equal(new.scale, torch.from_numpy(np.asarray(ref.scale)))
    torch.testing.assert_close(new.amax_history, torch.from_numpy(ref.history), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(state.amax_history.nan_to_num(), torch.tensor(history).nan_to_num())   # not mutated


def _forward_steps(recipe, inputs):
    """One forward-only step per input through one Linear; the input role's state after each."""
    model = make_model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    ws, out = tef.init_workspaces(model, recipe), []
    for x in inputs:
        _, ws = tef.functional_call(model, params, ws, (x,), recipe=recipe)
        out.append((ws["0.input_amax_history"].clone(), ws["0.input_scale"].clone()))
    return out


def _with(x, value):
    odd = x.clone()
    odd[3, 5] = value
    return odd


def test_a_step_that_saw_amax_zero_is_skipped_as_te_skips_it():
    """An all-zero input (an MoE expert that got no tokens): its step records amax 0, and the
    next step start changes nothing, neither the scale nor the history's order."""
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 32)
    states = _forward_steps(recipe, [x, 2 * x, torch.zeros(8, 32), x])
    ax = x.abs().max()
    assert torch.equal(states[1][0], torch.stack([2 * ax, 0 * ax, 0 * ax, ax]))
    assert torch.equal(states[2][0], torch.stack([0 * ax, 0 * ax, ax, 2 * ax]))      # rolled, then 0 recorded
    assert torch.equal(states[3][1], states[2][1])                                   # no new scale...
    assert torch.equal(states[3][0], torch.stack([ax, 0 * ax, ax, 2 * ax]))          # ...and no roll


def test_an_inf_amax_keeps_the_old_scale():
    recipe = DelayedScaling(amax_history_len=1)
    x = torch.randn(8, 32)
    states = _forward_steps(recipe, [x, x, _with(x, float("inf")), x, x])
    scale_from_x = torch.tensor(E4M3_MAX) / x.abs().max()
    assert states[1][1] == scale_from_x and states[2][0][0] == float("inf")
    assert states[3][1] == scale_from_x                   # amax inf: the scale stays
    assert states[4][1] == scale_from_x and states[4][0][0] == x.abs().max()


def test_a_nan_element_is_skipped_by_the_amax():
    """TE takes amaxes with fmax: a NaN element does not make the amax NaN (which would freeze
    the scale for a whole history window); the element itself still casts to NaN."""
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 32)
    odd = _with(x, float("nan"))
    states = _forward_steps(recipe, [x, odd, x])
    finite_amax = odd.nan_to_num(0.0).abs().max()
    assert states[1][0][0] == finite_amax
    assert states[2][1] == torch.tensor(E4M3_MAX) / torch.maximum(finite_amax, x.abs().max())
    q, _ = tef.quant.quantize(odd, Float8CurrentScaling(), "input")
    assert torch.isnan(tef.quant.dequantize(q)).sum() == 1                          # just that element


def test_under_no_grad_amaxes_are_recorded_and_nothing_updates():
    """As TE, which updates its scales at autocast exit only while grad is enabled: an
    evaluation pass records its amaxes into the current slot and rolls nothing."""
    recipe = DelayedScaling(amax_history_len=4)
    model = make_model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(8, 32)
    _, ws = tef.functional_call(model, params, tef.init_workspaces(model, recipe), (x,), recipe=recipe)
    _, ws = tef.functional_call(model, params, ws, (x,), recipe=recipe)          # a step: scales move
    with torch.no_grad():
        _, evaluated = tef.functional_call(model, params, ws, (3 * x,), recipe=recipe, is_first_microbatch=True)
    for layer in LAYERS:
        for role in ("input", "weight"):
            h, h_eval = ws[f"{layer}.{role}_amax_history"], evaluated[f"{layer}.{role}_amax_history"]
            assert torch.equal(evaluated[f"{layer}.{role}_scale"], ws[f"{layer}.{role}_scale"])
            assert torch.equal(h_eval[1:], h[1:]) and h_eval[0] >= h[0]
    assert evaluated["0.input_amax_history"][0] == (3 * x).abs().max()


def test_weight_cache_hit_records_nothing_and_a_microbatch_does_not_roll():
    recipe = DelayedScaling(amax_history_len=4)
    model = make_model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x1, x2 = torch.randn(8, 32), torch.randn(8, 32) * 3
    _, ws = tef.functional_call(model, params, tef.init_workspaces(model, recipe), (x1,), recipe=recipe)
    _, ws1 = tef.functional_call(model, params, ws, (x1,), recipe=recipe, is_first_microbatch=True)
    bigger = {k: v * 10 for k, v in params.items()}          # not re-cast on a cache hit
    _, ws2 = tef.functional_call(model, bigger, ws1, (x2,), recipe=recipe, is_first_microbatch=False)
    for layer in LAYERS:
        for role in ROLES:
            assert torch.equal(ws2[f"{layer}.{role}_scale"], ws1[f"{layer}.{role}_scale"])
        assert torch.equal(ws2[f"{layer}.weight_amax_history"], ws1[f"{layer}.weight_amax_history"])
        assert torch.equal(ws2[f"{layer}.weight_cast.data"].view(torch.uint8),
                           ws1[f"{layer}.weight_cast.data"].view(torch.uint8))
        assert torch.equal(ws2[f"{layer}.input_amax_history"][1:], ws1[f"{layer}.input_amax_history"][1:])
    h1, h2 = ws1["0.input_amax_history"][0], ws2["0.input_amax_history"][0]
    assert h2 == torch.maximum(h1, x2.abs().max()) and h2 > h1


# =============================================================================
# Microbatches combine by max in any order; grads hold only parameters
# =============================================================================

def test_stateful_forward_forward_backward_equals_one_backward_per_microbatch():
    """Two microbatches forwarded before one backward of their sum leave the state that
    a backward per microbatch leaves: the backward amaxes combine by max, never by sum."""
    recipe = DelayedScaling(amax_history_len=4)
    data = make_data((2,))[0]
    shells = [tef.Stateful(make_model(), recipe) for _ in range(2)]
    for i, (x, y) in enumerate(data):
        torch.nn.functional.mse_loss(shells[0](x, is_first_microbatch=i == 0), y).backward()
    losses = [torch.nn.functional.mse_loss(shells[1](x, is_first_microbatch=i == 0), y)
              for i, (x, y) in enumerate(data)]
    (losses[0] + losses[1]).backward()
    for k, v in shells[0].workspaces.items():
        assert torch.equal(v.view(torch.uint8) if v.element_size() == 1 else v,
                           shells[1].workspaces[k].view(torch.uint8) if v.element_size() == 1
                           else shells[1].workspaces[k]), k
    assert (shells[0].workspaces["2.grad_amax_history"][0] > 0)


def test_stateful_parameters_are_only_the_models():
    shell = tef.Stateful(make_model(), DelayedScaling(amax_history_len=4))
    assert [id(p) for p in shell.parameters()] == [id(p) for p in shell.model.parameters()]
    assert not any(k.startswith("_grad_sinks") for k in shell.state_dict())
    shell(torch.randn(8, 32)).sum().backward()
    assert all(not v.requires_grad for v in shell.workspaces.values())


def test_grad_refuses_argnums_over_the_workspaces():
    model = make_model()
    recipe = DelayedScaling(amax_history_len=4)

    def loss_fn(p, ws, x):
        out, new_ws = tef.functional_call(model, p, ws, (x,), recipe=recipe)
        return out.sum(), new_ws

    params = {k: v.detach() for k, v in model.named_parameters()}
    with pytest.raises(ValueError, match="argnums must not include 1"):
        tef.grad(loss_fn, argnums=(0, 1))(params, tef.init_workspaces(model, recipe), torch.randn(8, 32))


# =============================================================================
# vmap
# =============================================================================

@pytest.mark.parametrize("scope", ["sample", "batch"])
def test_vmap_per_sample_states_fold_into_the_batch_state(scope):
    """Per-sample gradients over a shared state give each sample its own new state (vmap runs
    each sample alone); folded (tef.fold_workspaces: the histories by max over the samples, the
    shared scales and casts once) they are, bit for bit, the state of one call on the whole
    batch, which tef.per_sample_grad returns in either scope (they coincide under DelayedScaling,
    whose scales come from the shared history)."""
    recipe = DelayedScaling(amax_history_len=4)
    model = make_model()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p, ws, x, y):
        out, new_ws = tef.functional_call(model, p, ws, (x,), recipe=recipe)
        return ((out - y) ** 2).sum(), new_ws

    x, y = torch.randn(4, 8, 32), torch.randn(4, 8, 16)
    _, ws = tef.grad(loss_fn)(params, tef.init_workspaces(model, recipe), x[0], y[0])
    grads, per_sample = torch.func.vmap(tef.grad(loss_fn), in_dims=(None, None, 0, 0))(params, ws, x, y)
    _, batch = tef.grad(loss_fn)(params, ws, x.reshape(32, 32), y.reshape(32, 16))
    folded = tef.fold_workspaces(model, per_sample, recipe)
    assert_state_matches(state_of(folded), {k: v.numpy() for k, v in state_of(batch).items()}, "folded")
    assert not torch.equal(per_sample["0.input_amax_history"][0], per_sample["0.input_amax_history"][1])
    helper_grads, helper_ws = tef.per_sample_grad(loss_fn, (0, 0), scope=scope)(params, ws, x, y)
    _assert_tree_equal(helper_ws, folded)
    _assert_tree_equal(helper_grads, grads)


# =============================================================================
# Checkpoints
# =============================================================================

def _momentum_sgd(params, grads, momentum, lr=0.1, beta=0.9):
    momentum = {k: beta * momentum[k] + grads[k] for k in params}
    return {k: p - lr * momentum[k] for k, p in params.items()}, momentum


def _functional_run(recipe, steps, start=None):
    model = make_model()

    def loss_fn(p, ws, x, y, first):
        out, new_ws = tef.functional_call(model, p, ws, (x,), recipe=recipe, is_first_microbatch=first)
        return torch.nn.functional.mse_loss(out, y), new_ws

    if start is None:
        params = {k: v.detach() for k, v in model.named_parameters()}
        ws, mom = tef.init_workspaces(model, recipe), {k: torch.zeros_like(v) for k, v in params.items()}
    else:
        params, ws, mom = start
    data = make_data((2,) * 6)
    losses = []
    for mbs in data[steps.start:steps.stop]:
        acc = {k: torch.zeros_like(v) for k, v in params.items()}
        for i, (x, y) in enumerate(mbs):
            loss, g, ws = tef.value_and_grad(loss_fn)(params, ws, x, y, i == 0)
            acc, losses = {k: acc[k] + g[k] for k in acc}, losses + [loss]
        params, mom = _momentum_sgd(params, acc, mom)
    return losses, (params, ws, mom)


def _assert_tree_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                           y.view(torch.uint8) if y.element_size() == 1 else y), k


def test_functional_checkpoint_resumes_bit_identically(tmp_path):
    recipe = DelayedScaling(amax_history_len=4)
    full_losses, (p_full, ws_full, m_full) = _functional_run(recipe, range(0, 6))
    first, state = _functional_run(recipe, range(0, 3))
    torch.save(state, tmp_path / "ckpt.pt")
    second, (p, ws, m) = _functional_run(recipe, range(3, 6), start=torch.load(tmp_path / "ckpt.pt"))
    assert all(torch.equal(a, b) for a, b in zip(first + second, full_losses))
    for got, want in ((p, p_full), (ws, ws_full), (m, m_full)):
        _assert_tree_equal(got, want)


def _stateful_run(shell, opt, steps):
    losses = []
    for mbs in make_data((2,) * 6)[steps.start:steps.stop]:
        for i, (x, y) in enumerate(mbs):
            loss = torch.nn.functional.mse_loss(shell(x, is_first_microbatch=i == 0), y)
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return losses


def test_stateful_checkpoint_resumes_bit_identically(tmp_path):
    recipe = DelayedScaling(amax_history_len=4)
    full = tef.Stateful(make_model(), recipe)
    full_opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    full_losses = _stateful_run(full, full_opt, range(0, 6))

    shell = tef.Stateful(make_model(), recipe)
    opt = torch.optim.AdamW(shell.parameters(), lr=1e-2)
    first = _stateful_run(shell, opt, range(0, 3))
    sd = shell.state_dict()
    assert {k[len("workspaces."):] for k in sd if k.startswith("workspaces.")} == set(shell.workspaces)
    torch.save({"shell": sd, "opt": opt.state_dict()}, tmp_path / "ckpt.pt")

    torch.manual_seed(7)
    resumed = tef.Stateful(torch.nn.Sequential(tef.nn.Linear(32, 48), torch.nn.GELU(),
                                               tef.nn.Linear(48, 16)), recipe)   # other weights
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(ckpt["shell"])
    resumed_opt.load_state_dict(ckpt["opt"])
    second = _stateful_run(resumed, resumed_opt, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(first + second, full_losses))
    _assert_tree_equal(resumed.workspaces, full.workspaces)
    _assert_tree_equal(dict(resumed.named_parameters()), dict(full.named_parameters()))


def test_a_checkpoint_that_does_not_fit_gives_a_clear_error():
    model = make_model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(8, 32)
    short = tef.init_workspaces(model, DelayedScaling(amax_history_len=4))
    shell = tef.Stateful(model, DelayedScaling(amax_history_len=8))
    sd = {**shell.state_dict(), **{f"workspaces.{k}": v for k, v in short.items()}}
    says = r"another recipe: DelayedScaling with amax_history_len=4 \(made for\) vs 8 \(given\)"
    with pytest.raises(tef.errors.RecipeMismatchError, match=r"does not fit this shell \(recipe=DelayedScaling\("
                                                             r"amax_history_len=8\)\): these workspaces .*" + says):
        shell.load_state_dict(sd)
    with pytest.raises(tef.errors.RecipeMismatchError, match=says):
        tef.functional_call(model, params, short, (x,), recipe=DelayedScaling(amax_history_len=8))
    with pytest.raises(tef.errors.RecipeMismatchError, match=r"made for Float8CurrentScaling\(\), run with "
                                                             r"DelayedScaling\(amax_history_len=4\)"):
        tef.functional_call(model, params, tef.init_workspaces(model, Float8CurrentScaling()), (x,),
                            recipe=DelayedScaling(amax_history_len=4))
    missing = {k: v for k, v in short.items() if k != "2.grad_scale"}
    with pytest.raises(tef.errors.MissingEntryError, match=r"'2\.grad_scale' is missing"):
        tef.functional_call(model, params, missing, (x,), recipe=DelayedScaling(amax_history_len=4))
    other = torch.nn.Sequential(tef.nn.Linear(32, 48), torch.nn.GELU(), tef.nn.Linear(48, 24))
    with pytest.raises(tef.errors.EntryMismatchError, match=r"2\.weight_cast\.data"):
        tef.functional_call(other, {k: v.detach() for k, v in other.named_parameters()}, short, (x,),
                            recipe=DelayedScaling(amax_history_len=4))
