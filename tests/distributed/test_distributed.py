"""te_func on torch.distributed, on CPU with gloo: every test starts its own ranks (tests/distributed/dist_harness.py).

The standard is torchao's FSDP2 tests': loss and parameters over 10 steps equal to the
single-process run. Here they are bit for bit equal, since data parallelism over N ranks
computes one process's step over the N ranks' batches as N microbatches
(dist_harness.Reference); workspaces are identical on every rank, and a resumed run is
bit-identical. Tensor parallelism matches to fp32 rounding (its row-wise partial sums
add in another order). tests/distributed/test_distributed_gpu.py runs the same workers on 2 GPUs.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

import dist_harness as H
import te_func as tef
from te_func.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"current": Float8CurrentScaling(), "delayed": DelayedScaling(amax_history_len=4),
           "delayed-no-reduction": DelayedScaling(amax_history_len=4, reduce_amax=False),
           "mxfp8": MXFP8BlockScaling()}
STEPS, MICRO = 10, 2
CAST = "0.weight_cast.data"


def _train(shell, opt, rank, steps, start=0, micro=MICRO, device="cpu", on_micro=None, loss_of=H.mlp_loss):
    """`steps` steps of `micro` microbatches through a Stateful; returns the losses [step][micro]."""
    losses = []
    for step in range(start, start + steps):
        step_losses = []
        for m in range(micro):
            loss = loss_of(shell, step, rank, m, m == 0, device)
            loss.backward()
            step_losses.append(loss.detach().cpu())
            if on_micro is not None:
                on_micro(step, m)
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
    return losses


def _check_as_one_process(results, reference):
    """Each rank's (losses, params, workspaces) equal the single-process reference's (computed
    here, in the test's process), bit for bit, and the workspaces are the same on every rank."""
    ref_losses, ref_params, ref_ws = reference
    for rank, res in enumerate(results):
        losses, params, ws = res["losses"], res["params"], res["workspaces"]
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert all(torch.equal(g, w) for g, w in zip(got, want[rank])), (rank, step, got, want[rank])
        assert H.same(params, ref_params) == [], rank
        assert H.same(ws, ref_ws) == [], rank
    assert H.same(results[0]["workspaces"], results[1]["workspaces"]) == []


# --- FSDP2 through Stateful -------------------------------------------------------------------

def fsdp_stateful(rank, world, rid, device="cpu"):
    recipe = RECIPES[rid]
    model = H.make_model().to(device)
    H.shard(model)
    shell = tef.Stateful(model, recipe)
    opt = torch.optim.AdamW(shell.parameters(), lr=1e-2)
    casts = {}
    losses = _train(shell, opt, rank, STEPS, device=device,
                    on_micro=lambda step, m: casts.__setitem__((step, m), shell.workspaces[CAST]))
    # the weight cast: made at a step's first microbatch, reused by the second, made again next step
    cache = [casts[(s, 1)] is casts[(s, 0)] and casts[(s, 0)] is not casts.get((s - 1, 1)) for s in range(STEPS)]
    return {"losses": losses, "params": {k: H.full(p).cpu() for k, p in shell.model.named_parameters()},
            "workspaces": {k: v.cpu() for k, v in shell.workspaces.items()}, "cache": cache,
            "param_type": type(next(shell.model.parameters())).__name__}


@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_fsdp_stateful_trains_as_one_process(rid):
    """fully_shard + Stateful over 2 ranks, 2 microbatches each, 10 steps: losses, parameters and
    workspaces bit-equal to one process; each rank casts its weights once per step."""
    results = H.run_ranks(fsdp_stateful, 2, rid)
    _check_as_one_process(results, H.reference_run(H.make_model(), RECIPES[rid], 2, STEPS, MICRO))
    for res in results:
        assert res["param_type"] == "DTensor"          # the shell's parameters are FSDP's shards
        assert all(res["cache"])


# --- FSDP2 through the functional path --------------------------------------------------------

def fsdp_functional(rank, world, rid, device="cpu"):
    recipe = RECIPES[rid]
    model = H.make_model().to(device)
    H.shard(model)
    leaves = {k: p.detach().clone().requires_grad_() for k, p in model.named_parameters()}
    opt = torch.optim.AdamW(leaves.values(), lr=1e-2)
    ws = tef.init_workspaces(model, recipe)

    def loss_fn(params, ws, x, y, first):
        out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe, is_first_microbatch=first)
        return H.loss_fn(out, y), new_ws

    step_fn = tef.value_and_grad(loss_fn)
    losses, grad_types = [], set()
    for step in range(STEPS):
        step_losses, total = [], None
        for m in range(MICRO):
            x, y = (t.to(device) for t in H.batch(step, rank, m))
            loss, g, ws = step_fn({k: v.detach() for k, v in leaves.items()}, ws, x, y, m == 0)
            grad_types |= {type(v).__name__ for v in g.values()}
            total = g if total is None else {k: total[k] + g[k] for k in g}
            step_losses.append(loss.detach().cpu())
        for k, v in leaves.items():
            v.grad = total[k]
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
    out = {"losses": losses, "params": {k: H.full(p).cpu() for k, p in leaves.items()},
           "workspaces": {k: v.cpu() for k, v in ws.items()}, "grad_types": grad_types}
    if isinstance(recipe, Float8CurrentScaling):
        # functional_call with the sharded leaves themselves and loss.backward(): gradients land
        # in the leaves' .grad as DTensor shards, equal to the Stateful run's.
        for m in range(MICRO):
            x, y = (t.to(device) for t in H.batch(0, rank, m))
            pout, _ = tef.functional_call(model, leaves, ws, (x,), recipe=recipe)
            H.loss_fn(pout, y).backward()
        out["eager_grad_type"] = type(leaves["0.weight"].grad).__name__
        out["eager_grads"] = {k: H.full(v.grad).cpu() for k, v in leaves.items()}
        out["functional_grads"] = _value_and_grad_sum(model, leaves, ws, recipe, rank, device)
    return out


