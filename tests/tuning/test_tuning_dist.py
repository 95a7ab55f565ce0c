"""Tuning across processes: ``sync_decisions`` with gloo ranks, and the ``polykernel tune`` command."""

from __future__ import annotations

import json

import pytest
import torch

import polykernel
from _tuning_helpers import isolate_tuning
from polykernel import tuning
from polykernel.tools import cli


@pytest.fixture(autouse=True)
def _tuning_env(tmp_path, monkeypatch):
    isolate_tuning(tmp_path, monkeypatch)
    yield
    polykernel.clear_caches()


def test_sync_decisions_without_a_process_group_is_a_no_op():
    assert polykernel.sync_decisions() == 0


def test_sync_decisions_two_gloo_ranks_adopt_rank0(tmp_path):
    import torch.multiprocessing as mp

    from _tuning_helpers import sync_worker

    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(sync_worker, args=(2, str(tmp_path / "init"), str(tmp_path), str(out)), nprocs=2, start_method="spawn")
    r0 = (out / "rank0.txt").read_text().split()
    r1 = (out / "rank1.txt").read_text().split()
    assert r0[0] == "torch" and r1[0] == "triton"  # before: each rank its own store's choice
    assert r0[1:3] == ["torch", "tuned"] and r1[1:3] == ["torch", "tuned"]  # after: rank 0's, everywhere
    assert r0[3] == r1[3] == "1"


def test_tune_command_fills_the_store(capsys):
    assert cli.main(["tune", "rms_norm", "--shapes", "8x32,3x16", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "2 decisions stored in" in out
    entries = tuning.store().entries()
    assert len(entries) == 2
    keys = [json.loads(k) for k in entries]
    assert {tuple(k["tensors"]) for k in keys} == {("float32[8x32]", "float32[32]"), ("float32[4x16]", "float32[16]")}
    polykernel.clear_caches()  # a later process, in the default cached mode
    x, w = torch.randn(8, 32), torch.ones(32)
    e = polykernel.explain("rms_norm", x, w)
    assert e.source == "tuned" and set(e.tuned["times"]) >= {"torch"}


def test_tune_command_grad_and_json(capsys):
    assert cli.main(["tune", "softmax", "--shapes", "4x16", "--grad", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (key,) = data["entries"]
    assert json.loads(key)["class"]["needs_grad"] is True


@pytest.mark.parametrize("shapes", ["", "axb", "0x4", ",,,"])
def test_tune_command_rejects_bad_shapes(shapes, capsys):
    with pytest.raises(SystemExit):
        cli.main(["tune", "rms_norm", "--shapes", shapes])
    assert "--shapes" in capsys.readouterr().err


def test_tune_command_unknown_op(capsys):
    assert cli.main(["tune", "no_such_op", "--shapes", "4x4"]) == 2
    assert "no_such_op" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_measurement_has_gpu_and_host_times(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    polykernel.rms_norm(x, w)
    e = polykernel.explain("rms_norm", x, w)
    assert e.source == "tuned"
    for t in e.tuned["times"].values():
        assert t.get("error") or (t["gpu_ms"] > 0 and t["host_ms"] > 0)
    assert any(not t.get("error") for t in e.tuned["times"].values()), e.tuned["times"]  # something was measured
    # Under capture the stored (graph) choice is used; nothing is measured there.
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        polykernel.rms_norm(x, w)
    g.replay()
