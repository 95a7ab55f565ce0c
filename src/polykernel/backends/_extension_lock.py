"""A lock around torch's C++ extension builds that a dead process cannot leave behind.

``torch.utils.cpp_extension.load``/``load_inline`` guard every load of a build directory (even of an
extension already built) with ``torch.utils.file_baton.FileBaton`` on ``<build_directory>/lock``: the
file is created with ``O_CREAT|O_EXCL`` and removed when the load ends, and a process that finds it
waits while it exists, silently and forever. A process that dies inside a load (exiting while a
daemon thread builds, a ``timeout`` kill, Ctrl-C, the OOM killer) leaves the file, and every later
load of that directory hangs.

:func:`build_lock` holds an OS lock (:class:`filelock.FileLock`: ``flock``, which the OS releases
when its holder dies) on ``<build_directory>/build.lock`` for the whole load. Every polykernel
builder of a directory takes it, so a torch baton its holder finds is stale: once no process the dead
builder started (ninja, the compilers: they outlive it, working in that directory) is left, it is
removed (logged). Waiting for a live process's build is logged after a few seconds, then goes on.

Example::

    with build_lock(out, "the native launch path"):
        mod = cpp_extension.load(name="polykernel_native", sources=[...], build_directory=str(out))
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import filelock

log = logging.getLogger("polykernel")

LOCK_NAME = "build.lock"  # ours (cuda_jit's lock file before this module, so older processes agree)
BATON_NAME = "lock"  # torch's FileBaton in cpp_extension's loader
WAIT_LOG_AFTER_S = 5.0  # a wait longer than this is logged
TIMEOUT_S = 1800.0  # another process building: a cold build takes minutes on a busy host


@contextmanager
def build_lock(build_directory: str | os.PathLike[str], what: str, timeout: float | None = TIMEOUT_S) -> Iterator[Path]:
    """Hold the build lock of ``build_directory`` (created if missing), removing torch's baton if a
    dead process left it; yields the directory. ``what`` names the build in the log ("the native
    launch path"). Raises :class:`TimeoutError` after ``timeout`` seconds of waiting for another
    process (None: wait as long as it builds)."""
    out = Path(build_directory)
    out.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    lock = filelock.FileLock(str(out / LOCK_NAME))
    try:
        if timeout is not None and timeout <= WAIT_LOG_AFTER_S:
            lock.acquire(timeout=timeout)
        else:
            try:
                lock.acquire(timeout=WAIT_LOG_AFTER_S)
            except filelock.Timeout:
                log.warning("polykernel: waiting for another process's build of %s at %s (it holds %s)", what, out, lock.lock_file)
                lock.acquire(timeout=-1 if deadline is None else max(deadline - time.monotonic(), 0))
    except filelock.Timeout as exc:
        raise TimeoutError(
            f"polykernel: another process held the build lock of {what} for {timeout} s ({lock.lock_file}); is it still building?"
        ) from exc
    try:
        baton = out / BATON_NAME
        if baton.exists():
            _wait_for_leftovers(out, what, deadline, timeout)
            try:
                baton.unlink()
            except FileNotFoundError:
                pass
            else:
                log.warning("polykernel: removed a stale build lock left by an interrupted build of %s (%s)", what, baton)
        yield out
    finally:
        lock.release()


def _wait_for_leftovers(out: Path, what: str, deadline: float | None, timeout: float | None) -> None:
    """Wait for the processes a dead builder left working in ``out``: torch runs ninja there, and
    ninja and the compilers under it outlive a killed Python (a second ninja beside them would
    write the same files)."""
    pids = leftover_builders(out)
    if not pids:
        return
    log.warning("polykernel: waiting for the build processes %s that an interrupted build of %s left running in %s", pids, what, out)
    while pids:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"polykernel: the build processes {pids} left running in {out} did not end within {timeout} s")
        time.sleep(0.2)
        pids = leftover_builders(out)


def leftover_builders(build_directory: str | os.PathLike[str]) -> list[int]:
    """Other processes whose working directory is ``build_directory`` (Linux ``/proc``; elsewhere,
    or where a process cannot be read, none)."""
    target = os.path.realpath(build_directory)
    me = str(os.getpid())
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for pid in entries:
        if not pid.isdigit() or pid == me:
            continue
        try:
            if os.readlink(f"/proc/{pid}/cwd") == target:
                found.append(int(pid))
        except OSError:  # gone, a zombie, or another user's
            continue
    return sorted(found)
