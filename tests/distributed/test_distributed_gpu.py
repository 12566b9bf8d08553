"""tests/distributed/test_distributed.py's workers on 2 GPUs over NCCL (skipped without 2 GPUs).

The same standards, against one GPU: FSDP2's loss over 10 steps, the FP8 all-gather's
cast, DelayedScaling's histories on both ranks, a resumed run from a distributed
checkpoint. Every process started here has NVLink SHARP and multicast off
(dist_harness.NCCL_ENV).
"""
from __future__ import annotations

import pytest
import torch

import dist_harness as H
import test_distributed as T

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def _run(fn, *args):
    return H.run_ranks(fn, 2, *args, "cuda", backend="nccl")


def _one_gpu(rid):
    return H.reference_run(H.make_model(), T.RECIPES[rid], 2, T.STEPS, T.MICRO, device="cuda")


@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_fsdp_loss_equals_one_gpu(rid):
    """10 steps of fully_shard + Stateful on 2 GPUs: losses, parameters and workspaces as one GPU's;
    under DelayedScaling the histories are identical on both ranks."""
    results = _run(T.fsdp_stateful, rid)
    T._check_as_one_process(results, _one_gpu(rid))
    assert all(all(res["cache"]) for res in results)


@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_fsdp_functional_path_equals_one_gpu(rid):
    T._check_as_one_process(_run(T.fsdp_functional, rid), _one_gpu(rid))


@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_fsdp_float8_all_gather_cast_equals_one_gpu(rid):
    results = _run(T.fsdp_float8_all_gather, rid)
    T._check_as_one_process(results, _one_gpu(rid))
    for res in results:
        assert res["first_cast"] == {"kind": "Float8GatheredWeight", "data_equal": True, "scale_equal": True}


def test_fsdp_float8_all_gather_halves_the_gathered_bytes_on_gpus():
    for bf16, fp8 in _run(T.gathered_bytes):
        assert bf16 > 0 and fp8 * 2 == bf16


def test_dcp_resume_is_bit_identical_on_gpus(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = _run(T.checkpoint_save, "delayed", path, False)
    loaded = _run(T.checkpoint_load, "delayed", path, False)
    for s, l in zip(saved, loaded):
        for part in ("params", "optim", "workspaces"):
            assert H.same(s["final"][part], l["final"][part]) == [], part
        assert all(torch.equal(a, b) for sa, la in zip(s["losses"], l["losses"]) for a, b in zip(sa, la))


def compiled_fsdp(rank, world, compiled, device):
    """3 steps of FSDP + FP8 all-gather through a Stateful, compiled (aot_eager) or not: the losses."""
    shell, opt = T._checkpointed_model("current", True, device=device)
    runner = torch.compile(shell, backend="aot_eager") if compiled else shell
    losses = []
    for step in range(3):
        x, y = (t.to(device) for t in H.batch(step, rank))
        loss = H.loss_fn(runner(x, is_first_microbatch=True), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return losses


def test_compiled_fsdp_with_fp8_all_gather_equals_eager_on_gpus():
    """torch.compile of the Stateful shell around an FSDP model whose weights travel in FP8 (what
    benchmarks/fsdp_llama.py runs): the same losses as eager."""
    compiled = _run(compiled_fsdp, True)
    eager = _run(compiled_fsdp, False)
    assert all(torch.equal(a, b) for c, e in zip(compiled, eager) for a, b in zip(c, e))
