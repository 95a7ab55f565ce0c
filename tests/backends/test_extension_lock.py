"""The build lock around torch's C++ extension loads (backends/_extension_lock.py): a build that a
process left unfinished (its torch ``lock`` file still there) no longer blocks later loads, once
the compilers it left running end; a live process's build is waited for (logged, never broken);
for the native launch path and cuda_jit.

torch's loader waits while ``<build_directory>/lock`` exists, forever; the fakes here take torch's
real FileBaton and fail at once where the real loader would hang. Nothing compiles.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from polykernel.backends import _extension_lock
from polykernel.backends.cuda_jit import _build
from polykernel.backends.triton import _native


def _baton_load(seen: list[dict]):
    """A stand-in for cpp_extension.load/load_inline: takes torch's baton the way the real loader
    does, but raises where the real one would wait for it forever."""

    def load(**kw):
        baton = FileBaton(os.path.join(kw["build_directory"], "lock"))
        if not baton.try_acquire():
            raise RuntimeError(f"torch's build baton is held: the real loader would wait forever ({baton.lock_file_path})")
        try:
            seen.append(kw)
            return SimpleNamespace(name=kw["name"])
        finally:
            baton.release()

    return load


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", str(tmp_path))
    return tmp_path


def _stale_baton(build_directory: Path) -> Path:
    build_directory.mkdir(parents=True, exist_ok=True)
    baton = build_directory / "lock"
    baton.touch()  # what a process killed inside cpp_extension.load leaves
    return baton


def test_native_build_removes_a_stale_baton(cache, monkeypatch, caplog):
    seen: list[dict] = []
    monkeypatch.setattr(cpp_extension, "load", _baton_load(seen))
    baton = _stale_baton(_native.build_dir())
    with caplog.at_level("WARNING", logger="polykernel"):
        mod = _native.build()
    assert mod.name == "polykernel_native" and len(seen) == 1
    assert seen[0]["build_directory"] == str(_native.build_dir()) and _native.build_dir().parent == cache / "native"
    assert not baton.exists()
    msgs = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
    assert len(msgs) == 1 and "native launch path" in msgs[0] and str(baton) in msgs[0]


def test_cuda_jit_build_removes_a_stale_baton(cache, monkeypatch, caplog):
    seen: list[dict] = []
    monkeypatch.setattr(cpp_extension, "load_inline", _baton_load(seen))
    baton = _stale_baton(_build.build_dir())
    with caplog.at_level("WARNING", logger="polykernel"):
        mod = _build.build()
    assert mod.name == "polykernel_cuda_jit" and len(seen) == 1
    assert seen[0]["build_directory"] == str(_build.build_dir()) and _build.build_dir().parent == cache / "cuda_jit"
    assert not baton.exists()
    msgs = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
    assert len(msgs) == 1 and "cuda_jit" in msgs[0]


def test_a_clean_build_logs_nothing(cache, monkeypatch, caplog):
    seen: list[dict] = []
    monkeypatch.setattr(cpp_extension, "load", _baton_load(seen))
    with caplog.at_level("INFO", logger="polykernel"):
        _native.build()
        _native.build()  # a second load of the same directory: no baton left behind
    assert len(seen) == 2 and not (_native.build_dir() / "lock").exists()
    assert not [r for r in caplog.records if r.name == "polykernel"]


# -- the lock itself -----------------------------------------------------------------------------

_HOLDER = """
import pathlib, sys, time
import filelock
lock = filelock.FileLock(sys.argv[1])
lock.acquire()
pathlib.Path(sys.argv[2]).touch()
time.sleep(60)
"""


def _hold_in_another_process(build_directory: Path, tmp_path: Path) -> subprocess.Popen:
    """A live process holding the build lock (as one inside its build would), once it says so."""
    ready = tmp_path / "holder-ready"
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(build_directory / _extension_lock.LOCK_NAME), str(ready)])
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the lock holder did not start (exit code {proc.poll()})")
        time.sleep(0.02)
    return proc


def test_a_live_build_is_waited_for_and_a_dead_ones_lock_is_not(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(_extension_lock, "WAIT_LOG_AFTER_S", 0.2)
    out = tmp_path / "build"
    baton = _stale_baton(out)  # the live holder's own, inside its torch load
    holder = _hold_in_another_process(out, tmp_path)
    try:
        with caplog.at_level("WARNING", logger="polykernel"):
            with pytest.raises(TimeoutError, match="the test build"), _extension_lock.build_lock(out, "the test build", timeout=0.6):
                pytest.fail("entered while another live process holds the lock")
        assert baton.exists()  # waited for, not broken
        waits = [r.getMessage() for r in caplog.records if "waiting for another process" in r.getMessage()]
        assert len(waits) == 1 and "the test build" in waits[0] and str(out) in waits[0]
        assert not [r for r in caplog.records if "stale" in r.getMessage()]
    finally:
        holder.kill()  # dies holding the lock, its baton left behind: the OS releases the lock
        holder.wait()
    caplog.clear()
    with caplog.at_level("WARNING", logger="polykernel"), _extension_lock.build_lock(out, "the test build", timeout=5) as held:
        assert held == out and not baton.exists()
    stale = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
    assert len(stale) == 1 and "interrupted build of the test build" in stale[0]
    assert not [r for r in caplog.records if "waiting" in r.getMessage()]


def test_the_lock_is_released_when_the_build_fails(tmp_path):
    import filelock

    out = tmp_path / "build"
    with pytest.raises(RuntimeError, match="compiler"), _extension_lock.build_lock(out, "the test build"):
        with pytest.raises(filelock.Timeout):  # held here
            filelock.FileLock(str(out / _extension_lock.LOCK_NAME)).acquire(timeout=0)
        raise RuntimeError("no compiler")
    with filelock.FileLock(str(out / _extension_lock.LOCK_NAME)).acquire(timeout=0):
        pass


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="reads /proc")
def test_what_a_dead_build_left_running_is_waited_for(tmp_path, caplog):
    out = tmp_path / "build"
    baton = _stale_baton(out)
    # ninja and the compilers outlive a killed Python, working in the build directory
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=out)
    try:
        assert _extension_lock.leftover_builders(out) == [slow.pid]
        with pytest.raises(TimeoutError, match="left running"), _extension_lock.build_lock(out, "the test build", timeout=0.4):
            pytest.fail("entered while the dead build's compiler still runs")
        assert baton.exists()
    finally:
        slow.kill()
        slow.wait()
    caplog.clear()
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], cwd=out)
    try:
        with caplog.at_level("WARNING", logger="polykernel"), _extension_lock.build_lock(out, "the test build", timeout=30):
            assert quick.poll() is not None and not baton.exists()
    finally:
        quick.kill()
        quick.wait()
    waits = [r.getMessage() for r in caplog.records if "left running" in r.getMessage()]
    assert len(waits) == 1 and str(quick.pid) in waits[0]
    assert len([r for r in caplog.records if "stale" in r.getMessage()]) == 1
    assert _extension_lock.leftover_builders(out) == []
