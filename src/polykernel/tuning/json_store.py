"""The tuning store: measured decisions as JSON under ``$POLYKERNEL_CACHE_DIR``.

One file per environment identity, ``tuning-<namespace>.json``::

    {"format": "polykernel-tuning", "schema": 1,
     "identity": {...readable environment fields...},
     "entries": {"<key JSON>": {"eager": "triton", "graph": "triton", "static": "triton",
                                "margin": 0.03, "times": {"triton": {"gpu_ms": 0.05, "host_ms": 0.01},
                                                          "torch": {"error": "raised ..."}}}}}

Writes are merged under a file lock (``filelock``) and land atomically (temp file + ``os.replace``),
so processes tuning at once lose no entry. Readers take no lock (a rename is atomic) and read the
file once per store (per process, again after ``clear_caches``); a write re-reads it under the
lock to merge. A writer waits for the lock at most ``LOCK_TIMEOUT_S``; then its entries stay in
memory (one warning) and go to the file with a later write that finds the lock free. Reading never raises: a corrupt, truncated, non-JSON,
wrong-schema, unreadable or foreign file is a miss with one warning, and so is a path that is not
a regular file (a FIFO, a device: never opened) or one larger than ``MAX_FILE_BYTES``; an unusable
directory degrades to an in-memory store with one warning. Impl names in the file are only
strings here: the dispatcher honours one only if it is a registered impl that is runnable for
the call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

from .key import SCHEMA, namespace

log = logging.getLogger("polykernel")

FORMAT = "polykernel-tuning"
LOCK_TIMEOUT_S = 2.0  # a writer (POLYKERNEL_TUNE=on in an op call, `polykernel tune`) waits this long at most
MAX_FILE_BYTES = 64 << 20  # a store is kilobytes; a larger file is not one (or a runaway)
_MAX_PATH = 4096
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()  # check and add as one: threads meeting one key warn once


def warn_once(where: str, problem: str, message: str) -> None:
    """One warning per (place, kind of problem) until :func:`reset_warnings`."""
    with _warned_lock:
        if (where, problem) in _warned:
            return
        _warned.add((where, problem))
    warnings.warn(message, RuntimeWarning, stacklevel=4)
    log.warning(message)


def reset_warnings() -> None:
    _warned.clear()


def cache_dir() -> Path | None:
    """``$POLYKERNEL_CACHE_DIR``, else the user cache dir (``~/.cache/polykernel`` on Linux).

    None (with a warning) when the value cannot be a cache directory: too long, a NUL byte, or
    only separators (the filesystem root).
    """
    raw = os.environ.get("POLYKERNEL_CACHE_DIR", "")
    if raw.strip():
        shown = raw if len(raw) <= 80 else raw[:77] + "..."
        problem = None
        if len(raw) > _MAX_PATH:
            problem = f"longer than {_MAX_PATH} characters"
        elif "\0" in raw:
            problem = "contains a NUL byte"
        else:
            try:
                path = Path(raw.strip()).expanduser()
                if not path.is_absolute():
                    path = Path.cwd() / path
            except (RuntimeError, OSError, KeyError) as exc:  # ~nosuchuser, no home, a deleted working directory
                problem = f"cannot be resolved ({type(exc).__name__}: {exc})"
            else:
                if path == Path(path.anchor):
                    problem = "is the filesystem root (separators only?)"
        if problem is not None:
            warn_once(
                "POLYKERNEL_CACHE_DIR",
                "value",
                f"polykernel: POLYKERNEL_CACHE_DIR={shown!r} {problem}; tuning decisions are kept in memory only",
            )
            return None
        return path
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("polykernel", appauthor=False))
    except Exception:  # platformdirs missing or unable to name a directory
        pass
    try:
        return Path.home() / ".cache" / "polykernel"
    except (RuntimeError, OSError, KeyError) as exc:  # no home directory to be found
        warn_once("cache_dir", "home", f"polykernel: no cache directory ({exc}); tuning decisions are kept in memory only")
        return None


def _umask() -> int:
    """The process's umask (read per write: writes are rare): from /proc where it can be read
    without changing it, else set and restored (a thread creating a file then gets 022)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class _Refused(Exception):
    """The store's path is not something to read (the message says why)."""


