"""The command line: every command runs, answers --json, and fails clearly."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polykernel.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_list_json(capsys):
    assert main(["list", "--device", "cpu", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["op"] for r in rows} >= {"norm.rms_norm", "loss.fused_linear_cross_entropy"}
    assert all(any(i["name"] == "torch" and i["runnable"] for i in r["impls"]) for r in rows)


def test_explain_with_shape(capsys):
    assert main(["explain", "rms_norm", "--device", "cpu", "--dtype", "float32", "--shape", "4x64", "--grad", "--impl", "torch"]) == 0
    out = capsys.readouterr().out
    assert "chosen: torch (source: argument)" in out and "needs_grad=True" in out and "n=64" in out


def test_explain_errors_are_one_line(capsys):
    assert main(["explain", "rmsnorm"]) == 2
    assert "unknown op 'rmsnorm'" in capsys.readouterr().err
    assert main(["explain", "rms_norm", "--device", "cpu", "--impl", "quack"]) == 1  # not registered: reported, no crash


def test_check_runs_parity(capsys):
    assert main(["check", "swiglu", "--device", "cpu", "--dtype", "float32", "--impl", "torch"]) == 0
    assert "0 failed" in capsys.readouterr().out


def test_bench_needs_a_gpu(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert main(["bench", "rms_norm"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_env_and_module_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "polykernel", "env", "--json"], capture_output=True, text=True, env={"PYTHONPATH": SRC, "PATH": ""}
    )
    assert out.returncode == 0, out.stderr
    assert "torch" in json.loads(out.stdout)
