"""Derivatives beyond the first-order backward, through FP8 layers: PyTorch's torch.func
tutorials on a converted model under every recipe, each against recipe=None, and the
definition itself against a float64 reference on the dequantized operands.

te_func defines them as the linearization's: each GEMM is linear in its operands' casts, and a
cast passes tangents and cotangents straight through (docs/functional.md). First-order results
are the FP8 backward's, bit for bit as before.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, stack_module_state, vjp, vmap

import te_func as tef
from cases import RECIPES, detached_params, is_fp4, sqnr
from te_func.quant import Quantized, dequantize
from te_func.recipe import DelayedScaling, Float8CurrentScaling

FP8 = [pytest.param(recipe, id=rid) for rid, recipe in RECIPES if recipe is not None]
FEATURES = 16


def min_sqnr(recipe) -> float:
    """How close (dB) a derivative through FP8 layers comes to high precision's here: a second
    derivative carries the noise of both the forward's casts and the first-order backward's."""
    return 3.0 if is_fp4(recipe) else 12.0


def converted_mlp(seed: int = 0) -> torch.nn.Module:
    """A plain torch model converted, as a tutorial's model would be."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.LayerNorm(FEATURES), torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, FEATURES))
    return tef.convert(model)


def functional(model, recipe):
    """f(params, x) -> model output, through tef.functional_call with fresh workspaces."""
    ws = tef.init_workspaces(model, recipe)

    def f(params, x):
        out, _ = tef.functional_call(model, params, ws, (x,), recipe=recipe)
        return out
    return f


def assert_close(got: torch.Tensor, want: torch.Tensor, recipe, what: str):
    assert torch.isfinite(got).all(), what
    assert got.norm() > 0.1 * want.norm(), f"{what}: {got.norm():.3g} against {want.norm():.3g}"
    assert sqnr(want, got) >= min_sqnr(recipe), f"{what}: {sqnr(want, got):.1f} dB"


# --- the definition, against float64 ----------------------------------------------------------

@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_the_hessian_of_a_linear_layer_is_built_from_its_dequantized_weight(recipe):
    """f(x) = sum(Linear(x)**2) has Hessian 2 Wq.T Wq per token, Wq the weight's FP8 cast:
    forward-over-reverse (hessian) gives it to fp32 rounding. Reverse-over-reverse runs the
    outer derivative through the first-order FP8 backward, which quantizes its gradient (E5M2
    under HYBRID) as every first-order backward does: the same matrix to that rounding."""
    torch.manual_seed(1)
    model = tef.nn.Linear(FEATURES, FEATURES, bias=False)
    params, ws = detached_params(model), tef.init_workspaces(model, recipe)
    x = torch.randn(2, FEATURES)
    _, ws = tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=True)
    wq = dequantize(Quantized(ws["weight_cast.data"], ws["weight_cast.scale_inv"], None, None, None),
                    torch.float64)
    want = torch.zeros(2, FEATURES, 2, FEATURES, dtype=torch.float64)
    for t in range(2):
        want[t, :, t, :] = 2 * wq.t() @ wq

    def f(x):
        out, _ = tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=False)
        return out.square().sum()
    torch.testing.assert_close(hessian(f)(x).double(), want, rtol=1e-6, atol=1e-7)
    reverse = jacrev(jacrev(f))(x).double()
    assert sqnr(want, reverse) > 20 and not torch.equal(reverse, torch.zeros_like(reverse))


