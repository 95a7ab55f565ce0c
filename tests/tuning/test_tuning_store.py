"""The tuning store: round trip, namespaces, bad files, unusable directories, hostile env values."""

from __future__ import annotations

import json
import os
import warnings

import pytest

import polykernel
from _tuning_helpers import isolate_tuning
from polykernel import tuning
from polykernel.tuning import json_store as tuning_store
from polykernel.tuning import key as tuning_key
from polykernel.tuning.json_store import FORMAT, Store

IDENT = {"schema": 1, "torch": "x", "gpus": ["A"]}
ENTRY = {"eager": "torch", "graph": "torch", "static": "triton", "times": {"torch": {"gpu_ms": None, "host_ms": 0.1}}}


@pytest.fixture(autouse=True)
def _tuning_env(tmp_path, monkeypatch):
    isolate_tuning(tmp_path, monkeypatch)
    yield
    polykernel.clear_caches()


def test_round_trip(tmp_path):
    Store(tmp_path, IDENT).put({"k1": ENTRY})
    Store(tmp_path, IDENT).put({"k2": {**ENTRY, "eager": "triton"}})
    again = Store(tmp_path, IDENT)
    assert again.get("k1") == ENTRY and again.get("k2")["eager"] == "triton"
    data = json.loads(again.path.read_text())
    assert data["format"] == FORMAT and data["identity"] == IDENT  # readable identity beside the entries
    assert not list(tmp_path.glob(".tuning-*.tmp"))  # the temp file was renamed into place


def test_namespace_mismatch_is_a_miss(tmp_path):
    Store(tmp_path, IDENT).put({"k": ENTRY})
    other = Store(tmp_path, {**IDENT, "torch": "y"})
    assert other.path != Store(tmp_path, IDENT).path
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert other.get("k") is None and other.empty()


def test_foreign_identity_at_our_path_warns_and_misses(tmp_path):
    s = Store(tmp_path, IDENT)
    s.path.write_text(json.dumps({"format": FORMAT, "schema": 1, "identity": {"other": 1}, "entries": {"k": ENTRY}}))
    with pytest.warns(RuntimeWarning, match="another environment"):
        assert Store(tmp_path, IDENT).get("k") is None


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "not valid JSON"),
        ('{"format": "polykernel-tuning", "schema": 1, "identity": {"sch', "not valid JSON"),  # truncated
        ("", "not valid JSON"),
        ("[1, 2, 3]", "schema"),
        ('{"format": "polykernel-tuning", "schema": 99, "entries": {}}', "schema"),
        ('{"format": "something-else", "schema": 1}', "schema"),
        ("[" * 100000, "not valid JSON"),
    ],
)
def test_bad_files_warn_once_and_miss(tmp_path, content, match):
    s = Store(tmp_path, IDENT)
    s.path.write_text(content)
    with pytest.warns(RuntimeWarning, match=match) as record:
        assert s.get("k") is None
        assert s.entries() == {}
    assert len(record) == 1
    s.put({"k": ENTRY})  # a bad file is replaced by a valid one
    assert Store(tmp_path, IDENT).get("k") == ENTRY


def test_non_utf8_and_unreadable_files_warn_and_miss(tmp_path):
    s = Store(tmp_path, IDENT)
    s.path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.warns(RuntimeWarning, match="unreadable|not valid JSON"):
        assert s.get("k") is None
    s2 = Store(tmp_path / "b", IDENT)
    s2.path.mkdir(parents=True)  # a directory where the file should be: unreadable
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert s2.get("k") is None


def test_malformed_entries_are_dropped_with_one_warning(tmp_path):
    s = Store(tmp_path, IDENT)
    good = {"k": ENTRY}
    bad = {"b1": "torch", "b2": {"eager": 3}, "b3": {"eager": "torch", "times": []}, "b4": {"eager": "x", "graph": 5}}
    s.path.write_text(json.dumps({"format": FORMAT, "schema": 1, "identity": IDENT, "entries": {**good, **bad}}))
    with pytest.warns(RuntimeWarning, match="4 malformed entries"):
        assert Store(tmp_path, IDENT).entries() == good


def test_unusable_directory_degrades_to_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    s = Store(blocker / "cache", IDENT)
    with pytest.warns(RuntimeWarning, match="in memory only") as record:
        s.put({"k": ENTRY})
        s.put({"k2": ENTRY})
    assert len(record) == 1
    assert s.get("k") == ENTRY and s.get("k2") == ENTRY and s.path is None


