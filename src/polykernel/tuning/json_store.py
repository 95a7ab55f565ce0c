"""The tuning store: measured decisions as JSON under ``$POLYKERNEL_CACHE_DIR``.

One file per environment identity, ``tuning-<namespace>.json``::

    {"format": "polykernel-tuning", "schema": 1,
     "identity": {...readable environment fields...},
     "entries": {"<key JSON>": {"eager": "triton", "graph": "triton", "static": "triton",
                                "margin": 0.03, "times": {"triton": {"gpu_ms": 0.05, "host_ms": 0.01},
                                                          "torch": {"error": "raised ..."}}}}}

Writes are merged under a file lock (``filelock``) and land atomically (temp file + ``os.replace``),
so processes tuning at once lose no entry. Reading never raises: a corrupt, truncated, non-JSON,
wrong-schema, unreadable or foreign file is a miss with one warning; an unusable directory
degrades to an in-memory store with one warning. Impl names in the file are only strings here:
the dispatcher honours one only if it is a registered impl that is runnable for the call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

from .key import SCHEMA, namespace

log = logging.getLogger("polykernel")

FORMAT = "polykernel-tuning"
LOCK_TIMEOUT_S = 30.0
_MAX_PATH = 4096
_warned: set[tuple[str, str]] = set()


def warn_once(where: str, problem: str, message: str) -> None:
    """One warning per (place, kind of problem) until :func:`reset_warnings`."""
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
            path = Path(raw.strip()).expanduser()
            if not path.is_absolute():
                path = Path.cwd() / path
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
        return Path.home() / ".cache" / "polykernel"


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
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except NotADirectoryError:
            self._degrade("is not a directory")
            return {}
        except (OSError, UnicodeDecodeError, ValueError) as exc:
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
                    self._entries = {**self._read_file(), **self._entries}
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
        """Add entries in memory and merge them into the file (locked read-merge-atomic write)."""
        self._ensure_loaded()
        with self._lock:
            self._entries.update(entries)
            if self.path is None:
                return
            try:
                self._merge_into_file(entries)
            except Exception as exc:  # any I/O or lock failure: keep going in memory, visibly
                self._degrade(f"cannot be written ({type(exc).__name__}: {exc})")

    def _merge_into_file(self, entries: dict[str, dict[str, Any]]) -> None:
        import filelock

        assert self.path is not None and self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT_S):
            merged = {**self._read_file(), **entries}
            data = {"format": FORMAT, "schema": SCHEMA, "identity": self.identity, "entries": merged}
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tuning-", suffix=".tmp")
            try:
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
