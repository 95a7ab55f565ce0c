"""Reliability: a hostile or careless environment (issue 27): boolean variables spelt every way,
misspelt variable names, and a ``TRITON_INTERPRET`` Triton does not read as true. Each op call
runs with the right result (with one warning), or fails with a clear error naming the variable.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import polykernel
from _tuning_helpers import isolate_tuning
from polykernel import env
from polykernel.core import registry
from polykernel.ops.rms_norm import reference

SRC = Path(polykernel.__file__).parent


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    isolate_tuning(tmp_path, monkeypatch)
    yield
    polykernel.clear_caches()


def rms_norm_runs_right(n: int = 16) -> None:
    x, w = torch.randn(3, n), torch.rand(n) + 0.5
    torch.testing.assert_close(polykernel.rms_norm(x, w), reference(x, w))


def ours(record, pattern: str) -> list[str]:
    return [str(r.message) for r in record if re.search(pattern, str(r.message))]


# -- boolean variables ------------------------------------------------------------------------------


def _planted_failure() -> None:
    @polykernel.register_impl(op="rms_norm", backend="cuda_jit", rank=1)
    def bad(x, weight, eps, offset, casting):
        raise RuntimeError("planted")


@pytest.mark.parametrize("value", ["0", "off", "no", "FALSE", "False", " Off ", ""])
def test_strict_false_values_leave_it_off(monkeypatch, value):
    monkeypatch.setenv("POLYKERNEL_STRICT", value)
    _planted_failure()
    with pytest.warns(RuntimeWarning, match="planted"):  # fell back: not strict
        rms_norm_runs_right(8)


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_strict_true_values_turn_it_on(monkeypatch, value):
    monkeypatch.setenv("POLYKERNEL_STRICT", value)
    _planted_failure()
    with pytest.raises(RuntimeError, match="planted"):
        rms_norm_runs_right(8)


@pytest.mark.parametrize("variable", env.BOOLEANS)
@pytest.mark.parametrize("value", ["garbage", "2", "enable", "x" * 10_000])
def test_other_boolean_values_are_a_clear_error(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    polykernel.clear_caches()
    with pytest.raises(ValueError, match=variable) as info:
        rms_norm_runs_right(8)
    message = str(info.value)
    assert "1, true, yes, on" in message and "0, false, no, off" in message and len(message) < 400


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("on", True), ("no", False), ("OFF", False), ("", False)])
def test_fast_launch_reads_booleans_one_way(monkeypatch, value, expected):
    from polykernel.backends.triton import _launch

    monkeypatch.setenv("POLYKERNEL_FAST_LAUNCH", value)
    assert _launch._enabled_by_env() is expected


def test_lean_apply_reads_booleans_one_way():
    code = "from polykernel.backends.triton import _autograd; print(_autograd.ENABLED)"
    for value, expected in (("no", "False"), ("Yes", "True")):
        environ = {**os.environ, "POLYKERNEL_LEAN_APPLY": value, "PYTHONPATH": str(SRC.parent)}
        out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == expected, out.stderr[-2000:]


# -- variable names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        ("POLYKERNEL_IMPL_rms_norm", "POLYKERNEL_IMPL_RMS_NORM"),
        ("POLYKERNEL_IMPL_RMSNORM", "POLYKERNEL_IMPL_RMS_NORM"),
        ("POLYKERNEL_COMPILE_swiglu", "POLYKERNEL_COMPILE_SWIGLU"),
        ("POLYKERNEL_TUNNE", "POLYKERNEL_TUNE"),
        ("polykernel_strict", "POLYKERNEL_STRICT"),
    ],
)
def test_misspelt_variables_warn_once_naming_the_closest(monkeypatch, name, closest):
    monkeypatch.setenv(name, "torch")
    polykernel.clear_caches()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for n in (16, 24):
            rms_norm_runs_right(n)
    (message,) = ours(record, re.escape(name))
    assert f"did you mean {closest}?" in message
    polykernel.clear_caches()  # decisions are made afresh: checked again
    with pytest.warns(RuntimeWarning, match=re.escape(name)):
        rms_norm_runs_right(16)


def test_per_op_variable_of_no_op_lists_the_valid_names(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_IMPL_NOT_AN_OP", "torch")
    with pytest.warns(RuntimeWarning, match="POLYKERNEL_IMPL_NOT_AN_OP names no op") as record:
        rms_norm_runs_right(16)
    assert "POLYKERNEL_IMPL_RMS_NORM" in ours(record, "NOT_AN_OP")[0]


def test_unknown_variable_lists_the_known_ones(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_SOMETHING_ELSE", "1")
    with pytest.warns(RuntimeWarning, match="POLYKERNEL_SOMETHING_ELSE is not a polykernel variable") as record:
        rms_norm_runs_right(16)
    message = ours(record, "SOMETHING_ELSE")[0]
    assert all(name in message for name in env.KNOWN) and "POLYKERNEL_IMPL_<OP>" in message


@pytest.mark.parametrize("name", ["POLYKERNEL_IMPL_rms_norm", "POLYKERNEL_IMPL_NOT_AN_OP", "POLYKERNEL_TUNNE"])
def test_misspelt_variables_are_an_error_under_strict(monkeypatch, name):
    monkeypatch.setenv(name, "torch")
    monkeypatch.setenv("POLYKERNEL_STRICT", "1")
    with pytest.raises(ValueError, match=re.escape(name)):
        rms_norm_runs_right(16)


def test_valid_names_do_not_warn(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_IMPL_RMS_NORM", "torch")
    monkeypatch.setenv("POLYKERNEL_COMPILE_SWIGLU", "ours")
    monkeypatch.setenv("POLYKERNEL_TUNE", "cached")
    monkeypatch.setenv("POLYKERNEL_STRICT", "1")  # a problem would be an error
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rms_norm_runs_right(16)
    assert not ours(record, "POLYKERNEL_")


def test_every_variable_the_code_reads_is_known():
    ops = {op_id.rpartition(".")[2].upper() for op_id in registry.all_op_ids()}
    found = set()
    for path in SRC.rglob("*.py"):
        found |= set(re.findall(r"POLYKERNEL_[A-Z0-9_]*", path.read_text(encoding="utf-8")))
    for name in sorted(found):
        if name == "POLYKERNEL_" or name in env.KNOWN or name in env.PER_OP:
            continue
        assert any(name.startswith(p) and name[len(p) :] in ops for p in env.PER_OP), f"{name} is read but not in polykernel.env.KNOWN"
    assert found >= set(env.KNOWN) - {"POLYKERNEL_HYPOTHESIS_EXAMPLES"}  # the test suite's own, in tests/


# -- TRITON_INTERPRET -------------------------------------------------------------------------------


def test_triton_interpret_garbage_is_unset_with_one_warning(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "garbage")
    polykernel.clear_caches()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert "triton" not in polykernel.available_impls("rms_norm", device="cpu")  # compiled Triton cannot run on the CPU
        for n in (16, 24):
            rms_norm_runs_right(n)
    assert len(ours(record, "TRITON_INTERPRET='garbage'")) == 1
    assert [d["impl"] for d in polykernel.decisions("rms_norm")] == ["torch", "torch"]
    assert not any("failed at run time" in str(r.message) for r in record)


@pytest.mark.parametrize("value", ["1", "true", "True", "on", "YES", "y", "0", "off", "no", "n", "", " 1", "2", "garbage"])
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value):
    libtriton = pytest.importorskip("triton._C.libtriton")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert env.triton_interpret() is bool(libtriton.getenv_bool("TRITON_INTERPRET", False))
