"""The command line on bad input: one line naming the option and the problem, a non-zero exit,
no traceback, nothing measured or written first (and a run cut by Ctrl-C says what it kept)."""

from __future__ import annotations

import json

import pytest
import torch

from polykernel.tools import bench
from polykernel.tools.cli import main
from polykernel.tools.rows import read_rows


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------------------------------------
# --device: a name torch does not know, or a device this machine does not have


_COMMANDS = [
    ["list"],
    ["explain", "rms_norm"],
    ["check", "swiglu", "--impl", "torch", "--dtype", "float32"],
    ["tune", "rms_norm", "--shapes", "4x8", "--dtype", "float32"],
]


@pytest.mark.parametrize("device", ["foo", "mps", "cuda", "cuda:1"])
@pytest.mark.parametrize("argv", _COMMANDS, ids=lambda a: a[0])
def test_a_device_that_is_not_here_is_one_line(argv, device, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU machine
    assert main([*argv, "--device", device]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"polykernel {argv[0]}: --device {device}: "), line


@pytest.mark.parametrize("device", ["foo", "mps"])
def test_demo_a_device_that_is_not_here_is_one_line(device):
    with pytest.raises(SystemExit, match=f"polykernel demo: --device {device}: "):
        main(["demo", "--device", device, "--steps", "1"])


# ------------------------------------------------------------------------------------------------
# sizes and counts


@pytest.mark.parametrize("shape", ["4x", "4x0", "0x0", "4x64x", "x4"])
def test_explain_shape_needs_positive_sizes(shape, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["explain", "rms_norm", "--device", "cpu", "--shape", shape])
    assert exc.value.code == 2
    assert f"argument --shape: --shape {shape!r}" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--steps", "--batch", "--seq-len", "--threads"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_demo_counts_must_be_positive(option, value, capsys, monkeypatch):
    from polykernel.tools.demo import command

    monkeypatch.setattr(command, "run_demo", lambda **k: pytest.fail("trained"))
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--device", "cpu", option, value])
    assert exc.value.code == 2
    assert f"argument {option}: must be a positive integer, not {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_demo_lr_must_be_positive(value, capsys, monkeypatch):
    from polykernel.tools.demo import command

    monkeypatch.setattr(command, "run_demo", lambda **k: pytest.fail("trained"))
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--device", "cpu", "--lr", value])
    assert exc.value.code == 2
    assert f"argument --lr: must be a positive number, not {value!r}" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# explain, check, tune: names and layouts


def test_explain_an_impl_the_op_lacks_is_one_line(capsys):
    assert main(["explain", "rms_norm", "--device", "cpu", "--impl", "tritonn"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("polykernel explain: --impl 'tritonn': norm.rms_norm has no such impl; its impls are: ")
    assert "triton" in line


def test_check_a_dtype_the_op_is_not_declared_for_is_one_line(capsys):
    # float64 is no op's dtype: its parity cases and tolerances are not defined (false FAILs before)
    assert main(["check", "dynamic_quant_fp8", "--device", "cpu", "--impl", "torch", "--dtype", "float64"]) == 2
    captured = capsys.readouterr()
    assert "FAIL" not in captured.out
    assert _one_line(captured.err) == (
        "polykernel check: --dtype float64: serving.dynamic_quant_fp8 is checked in float32, bfloat16, float16"
    )
    assert main(["check", "--device", "cpu", "--impl", "torch", "--dtype", "float64"]) == 2
    assert _one_line(capsys.readouterr().err) == "polykernel check: --dtype float64: no op is checked in float64"


def test_tune_a_shape_that_does_not_fit_names_the_layout(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", str(tmp_path))
    assert main(["tune", "rope", "--device", "cpu", "--shapes", "4x8", "--dtype", "float32"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("polykernel tune: --shapes 4x8 does not fit embedding.rope's example inputs"), line


def test_tune_that_measured_nothing_fails(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("POLYKERNEL_IMPL", "torch")  # every call is forced: nothing to measure
    assert main(["tune", "rms_norm", "--device", "cpu", "--shapes", "4x8", "--dtype", "float32"]) == 1
    err = capsys.readouterr().err
    assert "norm.rms_norm 4x8: not measured" in err and "polykernel tune: nothing was measured" in err


def _stored_keys(tmp_path) -> list[dict]:
    paths = list(tmp_path.glob("tuning-*.json"))
    return [json.loads(k) for path in paths for k in json.loads(path.read_text())["entries"]]


def _cut_at(monkeypatch, shape, then=lambda: None):
    """polykernel.rms_norm raising KeyboardInterrupt on ``shape`` (after ``then()``)."""
    import polykernel

    real = polykernel.rms_norm

    def rms_norm(x, *args, **kwargs):
        if tuple(x.shape) == shape:
            then()
            raise KeyboardInterrupt
        return real(x, *args, **kwargs)

    monkeypatch.setattr(polykernel, "rms_norm", rms_norm)


def test_tune_keeps_each_case_as_measured_and_an_interrupted_run_says_so(capsys, monkeypatch, tmp_path):
    # The second case is cut (Ctrl-C, or SIGTERM at a time limit): the first case's decision is
    # already in the store file when it starts, and Ctrl-C says how many decisions are there.
    import polykernel

    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", str(tmp_path))
    seen_on_disk: list[dict] = []
    _cut_at(monkeypatch, (16, 64), then=lambda: seen_on_disk.extend(_stored_keys(tmp_path)))
    try:
        assert main(["tune", "rms_norm", "--device", "cpu", "--shapes", "8x32,16x64", "--dtype", "float32"]) == 130
    finally:
        polykernel.clear_caches()
    assert [k["tensors"] for k in seen_on_disk] == [["float32[8x32]", "float32[32]"]]
    assert [k["tensors"] for k in _stored_keys(tmp_path)] == [["float32[8x32]", "float32[32]"]]
    (path,) = tmp_path.glob("tuning-*.json")
    assert _one_line(capsys.readouterr().err) == f"polykernel tune: interrupted; 1 decision stored in {path}"


def test_tune_under_torchrun_stores_at_the_end_and_a_cut_run_says_it_stored_nothing(capsys, monkeypatch, tmp_path):
    # The ranks' times are gathered once at the end (collectives in lockstep): nothing per case.
    import polykernel
    from polykernel.tools import tune_cmd

    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune_cmd, "_init_distributed", lambda: (object(), False))  # cut before any collective
    _cut_at(monkeypatch, (16, 64))
    try:
        assert main(["tune", "rms_norm", "--device", "cpu", "--shapes", "8x32,16x64", "--dtype", "float32"]) == 130
    finally:
        polykernel.clear_caches()
    assert _stored_keys(tmp_path) == []
    assert _one_line(capsys.readouterr().err) == (
        "polykernel tune: interrupted; no decision stored (under torchrun they are stored at the end of the run)"
    )


# ------------------------------------------------------------------------------------------------
# bench --load: what a results file must hold, and the options that do not apply to it


def _row(**extra):
    return {"op": "rms_norm", "shape": "4x8", "mode": "fwd", "impl": "polykernel", "ms": 1.0, **extra}


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ({"device": "x"}, "no 'rows' list"),
        ({"rows": []}, "no rows"),
        ({"rows": [{"op": "rms_norm"}]}, "row 0 lacks 'shape'"),
        ({"rows": [1]}, "row 0 is not an object"),
    ],
)
def test_bench_load_of_a_file_that_is_not_bench_rows_is_one_line(content, why, capsys, tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(content))
    assert main(["bench", "--load", str(path)]) == 2
    assert _one_line(capsys.readouterr().err) == f"polykernel bench: --load {path}: not a bench results file ({why})"


def test_bench_load_of_an_older_file_without_the_newer_columns(capsys, tmp_path):
    # the files of the first runs (benchmarks/results/h200-2026-11-29*.json) have no chosen, host_us, size
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "rows": [_row(error="", peak_extra_MiB=0.0, **{"GB/s": 1.0})]}))
    assert main(["bench", "--load", str(path)]) == 0
    assert "rms_norm" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["rms_norm"], ["--ops", "rms_norm"], ["--sweep"], ["--graph"], ["--no-compile"], ["--dtype", "float32"]])