def _value_and_grad_sum(model, leaves, ws, recipe, rank, device):
    def loss_fn(params, ws, x, y):
        out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=recipe)
        return H.loss_fn(out, y), new_ws
    total = None
    for m in range(MICRO):
        x, y = (t.to(device) for t in H.batch(0, rank, m))
        _, g, _ = tef.value_and_grad(loss_fn)({k: v.detach() for k, v in leaves.items()}, ws, x, y)
        total = g if total is None else {k: total[k] + g[k] for k in g}
    return {k: H.full(v).cpu() for k, v in total.items()}


@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_fsdp_functional_path_trains_as_one_process(rid):
    """tef.value_and_grad over the DTensor shards of a fully_shard model: gradients come back as
    DTensor shards, and 10 steps equal one process bit for bit; functional_call with the shards
    and loss.backward() gives the same gradients."""
    results = H.run_ranks(fsdp_functional, 2, rid)
    _check_as_one_process(results, H.reference_run(H.make_model(), RECIPES[rid], 2, STEPS, MICRO))
    for res in results:
        assert res["grad_types"] == {"DTensor"}
        if rid == "current":
            assert res["eager_grad_type"] == "DTensor"
            assert H.same(res["eager_grads"], res["functional_grads"]) == []


# --- a HuggingFace model converted with tef.convert ---------------------------------------------

HF_STEPS = 3


def hf_model(name):
    """A tiny 1-layer HF Llama, GPT-2 or Mixtral (tests/cases.py's configs), converted with tef.convert."""
    from cases import tiny_gpt2, tiny_llama, tiny_mixtral
    torch.manual_seed(0)
    return tef.convert({"llama": tiny_llama, "gpt2": tiny_gpt2, "mixtral": tiny_mixtral}[name](layers=1))


def hf_loss(shell, step, rank, micro, first, device="cpu"):
    from cases import SEQ, VOCAB
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))
    return shell(input_ids=ids.to(device), labels=ids.to(device), is_first_microbatch=first).loss


