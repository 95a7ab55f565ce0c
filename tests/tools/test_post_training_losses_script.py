"""benchmarks/kernels/post_training_losses.py's CPU smoke run (``--tiny``), as the GPU plan runs the
script: its rows are written as measured, polykernel's own choice agrees with its torch impl and
with the plain loss, and Liger's row says why it did not run on a CPU. The cross-entropy options
(``ce_*``, ``flce_*``): each reaches polykernel's call and the plain loss, their rows agree, they
come after the ten main losses, so a run cut at its limit keeps those, and ``--only`` resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from importlib.util import find_spec

import pytest
import torch

from _scripts import BENCHMARKS, load_benchmark
from polykernel.tools.rows import read_rows

SCRIPT = BENCHMARKS / "kernels" / "post_training_losses.py"
SRC = BENCHMARKS.parent / "src"
CE_OPTION_LOSSES = [f"{form}_{option}" for form in ("ce", "flce") for option in ("softcap", "z_loss", "weight", "label_smoothing")]
TEN = ["dpo", "orpo", "cpo", "simpo", "kto", "grpo", "kl_div", "jsd", "tvd", "fused_linear_jsd"]


def _env() -> dict[str, str]:
    pythonpath = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": pythonpath, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}  # a CPU run also on a GPU machine


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(SCRIPT), "--tiny", *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    data["stdout"] = proc.stdout
    return data


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-6)


def test_tiny_run_writes_agreeing_rows(tmp_path):
    data = _run(tmp_path, "--only", "dpo,kl_div", "--impls", "auto,torch,liger,plain")
    assert data["stdout"].startswith("estimate: 8 rows"), data["stdout"][:200]  # announced before measuring
    assert data["complete"] and data["device"] == "cpu"
    rows = {(r["loss"], r["impl"]): r for r in data["rows"]}
    assert list(rows) == [(loss, impl) for loss in ("dpo", "kl_div") for impl in ("auto", "torch", "liger", "plain")]
    for loss in ("dpo", "kl_div"):
        for impl in ("auto", "torch", "plain"):
            row = rows[loss, impl]
            assert "error" not in row, row
            assert row["agrees"] and row["ms"] > 0 and row["peak_extra_mib"] is None, row
        assert abs(rows[loss, "auto"]["loss_value"] - rows[loss, "torch"]["loss_value"]) <= 1e-5 * abs(rows[loss, "torch"]["loss_value"])
        assert rows[loss, "liger"]["error"].startswith("skipped on CPU"), rows[loss, "liger"]
        # auto's row names the impls that ran (its own decisions), for its loss's op
        ran = rows[loss, "auto"]["ran"]
        assert ran and all("=" in r for r in ran) and any(loss in r.split("=")[0] for r in ran), ran


@pytest.mark.slow  # ~12 s: polykernel's own choice is its triton impl, interpreted
def test_tiny_run_writes_the_ce_option_rows(tmp_path):
    data = _run(tmp_path, "--only", ",".join(CE_OPTION_LOSSES), "--impls", "auto,torch,liger,plain")
    assert data["stdout"].startswith("estimate: 32 rows") and data["complete"], data["stdout"][:200]
    assert data["ce_options"]["softcap"] == 30.0 and data["ce_options"]["z_loss"] == 1e-4
    assert data["chunk_mib"] == {"linear_logps": 1024, "fused_linear_cross_entropy": 256}  # the library's budgets
    rows = {(r["loss"], r["impl"]): r for r in data["rows"]}
    assert list(rows) == [(loss, impl) for loss in CE_OPTION_LOSSES for impl in ("auto", "torch", "liger", "plain")]
    for loss in CE_OPTION_LOSSES:
        torch_value = rows[loss, "torch"]["loss_value"]
        for impl in ("auto", "torch", "plain"):
            row = rows[loss, impl]
            assert "error" not in row and row["agrees"] and row["ms"] > 0, row
            assert _rel(row["loss_value"], torch_value) <= 1e-5, row  # fp32 on the CPU: far inside the 2% of a bf16 run
        assert rows[loss, "liger"]["error"].startswith("skipped on CPU"), rows[loss, "liger"]
    assert rows["ce_softcap", "torch"]["shape"] == "N=64,V=1000" and rows["flce_softcap", "torch"]["shape"] == "N=64,H=32,V=1000"


def test_flce_chunk_budget_is_set_and_recorded(tmp_path):
    data = _run(tmp_path, "--only", "flce_z_loss", "--impls", "torch,plain", "--flce-chunk-mib", "1")
    assert data["chunk_mib"] == {"linear_logps": 1024, "fused_linear_cross_entropy": 1}
    rows = {r["impl"]: r for r in data["rows"]}
    assert "error" not in rows["torch"] and rows["torch"]["agrees"], rows
    assert _rel(rows["torch"]["loss_value"], rows["plain"]["loss_value"]) <= 1e-5, rows


@pytest.mark.parametrize("option", ["--chunk-mib", "--flce-chunk-mib"])
def test_a_budget_that_is_not_positive_exits_naming_the_option(option, tmp_path):
    # 0 once meant "the default" without a word (a typo'd A/B measured the default twice)
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(SCRIPT), "--tiny", option, "0", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode != 0 and f"argument {option}: must be a positive integer, not '0'" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()  # before any row


@pytest.fixture
def loss_cases(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS / "kernels"))  # its `import _plain_losses`
    yield load_benchmark("_loss_cases")
    for name in ("_loss_cases", "_plain_losses"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("loss", CE_OPTION_LOSSES)
def test_each_ce_option_reaches_polykernel_and_the_plain_loss(loss_cases, loss):
    # the same loss and gradients from both calls, and not those of the option-less loss: a call
    # that dropped its option (or a plain formula that differed from polykernel's) fails here
    cases = loss_cases
    x = cases.inputs(loss, cases.TINY, torch.device("cpu"), torch.float32)
    assert len(x.options) == 1 and loss.endswith(next(iter(x.options)))
    ours = cases.polykernel_call(loss, x, "torch")()
    plain = cases.plain_call(loss, x)()
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(ours, x.grads), torch.autograd.grad(plain, x.grads)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    logits = x.logits if loss.startswith("ce_") else x.hidden @ x.weight.T
    without = torch.nn.functional.cross_entropy(logits.detach(), x.target, ignore_index=-100)
    assert _rel(float(ours.detach()), float(without)) > 1e-4, (loss, float(ours.detach()), float(without))  # 10x the agreement's tolerance


@pytest.mark.skipif(find_spec("liger_kernel") is None, reason="needs liger_kernel")
def test_liger_ce_options_on_the_cpu_agree_and_leave_the_logits_to_the_next_rows(tmp_path):
    # Liger's kernels in Triton's interpreter (its softcap and weight paths need compiled Triton):
    # its option names map to ours, and its cross_entropy, which writes its gradient over its
    # logits, gets logits of its own, so the plain loss after it still scores the logits
    data = _run(tmp_path, "--liger-on-cpu", "--only", "ce_z_loss,ce_label_smoothing", "--impls", "torch,liger,plain")
    rows = {(r["loss"], r["impl"]): r for r in data["rows"]}
    for loss in ("ce_z_loss", "ce_label_smoothing"):
        for impl in ("liger", "plain"):
            assert "error" not in rows[loss, impl], rows[loss, impl]
            assert _rel(rows[loss, impl]["loss_value"], rows[loss, "torch"]["loss_value"]) <= 1e-5, rows[loss, impl]


# The script with each row's measurement 0.15 s longer, so that the kill lands mid-run
_SLOWED = """
import sys, time
sys.path.insert(0, sys.argv[1])
sys.argv = [sys.argv[2], *sys.argv[3:]]  # before the import: it reads --tiny
import post_training_losses as script
measure = script.measure
def slowed(*args, **kwargs):
    time.sleep(0.15)
    return measure(*args, **kwargs)