def test_cache_dir_is_a_file_degrades(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", str(blocker))
    polykernel.clear_caches()
    with pytest.warns(RuntimeWarning, match="not a directory"):
        tuning.store().put({"k": ENTRY})
    assert tuning.store().get("k") == ENTRY


@pytest.mark.parametrize("value", ["/", "////", "a" * 5000, "bad\0path"])
def test_hostile_cache_dir_values_warn_and_stay_in_memory(monkeypatch, value):
    monkeypatch.setattr(tuning_store.os, "environ", {**tuning_store.os.environ, "POLYKERNEL_CACHE_DIR": value})
    with pytest.warns(RuntimeWarning, match="POLYKERNEL_CACHE_DIR") as record:
        assert tuning_store.cache_dir() is None
    assert len(str(record[0].message)) < 300


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_cache_dir_means_the_default(monkeypatch, value):
    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", value)
    assert tuning_store.cache_dir().name == "polykernel"


def test_identity_fields():
    ident = tuning_key.identity()
    for field in ("polykernel", "source", "torch", "triton", "backends", "cuda", "gpus", "timing", "schema"):
        assert field in ident
    assert tuning_key.namespace(ident) == tuning_key.namespace(json.loads(json.dumps(ident)))


def test_source_fingerprint_follows_contents_not_times(tmp_path):
    """Every dev tree and git install is version 0.1.0: a kernel edit must change the namespace."""
    pkg = tmp_path / "polykernel"
    (pkg / "backends" / "triton").mkdir(parents=True)
    kernel = pkg / "backends" / "triton" / "rms_norm.py"
    kernel.write_text("BLOCK = 1024\n")
    (pkg / "csrc.h").write_text("// v1\n")
    (pkg / "notes.txt").write_text("not source")
    first = tuning_key.source_fingerprint(pkg)
    os.utime(kernel, (1, 1))
    (pkg / "notes.txt").write_text("edited")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.py").write_text("stale")
    assert tuning_key.source_fingerprint(pkg) == first  # times, non-source files and caches do not count
    kernel.write_text("BLOCK = 2048\n")
    assert tuning_key.source_fingerprint(pkg) != first
    kernel.write_text("BLOCK = 1024\n")
    (pkg / "csrc.h").write_text("// v2\n")
    assert tuning_key.source_fingerprint(pkg) != first
    (pkg / "csrc.h").write_text("// v1\n")
    kernel.rename(pkg / "backends" / "triton" / "layer_norm.py")
    assert tuning_key.source_fingerprint(pkg) != first  # a name counts too


def test_store_follows_the_environment_identity(monkeypatch):
    ns = tuning.store().namespace
    monkeypatch.setenv("TRITON_INTERPRET", "0" if tuning_key.identity()["triton_interpret"] else "1")
    polykernel.clear_caches()
    assert tuning.store().namespace != ns  # interpreted timings never serve compiled kernels


def test_concurrent_processes_lose_no_entry(tmp_path):
    import multiprocessing as mp

    from _tuning_helpers import store_worker

    ctx = mp.get_context("spawn")
    workers, keys, rounds = 4, 6, 8
    procs = [ctx.Process(target=store_worker, args=(str(tmp_path), w, keys, rounds)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    files = list(tmp_path.glob("tuning-*.json"))
    assert len(files) == 1
    entries = json.loads(files[0].read_text())["entries"]
    expected = {f"key-{(w * 3 + r) % keys}" for w in range(workers) for r in range(rounds)}
    expected |= {f"only-{w}-{r}" for w in range(workers) for r in range(rounds)}
    assert set(entries) == expected


def test_the_store_file_is_readable_as_the_umask_allows(tmp_path):
    # mkstemp's temp file is 0600 and was renamed into place as it was: a store tuned by one
    # user (a root image build) was unreadable by another (the service), a miss on every key.
    import os
    import stat

    old = os.umask(0o022)
    try:
        Store(tmp_path, IDENT).put({"k": ENTRY})
        assert stat.S_IMODE(os.stat(Store(tmp_path, IDENT).path).st_mode) == 0o644
        os.umask(0o077)
        Store(tmp_path, IDENT).put({"k2": ENTRY})
        assert stat.S_IMODE(os.stat(Store(tmp_path, IDENT).path).st_mode) == 0o600
    finally:
        os.umask(old)
