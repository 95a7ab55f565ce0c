"""Data parallelism with polykernel: one DDP / FSDP2 (``fully_shard``) training step of the demo
model gives the same loss and gradients with polykernel as without it, and as one process on the
whole batch.

The CPU variant (gloo, 2 processes) runs everywhere; the NCCL variant needs two GPUs
(``-m gpu2``). The workers set NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 (``polykernel.tools.models.distributed.SAFE_ENV``).
"""

from __future__ import annotations

import pytest
import torch

from polykernel.tools.models import distributed

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available in this build")

CPU_MODES = ("ddp", "fsdp2", "local")


@pytest.fixture(scope="module")
def gloo_reports():
    if not torch.distributed.is_gloo_available():
        pytest.skip("gloo backend not available")
    reports = distributed.spawn(2, "gloo", CPU_MODES, ("float32",))
    return {r["mode"]: r for r in reports}


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_gloo_two_processes_polykernel_matches_torch(gloo_reports, mode):
    r = gloo_reports[mode]
    assert r["backend"] == "gloo" and r["world_size"] == 2
    assert distributed.problems(r) == []
    # the polykernel path went through polykernel (torch impls on the CPU)
    assert {"norm.rms_norm", "activation.swiglu", "embedding.rope", "loss.fused_linear_cross_entropy"} <= set(r["impls"])
    # one SGD step at lr 0.5 moves the loss: the second forward used updated weights
    assert abs(r["loss_after_step_torch"] - r["loss_torch"]) > 1e-3


def test_gloo_control_without_data_parallelism_is_caught(gloo_reports):
    # each rank alone sees half the batch: the full-batch check must flag it, or it proves nothing
    issues = distributed.problems(gloo_reports["local"])
    assert any("not averaged" in i for i in issues), issues


def test_problems_reports_each_mismatch():
    good = {
        "dtype": "float32",
        "loss_polykernel": 2.0,
        "loss_torch": 2.0,
        "loss_full_batch": 2.0,
        "loss_after_step_polykernel": 1.5,
        "loss_after_step_torch": 1.5,
        "grad_diff": 1e-7,
        "grad_diff_param": "lm_head.weight",
        "full_batch_grad_diff": 1e-7,
        "ranks_agree": True,
    }
    assert distributed.problems(good) == []
    assert len(distributed.problems({**good, "loss_polykernel": 2.01})) == 1
    assert "lm_head.weight" in distributed.problems({**good, "grad_diff": 1e-2})[0]
    assert distributed.problems({**good, "grad_diff": float("nan")})  # NaN is a failure
    assert distributed.problems({**good, "ranks_agree": False}) == ["ranks hold different gradients"]


two_gpus = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2), reason="needs two CUDA GPUs (NCCL)")


@pytest.fixture(scope="module")
def nccl_reports():
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
        pytest.skip("needs two CUDA GPUs (NCCL)")
    reports = distributed.spawn(
        2,
        "nccl",
        ("ddp", "fsdp2"),
        ("float32", "bfloat16"),
        config={"hidden_size": 256, "intermediate_size": 688, "vocab_size": 32000},
        batch=4,
        seq=256,
    )
    return {(r["mode"], r["dtype"]): r for r in reports}


@pytest.mark.gpu2
@two_gpus
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_nccl_two_gpus_polykernel_matches_torch(nccl_reports, mode, dtype):
    r = nccl_reports[(mode, dtype)]
    assert r["backend"] == "nccl" and r["world_size"] == 2
    assert distributed.problems(r) == [], r
    # on a GPU the dispatcher picks the GPU kernels, not the torch fallbacks
    assert r["impls"].get("norm.rms_norm") not in (None, "torch"), r["impls"]