def _hf_shard(model):
    from torch.distributed.fsdp import fully_shard
    for block in (model.model.layers if hasattr(model, "model") else model.transformer.h):
        fully_shard(block)
    fully_shard(model)
    return model


def hf_fsdp(rank, world, runs):
    """Each (name, rid, fp8_all_gather) of `runs`: HF_STEPS steps of fully_shard + Stateful."""
    out = {}
    for name, rid, fp8_all_gather in runs:
        model = hf_model(name)
        if fp8_all_gather:
            tef.distributed.enable_fsdp_float8_all_gather(model, RECIPES[rid])
        shell = tef.Stateful(_hf_shard(model), RECIPES[rid])
        opt = torch.optim.AdamW(shell.parameters(), lr=1e-2)
        losses = _train(shell, opt, rank, HF_STEPS, loss_of=hf_loss)
        out[name] = {"losses": losses, "params": {k: H.full(p).cpu() for k, p in shell.model.named_parameters()},
                     "workspaces": {k: v.cpu() for k, v in shell.workspaces.items()},
                     "fp8_gathered": sorted(k for k, p in shell.model.named_parameters()
                                            if isinstance(p.to_local(), tef.distributed.Float8AllGatherWeight))}
    return out


# Mixtral: its experts' 3-D weights sharded along the experts, gathered in high precision and cast
# per expert (the FP8 all-gather takes its other GEMM weights).
HF_RUNS = (("llama", "delayed", False), ("gpt2", "current", True), ("mixtral", "delayed", True))


def test_fsdp_trains_a_converted_hf_model_as_one_process():
    """tef.convert'ed HF Llama (DelayedScaling, amaxes reduced) and GPT-2 (current scaling, FP8
    all-gather of its transposed Conv1D weights; the lm_head tied to the embedding stays high
    precision) under fully_shard + Stateful on 2 ranks: bit-equal to one process."""
    results = H.run_ranks(hf_fsdp, 2, HF_RUNS)
    for name, rid, _ in HF_RUNS:
        reference = H.reference_run(hf_model(name), RECIPES[rid], 2, HF_STEPS, MICRO, loss_of=hf_loss)
        _check_as_one_process([res[name] for res in results], reference)
    gathered = results[0]["gpt2"]["fp8_gathered"]
    assert "transformer.h.0.attn.c_attn.weight" in gathered and "lm_head.weight" not in gathered


# --- FP8 all-gather ---------------------------------------------------------------------------

def fsdp_float8_all_gather(rank, world, rid, device="cpu"):
    from te_func.quant import scheme_for
    from te_func.quant.workspace import make_cast
    recipe = RECIPES[rid]
    model = H.make_model().to(device)
    whole = copy.deepcopy(model)
    tef.distributed.enable_fsdp_float8_all_gather(model, recipe)
    H.shard(model)
    gathered = []
    model[2].register_forward_pre_hook(lambda mod, args: gathered.append(
        (type(mod.weight).__name__, H.bits(mod.weight._data).clone(), mod.weight._scale_inv.clone())))
    shell = tef.Stateful(model, recipe)
    opt = torch.optim.AdamW(shell.parameters(), lr=1e-2)
    losses = _train(shell, opt, rank, 1, device=device)
    # the first step's gathered cast against one process's cast of the whole weight (with the
    # step's scale: under DelayedScaling the scale the workspaces give this step)
    state = None
    if isinstance(recipe, DelayedScaling):
        from te_func.quant import DelayedState, delayed_update
        first_ws = tef.init_workspaces(whole, recipe)
        state = delayed_update(DelayedState(first_ws["2.weight_amax_history"], first_ws["2.weight_scale"]),
                               recipe, "weight")
    single, _ = make_cast(whole[2].weight.detach(), scheme_for(recipe, "weight"), state)
    kind, data, scale_inv = gathered[0]
    first_cast = {"kind": kind, "data_equal": torch.equal(data, H.bits(single.rowwise.data)),
                  "scale_equal": torch.equal(scale_inv, single.rowwise.scale_inv)}
    losses += _train(shell, opt, rank, STEPS - 1, start=1, device=device)
    return {"losses": losses, "params": {k: H.full(p).cpu() for k, p in shell.model.named_parameters()},
            "workspaces": {k: v.cpu() for k, v in shell.workspaces.items()}, "first_cast": first_cast}