script.measure = slowed
script.main()
"""


@pytest.mark.slow  # ~15 s: two runs, one slowed
def test_a_cut_run_keeps_the_ten_losses_and_resumes_the_ce_options(tmp_path):
    out = tmp_path / "cut.json"
    args = [str(SCRIPT.parent), str(SCRIPT), "--tiny", "--impls", "torch,plain", "--json", str(out)]
    proc = subprocess.Popen([sys.executable, "-c", _SLOWED, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    rows: list[dict] = []
    try:
        deadline = time.time() + 150
        while time.time() < deadline and proc.poll() is None and not any(r["loss"].startswith("ce_") for r in rows):
            time.sleep(0.05)
            if out.exists():
                rows = read_rows(out)["rows"]
    finally:
        proc.send_signal(signal.SIGTERM)  # as `timeout` stops a step at its limit
        _, err = proc.communicate(timeout=30)
    kept = read_rows(out)
    assert kept["complete"] is False, f"the run ended before the kill:\n{err[-2000:]}"
    losses = list(dict.fromkeys(r["loss"] for r in kept["rows"]))
    assert losses[: len(TEN)] == TEN and losses[len(TEN)] == "ce_softcap", losses  # the ten first
    assert sum(r["loss"] in TEN for r in kept["rows"]) == 2 * len(TEN)  # whole: both candidates of each
    assert len(kept["rows"]) < 2 * (len(TEN) + len(CE_OPTION_LOSSES))
    assert all(r["agrees"] for r in kept["rows"]), [r for r in kept["rows"] if not r.get("agrees")]
    done = {r["loss"] for r in kept["rows"] if r["impl"] == "plain"}  # a loss's last row
    rest = [loss for loss in CE_OPTION_LOSSES if loss not in done]
    resumed = _run(tmp_path, "--only", ",".join(rest), "--impls", "torch,plain")
    assert resumed["complete"] and [r["loss"] for r in resumed["rows"]] == [loss for loss in rest for _ in range(2)]
    assert all(r["agrees"] for r in resumed["rows"])