def _read_regular(path: Path) -> str:
    """The text of ``path`` when it is a regular file of at most ``MAX_FILE_BYTES``, else
    :class:`_Refused`. A FIFO or a device is never opened: opening a FIFO blocks until a writer
    comes, and ``/dev/zero`` never ends."""
    info = os.stat(path)  # follows a symlink: its target is what would be read
    if not stat.S_ISREG(info.st_mode):
        raise _Refused("not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        raise _Refused(f"larger than {MAX_FILE_BYTES >> 20} MiB")
    # O_NONBLOCK: should the path become a FIFO after the stat, opening it still returns at once.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise _Refused("not a regular file")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise _Refused(f"larger than {MAX_FILE_BYTES >> 20} MiB")
    return data.decode("utf-8")


def _valid_entry(value: Any) -> bool:
    if not isinstance(value, dict) or not isinstance(value.get("eager"), str):
        return False
    if "graph" in value and not isinstance(value["graph"], (str, type(None))):
        return False
    times = value.get("times", {})
    return isinstance(times, dict) and all(isinstance(k, str) and isinstance(v, dict) for k, v in times.items())


class Store:
    """Decisions for one environment identity: in memory, backed by one JSON file when it can be.

    ``get`` and ``entries`` read the file once (lazily); ``put`` merges new entries into the file
    under its lock; ``adopt`` takes entries into memory only (``sync_decisions``).
    """

    def __init__(self, directory: Path | None, ident: dict[str, Any]) -> None:
        self.identity = ident
        self.namespace = namespace(ident)
        self.directory = directory
        self.path = None if directory is None else directory / f"tuning-{self.namespace}.json"
        self._entries: dict[str, dict[str, Any]] = {}
        self._loaded = False
        self._lock = threading.RLock()
        self._unwritten: dict[str, dict[str, Any]] = {}  # put while another process held the file lock
        self._lock_busy = False  # the last put timed out on the file lock: the next only tries it

    # -- reading ---------------------------------------------------------------------------
    def _read_file(self) -> dict[str, dict[str, Any]]:
        """The file's valid entries; {} (with one warning) when it cannot be used."""
        path = self.path
        if path is None:
            return {}
        try:
            if self.directory is not None and self.directory.exists() and not self.directory.is_dir():
                self._degrade("is not a directory")
                return {}
            text = _read_regular(path)
        except FileNotFoundError:
            return {}
        except NotADirectoryError:
            self._degrade("is not a directory")
            return {}
        except _Refused as exc:
            warn_once(str(path), "unreadable", f"polykernel: tuning store {path} is unreadable ({exc}); ignored")
            return {}
        except Exception as exc:  # OSError, UnicodeDecodeError, MemoryError...: a miss, never an op call's error
            warn_once(str(path), "unreadable", f"polykernel: tuning store {path} is unreadable ({type(exc).__name__}: {exc}); ignored")
            return {}
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            warn_once(str(path), "corrupt", f"polykernel: tuning store {path} is not valid JSON ({exc}); ignored")
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("schema") != SCHEMA:
            warn_once(str(path), "schema", f"polykernel: tuning store {path} is not a polykernel tuning file of schema {SCHEMA}; ignored")
            return {}
        if data.get("identity") != self.identity:
            warn_once(str(path), "foreign", f"polykernel: tuning store {path} belongs to another environment; ignored")
            return {}
        entries = data.get("entries")
        if not isinstance(entries, dict):
            warn_once(str(path), "schema", f"polykernel: tuning store {path} has no valid 'entries'; ignored")
            return {}
        good = {k: v for k, v in entries.items() if isinstance(k, str) and _valid_entry(v)}
        if len(good) != len(entries):
            warn_once(str(path), "entries", f"polykernel: tuning store {path}: {len(entries) - len(good)} malformed entries ignored")
        return good

    def _ensure_loaded(self) -> None:
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    try:
                        self._entries = {**self._read_file(), **self._entries}
                    finally:  # read once, whatever happened: never again on every call
                        self._loaded = True

    def get(self, key: str) -> dict[str, Any] | None:
        self._ensure_loaded()
        return self._entries.get(key)

    def entries(self) -> dict[str, dict[str, Any]]:
        self._ensure_loaded()
        return dict(self._entries)

    def empty(self) -> bool:
        self._ensure_loaded()
        return not self._entries

    # -- writing ---------------------------------------------------------------------------
    def adopt(self, entries: dict[str, dict[str, Any]]) -> None:
        """Take valid entries into memory (they win over this process's own for those keys)."""
        self._ensure_loaded()
        with self._lock:
            self._entries.update({k: v for k, v in entries.items() if isinstance(k, str) and _valid_entry(v)})

    def put(self, entries: dict[str, dict[str, Any]]) -> None:
        """Add entries in memory and merge them into the file (locked read-merge-atomic write).

        When another process holds the lock past ``LOCK_TIMEOUT_S``, the entries stay in memory
        (one warning) and later puts only try the lock, without waiting; the first that gets it
        writes them all."""
        import filelock

        self._ensure_loaded()
        with self._lock:
            self._entries.update(entries)
            if self.path is None:
                return
            self._unwritten.update(entries)
            try:
                self._merge_into_file(self._unwritten, 0.0 if self._lock_busy else LOCK_TIMEOUT_S)
            except filelock.Timeout:
                self._lock_busy = True
                warn_once(
                    str(self.path),
                    "locked",
                    f"polykernel: tuning store {self.path} is locked by another process (waited {LOCK_TIMEOUT_S:g} s for "
                    f"{self.path}.lock); new decisions are kept in memory, and written by a later one if the lock is free then",
                )
                return
            except Exception as exc:  # any I/O or lock failure: keep going in memory, visibly
                self._degrade(f"cannot be written ({type(exc).__name__}: {exc})")
                return
            self._unwritten.clear()
            self._lock_busy = False

    def _merge_into_file(self, entries: dict[str, dict[str, Any]], timeout: float) -> None:
        import filelock

        assert self.path is not None and self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(self.path) + ".lock", timeout=timeout):
            merged = {**self._read_file(), **entries}
            data = {"format": FORMAT, "schema": SCHEMA, "identity": self.identity, "entries": merged}
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tuning-", suffix=".tmp")
            try:
                # mkstemp makes the file 0600: the store must stay readable as open() would have
                # made it (a file tuned as root in an image, read by the service's own user).
                if hasattr(os, "fchmod"):
                    os.fchmod(fd, 0o666 & ~_umask())
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                    f.write("\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        self._entries = {**merged, **self._entries}

    def _degrade(self, why: str) -> None:
        warn_once(
            str(self.directory),
            "unusable",
            f"polykernel: tuning cache directory {self.directory} {why}; tuning decisions are kept in memory only",
        )
        self.path = None
