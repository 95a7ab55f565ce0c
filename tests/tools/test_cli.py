"""The command line: every command runs, answers --json, and fails clearly."""

import itertools
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
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if "norm.rms_norm " in ln)
    row = [lines[first], *itertools.takewhile(lambda ln: ln[:1] == " " and ln.strip(), lines[first + 1 :])]  # wrapped cells
    assert "torch" in " ".join(row) and "needs a CUDA device" in row[0]
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


# ------------------------------------------------------------------------------------------------
# check: an impl that cannot run here, or a name the op lacks, is one line, not a FAIL per case


def test_check_an_impl_that_cannot_run_here_is_one_line():
    # CPU tensors: cute_dsl needs a CUDA device whatever is installed
    rc, text = _run(["check", "rms_norm", "--device", "cpu", "--dtype", "float32", "--impl", "cute_dsl"], False)
    assert rc == 1
    assert "FAIL" not in text and "inf" not in text
    (line,) = [ln for ln in text.splitlines() if "not available here" in ln]
    assert line.startswith("norm.rms_norm: impl 'cute_dsl' is not available here: needs a CUDA device")
    assert text.rstrip().splitlines()[-1].startswith("0 passed, 0 failed, ")


def test_check_triton_without_the_interpreter_on_a_cpu_is_not_available():
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "polykernel", "check", "rms_norm", "--impl", "triton", "--device", "cpu", "--dtype", "float32"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": SRC},
    )
    assert out.returncode == 1, out.stderr
    assert "FAIL" not in out.stdout
    assert "norm.rms_norm: impl 'triton' is not available here: needs a CUDA device" in out.stdout


def test_check_an_unknown_impl_is_one_line_listing_the_impls(capsys):
    from polykernel.core import registry

    assert main(["check", "rms_norm", "--device", "cpu", "--impl", "tritonn"]) == 2
    captured = capsys.readouterr()
    assert "FAIL" not in captured.out
    assert captured.err.strip() == (
        f"polykernel check: norm.rms_norm has no impl 'tritonn'; its impls are: {', '.join(sorted(registry.specs_for('rms_norm')))}"
    )
    assert main(["check", "--device", "cpu", "--impl", "tritonn"]) == 2  # no op given: no op has it
    assert "no op has an impl 'tritonn'; the ops' impls are: " in capsys.readouterr().err


def test_check_skips_the_ops_that_lack_a_named_impl(monkeypatch):
    from polykernel import testing
    from polykernel.core import registry

    asked = []
    monkeypatch.setattr(testing, "check_parity", lambda op, impls, **k: asked.append((op, impls)) or [])
    rc, _ = _run(["check", "--device", "cpu", "--impl", "quack"], False)
    assert rc == 0
    assert asked == [(op, ["quack"]) for op in polykernel_ops() if "quack" in registry.specs_for(op)]


def polykernel_ops():
    import polykernel

    return polykernel.list_ops()


# ------------------------------------------------------------------------------------------------
# explain: --shape in the op's layout, --grad without a shape, a CUDA device that is not here


@pytest.mark.parametrize("op", ["fused_linear_dpo_loss", "fused_linear_grpo_loss"])
def test_explain_a_loss_with_its_own_layout(op, capsys):
    assert main(["explain", op, "--device", "cpu", "--shape", "4x8x64x128", "--grad"]) == 0
    assert "needs_grad=True" in capsys.readouterr().out


@pytest.mark.parametrize("op", ["fused_linear_dpo_loss", "fused_linear_grpo_loss"])
def test_explain_a_shape_that_does_not_fit_names_the_layout(op, capsys):
    assert main(["explain", op, "--device", "cpu", "--shape", "8x64", "--grad"]) == 2
    err = capsys.readouterr().err
    assert "--shape 8x64 does not fit" in err and "T, H, V)" in err and "Traceback" not in err


def test_explain_grad_without_a_shape(capsys):
    assert main(["explain", "rms_norm", "--device", "cpu", "--grad"]) == 0
    assert "needs_grad=True" in capsys.readouterr().out
    assert main(["explain", "rms_norm", "--device", "cpu"]) == 0
    assert "needs_grad=False" in capsys.readouterr().out


def test_explain_needs_grad_with_arguments_is_an_error():
    import torch

    import polykernel

    with pytest.raises(ValueError, match="needs_grad"):
        polykernel.explain("rms_norm", torch.randn(2, 8), torch.ones(8), needs_grad=True)


@pytest.mark.parametrize("command", ["explain rms_norm", "list", "check swiglu --impl torch"])
def test_a_cuda_device_that_is_not_here_is_an_error(command, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    assert main([*command.split(), "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_env_lists_every_optional_package_and_the_native_path(capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"trl", "flashinfer", "sgl_kernel", "transformers", "liger_kernel"} <= info.keys()
    assert info["native launch path"].startswith(("built", "not built", "unavailable"))


def test_env_shows_why_a_package_fails_to_import(capsys, monkeypatch, tmp_path):
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["env", "--json"]) == 0
    assert "import fails: OSError: libcuda.so.1" in json.loads(capsys.readouterr().out)["flashinfer"]


def test_check_names_the_impls_it_checked_and_the_error_units(capsys):
    rc, text = _run(["check", "swiglu", "--device", "cpu", "--dtype", "float32", "--impl", "torch", "-v"], False)
    assert rc == 0 and "checked: torch (1 op, " in text
    assert "err/tol" in text and "<= 1 passes" in text
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    assert "atol + rtol" in capsys.readouterr().out


def _subparsers():
    """(command, parser) for every command, demo's own parser included."""
    import argparse

    from polykernel.tools import demo
    from polykernel.tools.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(name, demo.build_parser() if name == "demo" else parser) for name, parser in sub.choices.items()]


def test_every_option_has_help_and_is_in_the_cli_doc():
    import argparse

    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    for name, parser in _subparsers():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            label = "/".join(action.option_strings) or action.dest
            assert action.help, f"polykernel {name} {label}: no help text in --help"
            long = [o for o in action.option_strings if o.startswith("--")]
            assert not long or f"{long[0]}" in doc.split(f"polykernel {name}", 1)[1], f"docs/cli.md: polykernel {name} lacks {long[0]}"


def test_load_of_a_missing_or_broken_file_is_one_line(capsys, tmp_path):
    missing = tmp_path / "nope.json"
    assert main(["bench", "--load", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"polykernel bench: --load {missing}: No such file or directory"
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert main(["bench", "--load", str(broken)]) == 2
    assert f"polykernel bench: --load {broken}: not a results file" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"polykernel demo: --load .*nope\.json: No such file or directory"):
        main(["demo", "--load", str(missing), "--plot", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match=r"--load reads a saved result to plot it: add --plot"):  # else it did nothing
        main(["demo", "--load", str(broken)])


def test_bench_dtype_is_checked_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "rms_norm", "--dtype", "bfloat"])
    assert "invalid choice: 'bfloat'" in capsys.readouterr().err