@pytest.mark.parametrize("recipe", FP8)
def test_forward_mode_is_the_linearization_on_the_forward_casts(recipe):
    """jvp of a converted model through every te_func layer equals the float64 linearization:
    each GEMM on its operands' casts, a tangent passing each cast straight through."""
    model = converted_mlp()
    f = functional(model, recipe)
    params = detached_params(model)
    x, dx = torch.randn(4, FEATURES), torch.randn(4, FEATURES)
    dparams = {k: torch.randn_like(v) for k, v in params.items()}
    out, tangent = jvp(f, (params, x), (dparams, dx))
    # The same directional derivative from the first-order FP8 backward (reverse mode), one
    # output direction at a time: the two modes agree to FP8 noise, not bit for bit.
    v = torch.randn_like(out)
    _, pullback = vjp(f, params, x)
    gp, gx = pullback(v)
    reverse = (gx * dx).sum() + sum((gp[k] * dparams[k]).sum() for k in params)
    forward = (tangent * v).sum()
    assert torch.isfinite(tangent).all() and tangent.norm() > 0
    if not is_fp4(recipe):      # E2M1 gradients are too coarse for one direction to say much
        # A first DelayedScaling step quantizes with the initial scales of 1: coarser.
        tol = 0.25 if isinstance(recipe, DelayedScaling) else 0.1
        assert abs(forward - reverse) <= tol * abs(reverse)
    hp_out, hp_tangent = jvp(functional(model, None), (params, x), (dparams, dx))
    assert_close(tangent, hp_tangent, recipe, "jvp")


# --- the tutorials, on a converted model ----------------------------------------------------

@pytest.mark.parametrize("recipe", FP8)
def test_jacobians_hessians_and_hvps_tutorial(recipe):
    """jacrev, jacfwd, hessian, jacrev(jacrev), jacfwd(jacfwd), and Hessian-vector products reverse-over-reverse (vjp of grad)
    and forward-over-reverse (jvp of grad): finite, not zero, and within FP8 noise of
    high precision and of each other."""
    model = converted_mlp()
    params = detached_params(model)
    x = torch.randn(2, FEATURES)
    v = torch.randn(2, FEATURES)
    results = {}
    for r in (None, recipe):
        f = functional(model, r)
        loss = lambda x: f(params, x).tanh().square().sum()                   # noqa: E731
        results[r] = {"jacrev": jacrev(lambda x: f(params, x))(x), "jacfwd": jacfwd(lambda x: f(params, x))(x),
                      "hessian": hessian(loss)(x), "jacrev(jacrev)": jacrev(jacrev(loss))(x),
                      "jacfwd(jacfwd)": jacfwd(jacfwd(loss))(x),
                      "vjp(grad)": vjp(grad(loss), x)[1](v)[0], "jvp(grad)": jvp(grad(loss), (x,), (v,))[1]}
    fp8, hp = results[recipe], results[None]
    for name in fp8:
        assert_close(fp8[name], hp[name], recipe, name)
    assert_close(fp8["jacfwd"], fp8["jacrev"], recipe, "jacfwd against jacrev")
    assert_close(fp8["vjp(grad)"], fp8["jvp(grad)"], recipe, "the two HVPs")
    assert_close(fp8["hessian"], fp8["jacrev(jacrev)"], recipe, "hessian against jacrev(jacrev)")
    # Forward over forward: the same linearization, differentiated the other way round.
    assert_close(fp8["hessian"], fp8["jacfwd(jacfwd)"], recipe, "hessian against jacfwd(jacfwd)")
    hvp = torch.einsum("abcd,cd->ab", fp8["hessian"], v)
    assert_close(fp8["jvp(grad)"], hvp, recipe, "HVP against the Hessian")


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["none", "current", "delayed"])
def test_forward_over_forward_through_several_layers_is_the_hessian(recipe):
    """jacfwd(jacfwd) and jvp of jvp through two FP8 Linears with tanh between them and a
    LayerNorm before: the Hessian of the same linearization, not torch's forward-over-forward of a
    Function's jvp rule or of F.layer_norm (20-45% off in torch 2.13, with no error)."""
    model = converted_mlp()
    params = detached_params(model)
    x, v1, v2 = torch.randn(3, 2, FEATURES).unbind()
    hp = functional(model, None)
    h = jacrev(jacrev(lambda x: hp(params, x).tanh().square().sum()))(x)       # reverse over reverse: right
    assert h.abs().max() > 0
    f = functional(model, recipe)
    loss = lambda x: f(params, x).tanh().square().sum()                       # noqa: E731
    inner = lambda y: jvp(loss, (y,), (v1,))[1]                                # noqa: E731
    results = {"jacfwd(jacfwd)": (jacfwd(jacfwd(loss))(x), h),
               "jvp(jvp)": (jvp(inner, (x,), (v2,))[1], torch.einsum("abcd,ab,cd->", h, v1, v2))}
    for name, (got, want) in results.items():
        if recipe is None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
        else:
            assert_close(got, want, recipe, name)