def test_bench_load_with_an_option_that_measures_is_an_error(extra, capsys, tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": [_row()]}))
    assert main(["bench", "--load", str(path), *extra]) == 2
    line = _one_line(capsys.readouterr().err)
    name = "OP" if extra == ["rms_norm"] else extra[0]
    assert line == f"polykernel bench: --load reads saved rows; {name} applies to a measuring run only", line


def _fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Test")


def test_bench_an_out_dir_that_cannot_be_written_is_one_line_before_measuring(capsys, monkeypatch, tmp_path):
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("measured"))
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "sub"
    assert main(["bench", "rms_norm", "--out", str(out)]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"polykernel bench: --out {out}: cannot write there (")


def test_bench_a_plot_file_that_cannot_be_written_is_one_line_before_measuring(capsys, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("measured"))
    png = tmp_path / "missing" / "x.png"
    assert main(["bench", "rms_norm", "--out", str(tmp_path), "--plot", str(png)]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"polykernel bench: --plot {png}: cannot write there (")


def test_bench_interrupted_keeps_its_rows_and_says_so(capsys, monkeypatch, tmp_path):
    _fake_gpu(monkeypatch)

    def cut(ops, use_compile, dtype, graph, sweep, con, out):
        out.add(_row())
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run", cut)
    assert main(["bench", "rms_norm", "--out", str(tmp_path), "--no-compile"]) == 130
    (path,) = tmp_path.glob("*-call.json")
    kept = read_rows(path)
    assert kept["complete"] is False and len(kept["rows"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"polykernel bench: interrupted; 1 row kept in {path} (complete: false)"


# ------------------------------------------------------------------------------------------------
# demo: output files checked before training, --load's file and options


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_demo_an_output_file_that_cannot_be_written_is_one_line_before_training(option, monkeypatch, tmp_path):
    if option == "--plot":
        pytest.importorskip("matplotlib")
    from polykernel.tools.demo import command

    monkeypatch.setattr(command, "run_demo", lambda **k: pytest.fail("trained"))
    path = tmp_path / "missing" / "x.out"
    with pytest.raises(SystemExit, match=f"polykernel demo: {option} {path}: cannot write there"):
        main(["demo", "--device", "cpu", option, str(path)])


def test_demo_load_of_a_file_that_is_not_a_demo_result_is_one_line(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match=r"^polykernel demo: --load .*r\.json: not a demo result \(no 'runs' list\)$"):
        main(["demo", "--load", str(path), "--plot", str(tmp_path / "x.png")])


def test_demo_load_with_a_training_option_is_an_error(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("{}")
    with pytest.raises(SystemExit, match=r"^polykernel demo: --load reads a saved result; --steps applies to training only$"):
        main(["demo", "--load", str(path), "--plot", str(tmp_path / "x.png"), "--steps", "5"])
