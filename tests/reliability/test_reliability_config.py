"""Reliability: hostile configuration. Every environment variable polykernel reads gets unknown
names, empty strings, separators only, odd characters and very long values; store files are
unreadable, truncated, not JSON, of the wrong schema, or rewritten while being read. Each case
either runs with the right result or fails with a short error naming the variable (or warns):
never a crash elsewhere, never a wrong result.

Complements tests/test_tuning.py (mode and margin values), tests/test_tuning_store.py (bad files,
hostile directories) and tests/test_dispatch.py (impl names).
"""

from __future__ import annotations

import json
import threading
import warnings

import pytest
import torch

import polykernel
from _tuning_helpers import isolate_tuning
from polykernel import tuning
from polykernel.ops.rms_norm import reference

VALUES = ["", " ", ",", ",,,", " , ;", "nosuch", "triton,,nosuch", "ünïcödé", "torch\ttriton", "../../etc/passwd", "x" * 100_000]
VARIABLES = [
    "POLYKERNEL_IMPL",
    "POLYKERNEL_IMPL_RMS_NORM",
    "POLYKERNEL_STRICT",
    "POLYKERNEL_TUNE",
    "POLYKERNEL_TUNE_MARGIN",
    "POLYKERNEL_CACHE_DIR",
]


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    isolate_tuning(tmp_path, monkeypatch)
    yield
    polykernel.clear_caches()


@pytest.mark.parametrize("value", VALUES, ids=lambda v: repr(v[:12]) + (f"..{len(v)}" if len(v) > 12 else ""))
@pytest.mark.parametrize("variable", VARIABLES)
def test_hostile_env_values_run_right_or_fail_clearly(variable, value, monkeypatch, tmp_path):
    if variable == "POLYKERNEL_CACHE_DIR" and value.strip() and not value.startswith(".."):
        value = str(tmp_path / value)  # a path of that name, not a file in the working directory
    monkeypatch.setenv(variable, value)
    polykernel.clear_caches()
    x, w = torch.randn(3, 16), torch.rand(16) + 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unusable cache directory warns: allowed
        try:
            y = polykernel.rms_norm(x, w)
        except ValueError as exc:
            message = str(exc)
            assert variable in message, message[:300]
            assert len(message) < 600  # a huge value is shown shortened
            return
    torch.testing.assert_close(y, reference(x, w))  # whatever ran, the result is right


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", "TRUE"])  # other values: tests/reliability/test_hostile_env.py
def test_strict_values_that_enable_it(value, monkeypatch):
    monkeypatch.setenv("POLYKERNEL_STRICT", value)

    @polykernel.register_impl(op="rms_norm", backend="cuda_jit", rank=1)
    def bad(x, weight, eps, offset, casting):
        raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        polykernel.rms_norm(torch.randn(2, 8), torch.ones(8))


@pytest.mark.parametrize("value", ["", "0", "false", "False", "off", "no"])
def test_strict_values_that_leave_it_off(value, monkeypatch):
    monkeypatch.setenv("POLYKERNEL_STRICT", value)

    @polykernel.register_impl(op="rms_norm", backend="cuda_jit", rank=1)
    def bad(x, weight, eps, offset, casting):
        raise RuntimeError("planted")

    with pytest.warns(RuntimeWarning, match="planted"):
        polykernel.rms_norm(torch.randn(2, 8), torch.ones(8))


def _store_path():
    st = tuning.store()
    st.put({"warm": {"eager": "torch", "graph": "torch", "times": {}}})
    return st.path


BAD_CONTENT = [
    b"",
    b"{",
    b'{"format": "polykernel-tuning", "entries": {',
    b"[1, 2, 3]",
    b"null",
    b'{"format": 1, "schema": "x", "identity": [], "entries": []}',
    b"\xff\xfe\x00garbage",
    b"{" * 100_000,
]


@pytest.mark.parametrize("content", BAD_CONTENT, ids=lambda c: repr(c[:10]))
def test_bad_store_files_never_crash_and_never_choose(content, monkeypatch):
    monkeypatch.setenv("POLYKERNEL_TUNE", "cached")
    path = _store_path()
    polykernel.clear_caches()
    path.write_bytes(content)
    x, w = torch.randn(3, 16), torch.ones(16)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        y = polykernel.rms_norm(x, w)
    torch.testing.assert_close(y, reference(x, w))
    assert polykernel.decisions("rms_norm")[-1]["source"] == "auto"  # a bad file is a miss


def test_store_entries_of_the_wrong_shape_are_dropped(monkeypatch):
    path = _store_path()
    data = json.loads(path.read_text())
    data["entries"] = {"a": "torch", "b": {"eager": 3}, "c": {"eager": ["torch"]}, "d": None, "e": {"eager": "torch" * 10_000}}
    path.write_text(json.dumps(data))
    polykernel.clear_caches()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        entries = tuning.store().entries()
    for entry in entries.values():  # what survives is well-formed; a long unknown name is never run
        assert isinstance(entry.get("eager"), str)
    x, w = torch.randn(3, 16), torch.ones(16)
    torch.testing.assert_close(polykernel.rms_norm(x, w), reference(x, w))


def test_store_rewritten_while_read_and_written(monkeypatch):
    """A writer (another tool, a person) rewrites the file non-atomically, valid and truncated in
    turn, while this process re-reads it and merges entries into it: no exception, and once the
    writer stops, one more put leaves a valid file with that entry."""
    from polykernel.tuning import key as tuning_key
    from polykernel.tuning.json_store import Store

    path = _store_path()
    good = path.read_text()
    stop = threading.Event()

    def rewrite():
        i = 0
        while not stop.is_set():
            path.write_text(good if i % 2 else good[: len(good) // 2])
            i += 1

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for i in range(40):
                st = Store(path.parent, tuning_key.identity())
                st.get("warm")
                st.put({f"k{i}": {"eager": "torch", "graph": "torch", "times": {}}})
    finally:
        stop.set()
        writer.join(10)
    st = Store(path.parent, tuning_key.identity())
    st.put({"final": {"eager": "torch", "graph": "torch", "times": {}}})
    data = json.loads(path.read_text())
    assert "final" in data["entries"] and data["identity"] == tuning_key.identity()
