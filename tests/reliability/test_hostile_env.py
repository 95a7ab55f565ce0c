"""Reliability: a hostile or careless environment (issue 27). A cache directory that cannot be
resolved, a store that is a FIFO, a device or huge, a lock held by another process, boolean
variables spelt every way, misspelt variable names, and a ``TRITON_INTERPRET`` Triton does not
read as true. Each op call runs with the right result (with one warning), or fails with a clear
error naming the variable: it never raises elsewhere, hangs or waits long.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import polykernel
from _tuning_helpers import isolate_tuning, only, plant, use_fake_clock
from polykernel import env, tuning
from polykernel.core import registry
from polykernel.ops.rms_norm import reference
from polykernel.tuning import json_store
from polykernel.tuning import key as tuning_key
from polykernel.tuning.json_store import Store

SRC = Path(polykernel.__file__).parent
IDENT = {"schema": 1, "test": "hostile-env"}
ENTRY = {"eager": "torch", "graph": "torch", "times": {}}


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


def store_path() -> Path:
    st = tuning.store()
    st.put({"warm": ENTRY})
    polykernel.clear_caches()
    return st.path


# -- the cache directory ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["~nosuchuser-polykernel/x", "~nosuchuser-polykernel"])
def test_cache_dir_that_cannot_be_resolved_degrades_to_memory(monkeypatch, value):
    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", value)
    polykernel.clear_caches()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for n in (16, 24, 32):  # every op call runs, and one warning says why nothing is stored
            rms_norm_runs_right(n)
        tuning.store().put({"k": ENTRY})
    assert len(ours(record, "POLYKERNEL_CACHE_DIR")) == 1
    assert tuning.store().path is None and tuning.store().get("k") == ENTRY


def test_no_home_directory_degrades_to_memory(monkeypatch):
    import platformdirs

    def no_home(*args, **kwargs):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("POLYKERNEL_CACHE_DIR")
    monkeypatch.setattr(platformdirs, "user_cache_dir", no_home)
    monkeypatch.setattr(Path, "home", no_home)
    with pytest.warns(RuntimeWarning, match="in memory only"):
        assert json_store.cache_dir() is None


# -- store files that are not regular files, or too large -----------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_store_that_is_a_fifo_is_never_opened(monkeypatch):
    path = store_path()
    path.unlink()
    os.mkfifo(path)
    done, unblocked = threading.Event(), threading.Event()

    def watchdog():  # before the fix the call blocks in open(): a writer lets it go, and the test fails
        if not done.wait(20):
            unblocked.set()
            os.close(os.open(path, os.O_WRONLY))

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            rms_norm_runs_right(16)
            rms_norm_runs_right(24)
    finally:
        done.set()
    assert not unblocked.is_set(), "the op call blocked opening the FIFO"
    assert len(ours(record, "not a regular file")) == 1


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_store_symlinked_to_dev_zero_is_refused_once(monkeypatch):
    path = store_path()
    path.unlink()
    path.symlink_to("/dev/zero")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for n in (16, 24, 32):  # three argument classes: each looks the store up
            rms_norm_runs_right(n)
    assert len(ours(record, "not a regular file")) == 1


def test_store_larger_than_the_cap_is_refused_unread(monkeypatch, tmp_path):
    st = Store(tmp_path, IDENT)
    with open(st.path, "wb") as f:  # sparse: no disk, no memory
        f.truncate(json_store.MAX_FILE_BYTES + 1)
    with pytest.warns(RuntimeWarning, match="larger than 64 MiB") as record:
        assert st.get("k") is None and st.empty()
    assert len(record) == 1
    st.put({"k": ENTRY})  # replaced by a valid store
    assert Store(tmp_path, IDENT).get("k") == ENTRY


def test_store_is_read_once_per_process(monkeypatch):
    store_path()
    reads = []
    real = json_store._read_regular
    monkeypatch.setattr(json_store, "_read_regular", lambda p: reads.append(p) or real(p))
    for n in (16, 24, 32):
        rms_norm_runs_right(n)
    assert len(reads) == 1
    polykernel.clear_caches()  # an explicit change: read again
    rms_norm_runs_right(16)
    assert len(reads) == 2


# -- the store's lock, held by another process --------------------------------------------------------

_HOLD = "import sys, filelock; l = filelock.FileLock(sys.argv[1]); l.acquire(); print('held', flush=True); sys.stdin.read()"


@contextmanager
def lock_held_elsewhere(lock: str):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield
    finally:
        proc.stdin.close()  # the holder exits, releasing the lock
        proc.wait(30)


def test_writer_waits_a_short_bounded_time_then_keeps_entries_until_the_lock_frees(monkeypatch, tmp_path):
    assert json_store.LOCK_TIMEOUT_S <= 2.0  # an op call under POLYKERNEL_TUNE=on waits this long at most
    monkeypatch.setattr(json_store, "LOCK_TIMEOUT_S", 0.2)
    st = Store(tmp_path, IDENT)
    st.put({"before": ENTRY})
    waits = []
    import filelock

    real_acquire = filelock.BaseFileLock.acquire

    def acquire(self, timeout=None, *args, **kwargs):
        waits.append(self.timeout if timeout is None else timeout)
        return real_acquire(self, timeout, *args, **kwargs)

    monkeypatch.setattr(filelock.BaseFileLock, "acquire", acquire)
    with lock_held_elsewhere(str(st.path) + ".lock"):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            st.put({"a": ENTRY})
            st.put({"b": ENTRY})
        assert len(ours(record, "locked by another process")) == 1
        assert waits[-2:] == [0.2, 0.0]  # after one timeout, puts only try the lock
        assert st.get("a") == ENTRY and st.get("b") == ENTRY  # kept in memory
        assert set(Store(tmp_path, IDENT).entries()) == {"before"}  # readers take no lock
    st.put({"c": ENTRY})  # the lock is free: everything kept in memory is written
    assert set(Store(tmp_path, IDENT).entries()) == {"before", "a", "b", "c"}
    assert st.path is not None


def test_op_call_tuning_on_with_the_lock_held_runs_and_warns(monkeypatch):
    monkeypatch.setattr(json_store, "LOCK_TIMEOUT_S", 0.2)
    use_fake_clock(monkeypatch)
    path = store_path()
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    plant("cuda_jit", 1, delay=0.004)
    plant("cute_dsl", 2)
    only("cuda_jit", "cute_dsl")
    x, w = torch.randn(4, 8), torch.ones(8)
    with lock_held_elsewhere(str(path) + ".lock"):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            torch.testing.assert_close(polykernel.rms_norm(x, w), reference(x, w))
    assert len(ours(record, "locked by another process")) == 1
    d = polykernel.decisions("rms_norm")[-1]
    assert (d["impl"], d["source"]) == ("cute_dsl", "tuned")  # the decision is kept in memory


def test_readers_never_take_the_lock(monkeypatch):
    import filelock

    path = store_path()
    op = registry.get_op("rms_norm")
    x, w = torch.randn(4, 8), torch.ones(8)
    key = tuning_key.key(op, op.key(x, w), [x, w])
    Store(path.parent, tuning_key.identity()).put({key: ENTRY})
    polykernel.clear_caches()

    def no_lock(*args, **kwargs):
        raise AssertionError("a reader took the store's lock")

    monkeypatch.setattr(filelock, "FileLock", no_lock)
    polykernel.rms_norm(x, w)
    assert polykernel.decisions("rms_norm")[-1]["source"] == "tuned"


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