def test_jacfwd_of_jacfwd_through_a_wide_linear_matches_the_hessian():
    """A Linear(512 -> 32) with tanh after it, as a user's first try: computed, not a pytree error."""
    torch.manual_seed(0)
    model = tef.convert(torch.nn.Sequential(torch.nn.Linear(512, 32), torch.nn.Tanh()))
    f = functional(model, Float8CurrentScaling())
    params = detached_params(model)
    loss = lambda x: f(params, x).sum()                                         # noqa: E731
    x = torch.randn(512)
    h = hessian(loss)(x)
    assert h.abs().max() > 0
    torch.testing.assert_close(jacfwd(jacfwd(loss))(x), h, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("recipe", FP8)
def test_neural_tangent_kernel_tutorial_both_methods(recipe):
    """The NTK of two batches by Jacobian contraction (jacrev) and by NTK-vector products
    (vjp then jvp): the two agree, and match high precision."""
    model = converted_mlp()
    params = detached_params(model)
    x1, x2 = torch.randn(3, FEATURES), torch.randn(2, FEATURES)

    def ntks(r):
        f = functional(model, r)

        def contraction():
            j1, j2 = jacrev(f)(params, x1), jacrev(f)(params, x2)
            return sum(torch.einsum("Naf,Mbf->NMab", j1[k].flatten(2), j2[k].flatten(2)) for k in params)

        def products():
            def get_ntk(x1, x2):
                out2, vjp_fn = vjp(lambda p: f(p, x2), params)

                def ntk_column(v):                      # (vjp then jvp): one column of the kernel
                    return jvp(lambda p: f(p, x1), (params,), vjp_fn(v))[1]
                basis = torch.eye(out2.numel()).view(out2.numel(), *out2.shape)
                return vmap(ntk_column)(basis)           # (M*O, N, O)
            result = get_ntk(x1, x2)
            return result.view(x2.shape[0], FEATURES, x1.shape[0], FEATURES).permute(2, 0, 3, 1)
        return contraction(), products()
    hp_c, hp_p = ntks(None)
    torch.testing.assert_close(hp_p, hp_c, rtol=1e-4, atol=1e-5)
    c, p = ntks(recipe)
    assert_close(c, hp_c, recipe, "NTK by Jacobian contraction")
    assert_close(p, hp_p, recipe, "NTK by products")
    assert_close(p, c, recipe, "the two methods")


def _maml_tasks(n_tasks=3, shots=8, seed=2):
    """Regression tasks with FEATURES inputs: y = sin(x @ a + b) per task, a support and a query set."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n_tasks, FEATURES, FEATURES, generator=g) / 4, torch.randn(n_tasks, 1, FEATURES, generator=g)
    xs = torch.randn(n_tasks, 2 * shots, FEATURES, generator=g)
    ys = torch.sin(xs @ a + b)
    return xs[:, :shots], ys[:, :shots], xs[:, shots:], ys[:, shots:]


def _maml_meta_grads(model, recipe, first_order=False):
    """functorch's MAML example: vmap over tasks, an inner torch.func.grad step, outer
    loss.backward(). Returns the meta-gradients."""
    f = functional(model, recipe)
    params = {k: v.detach().requires_grad_() for k, v in detached_params(model).items()}
    x_spt, y_spt, x_qry, y_qry = _maml_tasks()

    def task_loss(x_spt, y_spt, x_qry, y_qry):
        inner = grad(lambda p: (f(p, x_spt) - y_spt).square().mean())(params)
        if first_order:
            inner = {k: g.detach() for k, g in inner.items()}
        adapted = {k: params[k] - 0.5 * inner[k] for k in params}
        return (f(adapted, x_qry) - y_qry).square().mean()
    vmap(task_loss)(x_spt, y_spt, x_qry, y_qry).mean().backward()
    return torch.cat([params[k].grad.flatten() for k in sorted(params)])


@pytest.mark.parametrize("recipe", FP8)
def test_maml_tutorial_keeps_the_second_order_term(recipe):
    """MAML as functorch's example writes it: the meta-gradient matches high precision's, and
    its second-order part (what first-order MAML drops) matches high precision's, not zero."""
    model = converted_mlp()
    hp, hp_first = _maml_meta_grads(model, None), _maml_meta_grads(model, None, first_order=True)
    got, got_first = _maml_meta_grads(model, recipe), _maml_meta_grads(model, recipe, first_order=True)
    assert_close(got, hp, recipe, "meta-gradient")
    assert (hp - hp_first).norm() > 0.05 * hp.norm()          # the term matters in this problem
    assert_close(got - got_first, hp - hp_first, recipe, "the second-order term")


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_maml_with_an_inner_tef_grad_loop_and_outer_backward(recipe):
    """MAML written as a loop over tasks, with tef.grad inside (workspaces threaded) and
    loss.backward() outside: the meta-gradient matches high precision, and the workspaces that
    come back carry no autograd history."""
    model = converted_mlp()
    x_spt, y_spt, x_qry, y_qry = _maml_tasks()
    metas = {}
    for r in (None, recipe):
        params = {k: v.detach().requires_grad_() for k, v in detached_params(model).items()}
        ws = tef.init_workspaces(model, r)

        def loss_fn(p, ws, x, y):
            out, new_ws = tef.functional_call(model, p, ws, (x,), recipe=r)
            return (out - y).square().mean(), new_ws
        total = 0
        for t in range(x_spt.shape[0]):
            g, ws = tef.grad(loss_fn)(params, ws, x_spt[t], y_spt[t])
            loss, ws = loss_fn({k: params[k] - 0.5 * g[k] for k in params}, ws, x_qry[t], y_qry[t])
            assert all(v.grad_fn is None for v in ws.values())
            total = total + loss
        total.backward()
        metas[r] = torch.cat([params[k].grad.flatten() for k in sorted(params)])
    assert_close(metas[recipe], metas[None], recipe, "meta-gradient")


@pytest.mark.parametrize("vmapped", [False, True], ids=["loop", "vmap"])
def test_maml_outer_step_through_tef_value_and_grad_under_delayed_scaling(vmapped):
    """MAML's outer step as one tef.value_and_grad: per task an inner tef.grad step, then a second
    functional_call of the adapted weights on the workspaces the inner step returned (over tasks
    by a loop, or by vmap). The layers run twice inside the outer grad, chained: the meta-gradient
    matches high precision's and the outer step records the query calls' backward amaxes; the loop
    equals the same step taken with loss.backward()."""
    recipe = DelayedScaling(amax_history_len=4)
    model = converted_mlp()
    x_spt, y_spt, x_qry, y_qry = _maml_tasks()
    metas, histories = {}, {}
    for r in (None, recipe):
        def loss_fn(p, ws, x, y, r=r):
            out, new_ws = tef.functional_call(model, p, ws, (x,), recipe=r)
            return (out - y).square().mean(), new_ws

        def task(p, ws, xs, ys, xq, yq, loss_fn=loss_fn):
            g, ws = tef.grad(loss_fn)(p, ws, xs, ys)
            return loss_fn({k: p[k] - 0.5 * g[k] for k in p}, ws, xq, yq)

        def meta(p, ws, task=task):
            if vmapped:
                losses, ws = vmap(task, in_dims=(None, None, 0, 0, 0, 0))(p, ws, x_spt, y_spt, x_qry, y_qry)
                return losses.mean(), ws
            total = 0
            for t in range(x_spt.shape[0]):
                loss, ws = task(p, ws, x_spt[t], y_spt[t], x_qry[t], y_qry[t])
                total = total + loss
            return total / x_spt.shape[0], ws
        ws = tef.init_workspaces(model, r)
        _, grads, new_ws = tef.value_and_grad(meta)(detached_params(model), ws)
        metas[r] = torch.cat([grads[k].flatten() for k in sorted(grads)])
        histories[r] = new_ws
        if r is not None and not vmapped:
            live = {k: v.clone().requires_grad_() for k, v in detached_params(model).items()}
            loss, back_ws = meta(live, ws)
            loss.backward()
            torch.testing.assert_close(torch.cat([live[k].grad.flatten() for k in sorted(live)]), metas[r])
            for k, v in new_ws.items():
                torch.testing.assert_close(back_ws[k], v, rtol=0, atol=0, msg=k)
    assert_close(metas[recipe], metas[None], recipe, "meta-gradient")
    assert (histories[recipe]["3.grad_amax_history"][..., 0] > 0).all()


def test_a_gradient_penalty_under_delayed_scaling_scales_its_second_order_cotangents_by_their_own_amax():
    """tef.grad of a penalty on tef.grad's gradients: the outer backward's cotangents (here a
    millionth of the first-order gradients the grad histories scale) are quantized from their own
    amax, as current scaling's are (with the histories' scales: 25-42% off): the penalty's gradient is within
    FP8 noise of high precision, as it is under current scaling."""
    model = converted_mlp()
    params = detached_params(model)
    x, y = torch.randn(8, FEATURES), torch.randn(8, FEATURES)
    got = {}
    for r in (None, Float8CurrentScaling(), DelayedScaling(amax_history_len=4)):
        def loss(p, ws, r=r):
            out, new_ws = tef.functional_call(model, p, ws, (x,), recipe=r)
            return 1e-3 * (out - y).square().mean(), new_ws

        def penalty(p, ws, loss=loss):
            g, new_ws = tef.grad(loss)(p, ws)
            return 1e-6 * sum(v.square().sum() for v in g.values()), new_ws
        ws = tef.init_workspaces(model, r)
        for _ in range(3):          # histories of first-order gradients
            _, ws = tef.grad(loss)(params, ws)
        grads, _ = tef.grad(penalty)(params, ws)
        got[r] = torch.cat([grads[k].flatten() for k in sorted(grads)])
    current, delayed = (got[r] for r in got if r is not None)
    assert_close(delayed, got[None], DelayedScaling(), "the penalty's gradient")
    assert sqnr(got[None], delayed) > sqnr(got[None], current) - 1


# --- plain autograd ---------------------------------------------------------------------------

def test_a_gradient_penalty_in_plain_autograd_asks_for_higher_order_and_then_matches_torch_func():
    """autograd.grad(..., create_graph=True) through an FP8 layer whose forward kept only its
    casts is refused, naming the fix; inside tef.higher_order() it gives what torch.func gives."""
    recipe = Float8CurrentScaling()
    model = converted_mlp()
    params = detached_params(model)
    x = torch.randn(4, FEATURES)
    f = functional(model, recipe)

    def penalty(params):
        gx = grad(lambda x: f(params, x).sum())(x)
        return gx.square().sum()
    want = grad(penalty)(params)

    for p in model.parameters():
        p.requires_grad_(True)
    xr = x.clone().requires_grad_()
    with tef.autocast(recipe):
        out = model(xr)
    with pytest.raises(tef.errors.TransformError, match=r"tef.higher_order\(\)"):
        torch.autograd.grad(out.sum(), xr, create_graph=True)
    with tef.autocast(recipe), tef.higher_order():
        out = model(xr)
    (gx,) = torch.autograd.grad(out.sum(), xr, create_graph=True)
    gx.square().sum().backward()
    for k, p in model.named_parameters():     # the last bias leaves the penalty alone: no gradient
        torch.testing.assert_close(torch.zeros_like(p) if p.grad is None else p.grad, want[k], rtol=1e-4, atol=1e-6)
    assert all(want[k].norm() > 0 for k in ("1.weight", "3.weight"))


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_an_ensemble_trained_through_vmap_with_backward_outside(recipe):
    """vmap(functional_call) over stacked member weights, loss.backward() outside (gradients
    outside the vmap): each member's gradient equals that member's own step, and the
    workspaces come back as plain state, usable for the next step."""
    members = [converted_mlp(seed) for seed in range(3)]
    params, _ = stack_module_state(members)
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    base = copy.deepcopy(members[0])
    ws = tef.init_workspaces(base, recipe)
    x = torch.randn(4, FEATURES)

    def member(p, x):
        out, new_ws = tef.functional_call(base, p, ws, (x,), recipe=recipe)
        return out
    vmap(member, in_dims=(0, None))(params, x).square().sum().backward()
    for i, m in enumerate(members):
        p = {k: v.detach().requires_grad_() for k, v in m.named_parameters()}
        out, new_ws = tef.functional_call(base, p, ws, (x,), recipe=recipe)
        out.square().sum().backward()
        assert all(v.grad_fn is None for v in new_ws.values())
        for k in p:
            torch.testing.assert_close(params[k].grad[i], p[k].grad, rtol=1e-5, atol=1e-6)


def test_functional_loop_with_backward_threads_delayed_state_through_steps():
    """A functional loop that differentiates with loss.backward() rather than tef.grad: the
    workspaces it threads hold no graph, so the next step's backward runs."""
    recipe = DelayedScaling(amax_history_len=4)
    model = converted_mlp()
    params = {k: v.detach().requires_grad_() for k, v in detached_params(model).items()}
    ws = tef.init_workspaces(model, recipe)
    for step in range(3):
        out, ws = tef.functional_call(model, params, ws, (torch.randn(4, FEATURES),), recipe=recipe)
        out.square().sum().backward()
        assert all(v.grad_fn is None and not v.requires_grad for v in ws.values())
    assert ws["1.input_amax_history"].gt(0).sum() >= 2


def test_forward_mode_te_func_cannot_take_is_refused_by_name():
    """Plain autograd's forward mode (dual_level) and forward mode through tef.checkpoint are
    refused with what to use instead; a Stateful under DelayedScaling inside a torch.func
    transform is told to use functional_call; a stateless Stateful takes torch.func.jvp."""
    import torch.autograd.forward_ad as fwAD
    recipe = Float8CurrentScaling()
    model = converted_mlp()
    f = functional(model, recipe)
    params, x = detached_params(model), torch.randn(4, FEATURES)
    with fwAD.dual_level(), pytest.raises(tef.errors.DerivativeError, match=r"LinearFP8: plain autograd's forward mode.*"
                                                                     r"torch.func.jvp, jacfwd or hessian"):
        f(params, fwAD.make_dual(x, torch.ones_like(x)))

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return tef.checkpoint(self.inner, x)
    wrapped = Checkpointed()
    g = functional(wrapped, recipe)
    with pytest.raises(tef.errors.DerivativeError, match=r"tef.checkpoint: forward-mode derivatives.*without tef.checkpoint"):
        jvp(lambda x: g(detached_params(wrapped), x), (x,), (torch.ones_like(x),))

    shell = tef.Stateful(copy.deepcopy(model), recipe)
    tangent = jvp(shell, (x,), (torch.ones_like(x),))[1]
    assert torch.equal(tangent, jvp(lambda x: f(params, x), (x,), (torch.ones_like(x),))[1])
    delayed = tef.Stateful(copy.deepcopy(model), DelayedScaling(amax_history_len=4))
    with pytest.raises(tef.errors.TransformError, match=r"tef.Stateful under DelayedScaling.*\(grad\).*tef.functional_call"):
        grad(lambda x: delayed(x).sum())(x)