def gathered_bytes(rank, world, device="cpu"):
    """Bytes each rank hands FSDP's all-gathers over one step of a bf16 model, without and with
    FP8 all-gather (counted by an all-gather that FSDP is told to use)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
    sent = []

    class Counting(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            sent.append(input_tensor.numel() * input_tensor.element_size())
            return super().__call__(output_tensor, input_tensor, group, async_op)

    per_variant = []
    for fp8 in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(tef.nn.Linear(32, 64, bias=False, params_dtype=torch.bfloat16),
                                    tef.nn.Linear(64, 32, bias=False, params_dtype=torch.bfloat16)).to(device)
        if fp8:
            tef.distributed.enable_fsdp_float8_all_gather(model, RECIPES["current"])
        H.shard(model)
        for m in model.modules():
            if hasattr(m, "set_custom_all_gather"):
                m.set_custom_all_gather(Counting())
        shell = tef.Stateful(model, RECIPES["current"])
        sent.clear()
        x = H.batch(0, rank)[0].to(device, torch.bfloat16)
        shell(x, is_first_microbatch=True).float().square().mean().backward()
        per_variant.append(sum(sent))
    return per_variant


@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_fsdp_float8_all_gather_casts_as_one_process(rid):
    """With FP8 all-gather each rank casts its shard with the whole weight's scale: the gathered
    cast is bit for bit one process's cast, and 10 steps equal one process."""
    results = H.run_ranks(fsdp_float8_all_gather, 2, rid)
    _check_as_one_process(results, H.reference_run(H.make_model(), RECIPES[rid], 2, STEPS, MICRO))
    for res in results:
        assert res["first_cast"] == {"kind": "Float8GatheredWeight", "data_equal": True, "scale_equal": True}


def test_fsdp_float8_all_gather_halves_the_gathered_bytes():
    for bf16, fp8 in H.run_ranks(gathered_bytes, 2):
        assert bf16 > 0 and fp8 * 2 == bf16


def test_fp8_all_gather_refuses_what_it_cannot_do():
    """Block recipes and a high-precision backward are refused up front; an FP8-gathered weight in a
    high-precision call, or cast for another recipe, raises instead of computing with FP8 values."""
    from te_func.quant import scheme_for
    from te_func.quant.workspace import make_cast
    with pytest.raises(ValueError, match="tensor-wise recipes"):
        tef.distributed.enable_fsdp_float8_all_gather(H.make_model(), RECIPES["mxfp8"])
    with pytest.raises(ValueError, match="high_precision"):
        tef.distributed.enable_fsdp_float8_all_gather(H.make_model(),
                                                      Float8CurrentScaling(backward_override="high_precision"))
    model = tef.distributed.enable_fsdp_float8_all_gather(H.make_model(), RECIPES["current"])
    assert isinstance(model[2].weight, tef.distributed.Float8AllGatherWeight)
    with pytest.raises(ValueError, match="already applied"):
        tef.distributed.enable_fsdp_float8_all_gather(model, RECIPES["current"])
    # what FSDP's post-all-gather hands the layer
    w = torch.randn(64, 32)
    cast, _ = make_cast(w, scheme_for(RECIPES["current"], "weight"))
    gathered = tef.distributed.Float8GatheredWeight(cast.rowwise.data, cast.rowwise.scale_inv, w.abs().max(),
                                                    RECIPES["current"], torch.float32)
    with pytest.raises(RuntimeError, match="all-gathered in FP8"):
        torch.nn.functional.linear(torch.randn(4, 32), gathered)
    with pytest.raises(ValueError, match="cannot be cast"):
        make_cast(gathered, scheme_for(RECIPES["delayed"], "weight"))
    carried, _ = make_cast(gathered, scheme_for(RECIPES["current"], "weight"))
    assert torch.equal(H.bits(carried.columnwise.data), H.bits(cast.columnwise.data))
    # a TransposedLinear (GPT-2's Conv1D) reads weight.t(): the cast of the transposed weight
    cast_t, _ = make_cast(w.t(), scheme_for(RECIPES["current"], "weight"))
    carried_t, _ = make_cast(gathered.t(), scheme_for(RECIPES["current"], "weight"))
    assert torch.equal(H.bits(carried_t.rowwise.data), H.bits(cast_t.rowwise.data))
    assert torch.equal(H.bits(carried_t.columnwise.data), H.bits(cast_t.columnwise.data))


