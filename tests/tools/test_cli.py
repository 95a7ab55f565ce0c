"""The command line: every command runs, answers --json, and fails clearly."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polykernel.tools.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")


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


# ------------------------------------------------------------------------------------------------
# Terminal and plain output (rich): the same tables, styled on a terminal, plain text otherwise


def _run(argv, terminal):
    import io

    from polykernel.tools.console import make_console

    buf = io.StringIO()
    rc = main(argv, console=make_console(buf, force_terminal=terminal, width=300))
    return rc, buf.getvalue()


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "plain"])
def test_list_table(terminal):
    rc, text = _run(["list", "--device", "cpu"], terminal)
    assert rc == 0
    assert ("\x1b[" in text) is terminal  # styles only on a terminal
    line = next(ln for ln in text.splitlines() if "norm.rms_norm " in ln)
    assert "torch" in line and "needs a CUDA device" in line
    if not terminal:
        assert not any(c in text for c in "│─━┃")  # no box drawing in plain text
        assert "-----" in text.splitlines()[2]  # the header is underlined with dashes


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "plain"])
def test_explain_table(terminal):
    rc, text = _run(["explain", "rms_norm", "--device", "cpu", "--dtype", "float32", "--shape", "4x64", "--impl", "torch"], terminal)
    assert rc == 0
    assert "chosen: torch (source: argument)" in text and "weight_shape=Size([64])" in text  # brackets printed as they are
    row = next(ln for ln in text.splitlines() if " torch " in ln and " 100 " in ln)
    assert row.lstrip().startswith("*") and "runnable" in row


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "plain"])
def test_env_table(terminal):
    rc, text = _run(["env"], terminal)
    assert rc == 0 and "polykernel env" in text
    assert any(ln.split()[:1] == ["torch"] for ln in text.splitlines())


def test_check_verbose_table(monkeypatch):
    rc, text = _run(["check", "swiglu", "--device", "cpu", "--dtype", "float32", "--impl", "torch", "-v"], False)
    assert rc == 0 and text.rstrip().endswith("0 failed")
    assert any(ln.startswith("ok") and "activation.swiglu" in ln and "torch" in ln for ln in text.splitlines())


def test_check_reports_a_failure_in_the_table(monkeypatch):
    from polykernel import testing

    bad = testing.ParityResult("activation.swiglu", "torch", "4x8", "float32", False, 3.5, 0.0, "off by a lot")
    monkeypatch.setattr(testing, "check_parity", lambda *a, **k: [bad])
    rc, text = _run(["check", "swiglu", "--device", "cpu"], False)
    assert rc == 1
    line = next(ln for ln in text.splitlines() if ln.startswith("FAIL"))
    assert "3.5" in line and "off by a lot" in line and "0 passed, 1 failed" in text


def test_json_output_is_exact_json(capsys):
    # --json output never goes through rich: parseable as is, even when a console is given
    import io

    from polykernel.tools.console import make_console

    con = make_console(io.StringIO(), force_terminal=True)
    assert main(["explain", "rms_norm", "--device", "cpu", "--json"], console=con) == 0
    assert json.loads(capsys.readouterr().out)["op"] == "norm.rms_norm"