# --- amax reduction ---------------------------------------------------------------------------

def amax_reduction(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    out = {}
    for name, rid, group in (("mesh", "delayed", init_device_mesh("cpu", (world,))),
                             ("none", "delayed-no-reduction", None)):
        model = H.make_model()
        H.shard(model)
        shell = tef.Stateful(model, RECIPES[rid], amax_group=group)
        opt = torch.optim.AdamW(shell.parameters(), lr=1e-2)
        _train(shell, opt, rank, 3)
        out[name] = {k: v.clone() for k, v in shell.workspaces.items()}
    out.update(_eager_and_compiled_backward_amaxes(rank))
    return out


def _eager_and_compiled_backward_amaxes(rank):
    """An eager and a compiled shell (default group), fed alike: a backward over everything, one
    over the input only (its amaxes wait in the compiled shell's inboxes), a distributed
    checkpoint's state_dict, one more step. {"eager" / "compiled": {"checkpoint" / "final":
    the workspaces then}}."""
    out = {}
    for name in ("eager", "compiled"):
        shell = tef.Stateful(H.make_model(), RECIPES["delayed"])
        call = shell if name == "eager" else torch.compile(shell, fullgraph=True, backend="aot_eager")
        for step, how in enumerate(("backward()", "input only", "backward()")):
            x, y = H.batch(step, rank)
            x.requires_grad_()
            loss = H.loss_fn(call(x, is_first_microbatch=True), y)
            if how == "input only":
                torch.autograd.grad(loss, [x])
                saved = tef.distributed.state_dict(shell)["workspaces"]
            else:
                loss.backward()
        out[name] = {"checkpoint": {k: v.clone() for k, v in saved.items()},
                     "final": {k: v.clone() for k, v in shell.workspaces.items()}}
    return out


def test_delayed_amaxes_are_reduced_over_the_amax_group():
    """reduce_amax=True over an explicit group (a 1-D DeviceMesh): all ranks hold the same histories
    and scales; reduce_amax=False: each rank its own input and gradient histories (the weight's,
    cast whole on every rank, agree). A compiled shell's backward amaxes are reduced as an eager
    shell's."""
    r0, r1 = H.run_ranks(amax_reduction, 2)
    assert H.same(r0["mesh"], r1["mesh"]) == []
    differ = H.same(r0["none"], r1["none"])
    assert differ and all(re.search(r"(input|grad)_(amax_history|scale)$", k) for k in differ), differ
    assert any(k.endswith("input_amax_history") for k in differ) and any(k.endswith("grad_amax_history")
                                                                         for k in differ)
    # A compiled shell's backward amaxes, whether they join the histories as a backward ends (over
    # everything) or wait for the next call or a distributed checkpoint (over the input only), are
    # all-reduced as an eager shell's: bit for bit the eager shell's workspaces, on every rank.
    for res in (r0, r1):
        for when in ("checkpoint", "final"):
            assert H.same(res["compiled"][when], res["eager"][when]) == [], when
    assert H.same(r0["compiled"]["final"], r1["compiled"]["final"]) == []
    final = r0["compiled"]["final"]
    grad = [final[k] for k in final if k.endswith("grad_amax_history")]
    assert grad and all(int((h > 0).sum()) == 3 for h in grad)         # three steps, each in its own slot


def test_amax_group_without_a_process_group_is_refused():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        tef.Stateful(H.make_model(), RECIPES["delayed"], amax_group=object())
    # Without a process group nothing is reduced: one process keeps TE's default silently.
    assert tef.distributed.amax_reduction_group(RECIPES["delayed"]) is None


# --- tensor parallelism -----------------------------------------------------------------------

TP_STEPS, SEQ = 3, 8


def _tp_inputs(step, device):
    return torch.randn(SEQ, 2, H.IN, generator=torch.Generator().manual_seed(step)).to(device)  # (seq, batch, in)


def _tp_train(shell, inputs, device="cpu"):
    """TP_STEPS SGD steps on sum(out ** 2); returns [(out, {name: grad})] per step and the DelayedScaling state."""
    opt = torch.optim.SGD(shell.parameters(), lr=0.1)
    steps = []
    for x in inputs:
        out = shell(x, is_first_microbatch=True)
        out.square().sum().backward()
        steps.append((out.detach().cpu(), {k: H.full(p.grad).cpu() for k, p in shell.model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    state = {k: H.full(v).cpu() for k, v in shell.workspaces.items() if k.endswith(("_amax_history", "_scale"))}
    return steps, state


def tensor_parallel(rank, world, rid, device="cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    D = tef.distributed
    mesh = init_device_mesh(torch.device(device).type, (world,))
    model = H.make_model().to(device)
    # sequence parallel around the norms (the sequence is dim 0), Megatron's column / row split
    parallelize_module(model, mesh, {"0": D.ColwiseParallel(input_layouts=Shard(0)),
                                     "2": D.RowwiseParallel(output_layouts=Shard(0)),
                                     "3": D.LayerNormMLPParallel(input_layouts=Shard(0), output_layouts=Shard(0))})
    seq = SEQ // world
    mine = [_tp_inputs(step, device)[rank * seq:(rank + 1) * seq] for step in range(TP_STEPS)]
    steps, state = _tp_train(tef.Stateful(model, RECIPES[rid]), mine, device)
    result = {"steps": steps, "state": state}
    if rid == "current":   # te_func's norms under torch's own SequenceParallel
        torch.manual_seed(0)
        norms = torch.nn.Sequential(tef.nn.LayerNorm(H.IN), tef.nn.RMSNorm(H.IN)).to(device)
        parallelize_module(norms, mesh, {"0": SequenceParallel(sequence_dim=0),
                                         "1": SequenceParallel(sequence_dim=0, use_local_output=True)})
        result["norms"] = norms(mine[0]).detach().cpu()
        result["errors"] = _tensor_parallel_misuse(mesh, device)
    return result


def _tensor_parallel_misuse(mesh, device):
    from torch.distributed.tensor.parallel import parallelize_module
    errors = {}
    model = parallelize_module(tef.nn.Linear(32, 64).to(device), mesh, tef.distributed.ColwiseParallel())
    for name, make in (("block recipe", lambda: tef.Stateful(model, RECIPES["mxfp8"])),
                       ("rowwise norm", lambda: parallelize_module(tef.nn.LayerNormLinear(32, 64).to(device), mesh,
                                                                   tef.distributed.RowwiseParallel())),
                       ("tef.grad", lambda: tef.grad(_sum_loss(model))(
                           {k: p.detach() for k, p in model.named_parameters()},
                           tef.init_workspaces(model, RECIPES["current"]), torch.randn(4, 32).to(device)))):
        try:
            make()
            errors[name] = None
        except (ValueError, NotImplementedError) as e:
            errors[name] = str(e)
    return errors


def _sum_loss(model):
    def loss_fn(params, ws, x):
        out, new_ws = tef.functional_call(model, params, ws, (x,), recipe=RECIPES["current"])
        return out.sum(), new_ws
    return loss_fn


@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_tensor_parallel_equals_one_process(rid):
    """ColwiseParallel / RowwiseParallel / LayerNormMLPParallel with sequence parallelism over 2 ranks:
    outputs, gradients and DelayedScaling state as one process's, to fp32 rounding (the row-wise
    GEMMs add their partial sums in another order); te_func's norms under SequenceParallel too."""
    ref_steps, ref_state = _tp_train(tef.Stateful(H.make_model(), RECIPES[rid]),
                                     [_tp_inputs(step, "cpu") for step in range(TP_STEPS)])
    seq = SEQ // 2
    for rank, res in enumerate(H.run_ranks(tensor_parallel, 2, rid)):
        rows = slice(rank * seq, (rank + 1) * seq)
        for (out, grads), (ref_out, ref_grads) in zip(res["steps"], ref_steps):
            torch.testing.assert_close(out, ref_out[rows], rtol=1e-5, atol=1e-6)
            for k, g in grads.items():
                torch.testing.assert_close(g, ref_grads[k], rtol=1e-5, atol=1e-6, msg=k)
        assert res["state"].keys() == ref_state.keys() and (rid != "delayed" or ref_state)
        for k, v in res["state"].items():
            torch.testing.assert_close(v, ref_state[k], rtol=1e-5, atol=0, msg=k)
        if rid == "current":
            torch.manual_seed(0)
            norms = torch.nn.Sequential(tef.nn.LayerNorm(H.IN), tef.nn.RMSNorm(H.IN))
            torch.testing.assert_close(res["norms"], norms(_tp_inputs(0, "cpu"))[rows].detach(), rtol=1e-5, atol=1e-6)
            errors = res["errors"]
            assert "cannot quantize weight" in errors["block recipe"]
            assert "needs whole rows" in errors["rowwise norm"]
            assert "tensor-parallel (DTensor) parameter" in errors["tef.grad"]


# --- checkpoints ------------------------------------------------------------------------------

def _checkpointed_model(rid, fp8_all_gather, seed=0, device="cpu"):
    recipe = RECIPES[rid]
    model = H.make_model(seed).to(device)
    if fp8_all_gather:
        tef.distributed.enable_fsdp_float8_all_gather(model, recipe)
    H.shard(model)
    shell = tef.Stateful(model, recipe)
    return shell, torch.optim.AdamW(shell.parameters(), lr=1e-2)


def _snapshot(shell, opt):
    optim = tef.distributed.state_dict(shell, opt)["optim"]["state"]
    return {"params": {k: H.full(p).cpu() for k, p in shell.model.named_parameters()},
            "optim": {f"{k}.{n}": H.full(v).cpu() for k, s in optim.items() for n, v in s.items()},
            "workspaces": {k: v.cpu().clone() for k, v in shell.workspaces.items()}}


def checkpoint_save(rank, world, rid, path, fp8_all_gather, device="cpu"):
    import torch.distributed.checkpoint as dcp
    shell, opt = _checkpointed_model(rid, fp8_all_gather, device=device)
    _train(shell, opt, rank, 3, device=device)
    dcp.save(tef.distributed.state_dict(shell, opt), checkpoint_id=path)
    saved = _snapshot(shell, opt)
    losses = _train(shell, opt, rank, 3, start=3, device=device)
    return {"saved": saved, "losses": losses, "final": _snapshot(shell, opt)}


def checkpoint_load(rank, world, rid, path, fp8_all_gather, device="cpu"):
    import torch.distributed.checkpoint as dcp
    shell, opt = _checkpointed_model(rid, fp8_all_gather, seed=123, device=device)   # other weights, replaced
    sd = tef.distributed.state_dict(shell, opt)
    dcp.load(sd, checkpoint_id=path)
    tef.distributed.load_state_dict(shell, opt, sd)
    loaded = _snapshot(shell, opt)
    losses = _train(shell, opt, rank, 3 if world == 2 else 1, start=3, device=device)
    return {"loaded": loaded, "losses": losses, "final": _snapshot(shell, opt)}


def checkpoint_load_single(rank, world, rid, path):
    """One process, no FSDP, loads the 2-rank checkpoint and runs the 2 ranks' batches as microbatches."""
    import torch.distributed.checkpoint as dcp
    ref = H.Reference(H.make_model(seed=123), RECIPES[rid], world=2, micro=MICRO)
    sd = tef.distributed.state_dict(ref.shell, ref.opt)
    dcp.load(sd, checkpoint_id=path)
    tef.distributed.load_state_dict(ref.shell, ref.opt, sd)
    losses = [ref.step(s) for s in range(3, 6)]
    optim = tef.distributed.state_dict(ref.shell, ref.opt)["optim"]["state"]
    return {"losses": losses, "params": ref.params(), "workspaces": ref.workspaces(),
            "optim": {f"{k}.{n}": v.cpu() for k, s in optim.items() for n, v in s.items()}}


# DelayedScaling with reduction resumes in the 2 -> 1 / 4 test below and in the torchrun example.
@pytest.mark.parametrize("rid, fp8_all_gather", [("current", True), ("delayed-no-reduction", False)],
                         ids=["current-fp8-all-gather", "delayed-no-reduction"])
def test_checkpoint_resume_is_bit_identical(rid, fp8_all_gather, tmp_path):
    """torch.distributed.checkpoint of parameters, optimizer state and workspaces at step 3 on 2
    ranks; a fresh 2-rank run loads it and its steps 3-5 are bit-identical to the uninterrupted run."""
    path = str(tmp_path / "ckpt")
    saved = H.run_ranks(checkpoint_save, 2, rid, path, fp8_all_gather)
    loaded = H.run_ranks(checkpoint_load, 2, rid, path, fp8_all_gather)
    for s, l in zip(saved, loaded):
        for part in ("params", "optim", "workspaces"):
            assert H.same(s["saved"][part], l["loaded"][part]) == [], part
            assert H.same(s["final"][part], l["final"][part]) == [], part
        assert all(torch.equal(a, b) for sa, la in zip(s["losses"], l["losses"]) for a, b in zip(sa, la))


def test_checkpoint_saved_on_2_ranks_loads_on_1_and_on_4(tmp_path):
    """The 2-rank checkpoint loads into one process without FSDP, whose next 3 steps (the two ranks'
    batches as microbatches) are bit-identical to the 2-rank run's, and into 4 FSDP ranks."""
    path = str(tmp_path / "ckpt")
    saved = H.run_ranks(checkpoint_save, 2, "delayed", path, False)
    (single,) = H.run_ranks(checkpoint_load_single, 1, "delayed", path)
    for rank, s in enumerate(saved):
        assert all(torch.equal(a, b) for a, b in zip(sum(s["losses"], []),
                                                     [l for step in single["losses"] for l in step[rank]]))
    for part in ("params", "optim", "workspaces"):
        assert H.same(saved[0]["final"][part], single[part]) == [], part
    for res in H.run_ranks(checkpoint_load, 4, "delayed", path, False):
        for part in ("params", "optim", "workspaces"):
            assert H.same(saved[0]["saved"][part], res["loaded"][part]) == [], part
        assert all(torch.isfinite(l).all() for step in res["losses"] for l in step)


# --- the torchrun example ---------------------------------------------------------------------

def torchrun_example(rank, world, args):
    """examples/fsdp_train.py's main() on one rank, in the environment torchrun sets; what it printed."""
    import contextlib
    import importlib.util
    import io
    spec = importlib.util.spec_from_file_location("fsdp_train", ROOT / "examples" / "fsdp_train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        example.main(args)
    return printed.getvalue()


def test_torchrun_example_trains_on_two_ranks():
    """`torchrun --standalone --nproc_per_node 2 examples/fsdp_train.py --steps 4 --fp8-all-gather`,
    as two ranks started with torchrun's environment: it trains, keeps identical histories and
    resumes bit-identically."""
    out, rest = H.run_ranks(torchrun_example, 2, ["--steps", "4", "--fp8-all-gather"], torchrun_env=True)
    assert rest == ""                                   # only rank 0 prints
    assert len(re.findall(r"^step \d+ loss \d+\.\d+$", out, re.M)) == 4, out
    assert "histories identical on all ranks: True" in out
    assert "resumed run bit-identical: True" in out
