"""Measured selection per size bucket: a tuned decision runs each bucket's own winner."""

from __future__ import annotations

import threading

import pytest
import torch

import polykernel
from _tuning_helpers import isolate_tuning, only, plant, use_fake_clock
from polykernel import tuning
from polykernel.core import registry
from polykernel.core import selection as sel
from polykernel.core.memo_key import make as memo_key
from polykernel.ops.rms_norm import reference
from polykernel.tuning import key as tuning_key

SMALL, LARGE = 4, 512  # rows: buckets 4 and 512 of one argument class (n = 8)


@pytest.fixture(autouse=True)
def _tuning_env(tmp_path, monkeypatch):
    use_fake_clock(monkeypatch)
    isolate_tuning(tmp_path, monkeypatch)
    yield
    polykernel.clear_caches()


def xw(rows):
    return torch.randn(rows, 8), torch.ones(8)


def _rows(x):
    return x.numel() // x.shape[-1]


def two_impls():
    """cuda_jit (the static choice) is fast on few rows and slow on many; cute_dsl the opposite."""
    small = plant("cuda_jit", 1, delay=lambda x: 0.001 if _rows(x) <= 64 else 0.008)
    large = plant("cute_dsl", 2, delay=lambda x: 0.006 if _rows(x) <= 64 else 0.002)
    only("cuda_jit", "cute_dsl")
    return small, large


def store_key(x, w):
    op = registry.get_op("rms_norm")
    return tuning_key.key(op, op.key(x, w), [x, w])


def runs(calls_by_name, x, w):
    """The impl that one call of ``x, w`` ran (each planted impl appends to its list)."""
    before = {n: len(c) for n, c in calls_by_name.items()}
    out = polykernel.rms_norm(x, w)
    torch.testing.assert_close(out, reference(x, w, 1e-6, 0.0, "fp32"))
    ran = [n for n, c in calls_by_name.items() if len(c) != before[n]]
    assert len(ran) == 1 and len(calls_by_name[ran[0]]) == before[ran[0]] + 1, ran  # one call: no measurement
    return ran[0]


def test_each_size_bucket_is_measured_and_runs_its_own_winner(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    small, large = two_impls()
    impls = {"cuda_jit": small, "cute_dsl": large}
    xs, ws = xw(SMALL)
    xl, wl = xw(LARGE)
    polykernel.rms_norm(xs, ws)  # measured at 4 rows
    polykernel.rms_norm(xl, wl)  # the same argument class: measured at 512 rows
    entries = tuning.store().entries()
    assert entries[store_key(xs, ws)]["eager"] == "cuda_jit"
    assert entries[store_key(xl, wl)]["eager"] == "cute_dsl"
    for _ in range(2):  # alternating sizes: each runs its bucket's winner, nothing measured again
        assert runs(impls, xs, ws) == "cuda_jit"
        assert runs(impls, xl, wl) == "cute_dsl"
    assert runs(impls, *xw(300)) == "cute_dsl"  # 300 rows: bucket 512
    (record,) = polykernel.decisions("rms_norm")
    assert record["source"] == "tuned"
    assert record["by_size"] == {"float32[4x8], float32[8]": "cuda_jit", "float32[512x8], float32[8]": "cute_dsl"}


def test_cached_mode_reads_each_bucket_from_a_previous_process(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    small, large = two_impls()
    impls = {"cuda_jit": small, "cute_dsl": large}
    xs, ws = xw(SMALL)
    xl, wl = xw(LARGE)
    polykernel.rms_norm(xs, ws)
    polykernel.rms_norm(xl, wl)
    monkeypatch.setenv("POLYKERNEL_TUNE", "cached")
    polykernel.clear_caches()  # a new process: a fresh store object reads the file
    assert runs(impls, xl, wl) == "cute_dsl"  # this time the large bucket first
    assert runs(impls, xs, ws) == "cuda_jit"
    assert runs(impls, *xw(64)) == "cuda_jit"  # a bucket the store lacks: the static choice
    assert polykernel.decisions("rms_norm")[0]["by_size"]["float32[64x8], float32[8]"] == "cuda_jit (static)"


def test_cached_mode_finds_the_other_buckets_when_the_first_call_has_no_entry(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    small, large = two_impls()
    impls = {"cuda_jit": small, "cute_dsl": large}
    xl, wl = xw(LARGE)
    polykernel.rms_norm(xl, wl)  # an earlier process measured the large bucket only
    monkeypatch.setenv("POLYKERNEL_TUNE", "cached")
    polykernel.clear_caches()
    assert runs(impls, *xw(SMALL)) == "cuda_jit"  # no entry: the static choice (the class is decided here)
    assert runs(impls, xl, wl) == "cute_dsl"  # the same class: the large bucket's stored winner
    (record,) = polykernel.decisions("rms_norm")
    assert record["source"] == "auto" and record["by_size"]["float32[512x8], float32[8]"] == "cute_dsl"


def test_an_empty_store_keeps_auto_decisions_plain(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_TUNE", "cached")
    two_impls()
    polykernel.rms_norm(*xw(SMALL))
    assert _decision().by_size is None


def test_explain_shows_the_buckets_choice_and_times(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    two_impls()
    xs, ws = xw(SMALL)
    xl, wl = xw(LARGE)
    polykernel.rms_norm(xs, ws)
    polykernel.rms_norm(xl, wl)
    for (x, w), winner in (((xs, ws), "cuda_jit"), ((xl, wl), "cute_dsl")):
        e = polykernel.explain("rms_norm", x, w)
        assert (e.chosen, e.source) == (winner, "tuned")
        assert e.tuned["key"] == store_key(x, w) and e.tuned["eager"] == winner
        assert set(e.tuned["times"]) == {"cuda_jit", "cute_dsl"}


def _decision():
    """The one decision rms_norm made (what ``decisions()`` reads)."""
    (d,) = [d for (op_id, _), d in sel._record.items() if op_id == "norm.rms_norm"]
    return d


@pytest.mark.parametrize("mode", ["off", "cached"])
def test_untuned_decisions_run_the_plain_impl(monkeypatch, mode):
    two_impls()
    xs, ws = xw(SMALL)
    if mode == "off":  # a store entry that off ignores
        tuning.store().put({store_key(xs, ws): {"eager": "cute_dsl", "graph": "cute_dsl", "times": {}}})
    monkeypatch.setenv("POLYKERNEL_TUNE", mode)
    polykernel.clear_caches()
    polykernel.rms_norm(xs, ws)
    d = _decision()
    assert d is not None and d.source == "auto" and d.by_size is None
    assert d.fn is registry.load_impl(registry.specs_for("rms_norm")["cuda_jit"])  # no chooser in between
    assert "by_size" not in polykernel.decisions("rms_norm")[0]


def test_a_bucket_whose_impl_faults_falls_back_with_a_warning():
    plant("cuda_jit", 1)
    bad = plant("cute_dsl", 2, fail=True)
    only("cuda_jit", "cute_dsl")
    xs, ws = xw(SMALL)
    xl, wl = xw(LARGE)
    entry = {"times": {}}
    tuning.store().put({store_key(xs, ws): {**entry, "eager": "cuda_jit"}, store_key(xl, wl): {**entry, "eager": "cute_dsl"}})
    polykernel.clear_caches()  # cached mode: read the entries
    polykernel.rms_norm(xs, ws)  # tuned for the class
    with pytest.warns(RuntimeWarning, match=r"'cute_dsl' failed at run time on float32\[512x8\]"):
        out = polykernel.rms_norm(xl, wl)  # the large bucket's impl raises: never silently
    torch.testing.assert_close(out, reference(xl, wl, 1e-6, 0.0, "fp32"))
    assert len(bad) == 1
    polykernel.rms_norm(xl, wl)
    assert len(bad) == 1  # marked broken for the class: not run again
    (record,) = polykernel.decisions("rms_norm")
    assert record["source"] == "fallback" and record["by_size"]["float32[512x8], float32[8]"] == "cuda_jit (static)"


def test_a_capture_uses_the_buckets_graph_choice_and_never_measures(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    small, large = two_impls()
    xs, ws = xw(SMALL)
    xl, wl = xw(LARGE)
    entry = {"eager": "cuda_jit", "times": {}}
    tuning.store().put({store_key(xs, ws): {**entry, "graph": "cuda_jit"}, store_key(xl, wl): {**entry, "graph": "cute_dsl"}})
    polykernel.clear_caches()
    op = registry.get_op("rms_norm")
    args_s, args_l, args_m = (xs, ws, 1e-6, 0.0, "fp32"), (xl, wl, 1e-6, 0.0, "fp32"), (*xw(64), 1e-6, 0.0, "fp32")
    key = memo_key((op.key(*args_s), None, (), False, True, None))  # capturing: its own key
    d = sel.decide(op, key, args_s)
    assert (d.impl, d.source) == ("cuda_jit", "tuned")
    n = len(small) + len(large)
    d.fn(*args_s), d.fn(*args_l), d.fn(*args_m)
    assert len(small) + len(large) == n + 3  # three calls, nothing measured (64 rows has no entry)
    assert d.by_size.record() == {
        "float32[4x8], float32[8]": "cuda_jit",
        "float32[512x8], float32[8]": "cute_dsl",
        "float32[64x8], float32[8]": "cuda_jit (static)",
    }


def test_threads_meeting_new_buckets_at_once(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    two_impls()
    polykernel.rms_norm(*xw(SMALL))
    errors = []

    def worker(rows):
        try:
            for _ in range(3):
                x, w = xw(rows)
                torch.testing.assert_close(polykernel.rms_norm(x, w), reference(x, w, 1e-6, 0.0, "fp32"))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in (SMALL, LARGE, 32, LARGE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert set(polykernel.decisions("rms_norm")[0]["by_size"]) == {f"float32[{r}x8], float32[8]" for r in (SMALL, LARGE, 32)}


def test_fn_for_gives_the_buckets_impl_whose_attributes_the_compiled_path_reads(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    two_impls()
    specs = registry.specs_for("rms_norm")
    xs, ws = xw(SMALL)
    xl, wl = xw(LARGE)
    polykernel.rms_norm(xs, ws)
    polykernel.rms_norm(xl, wl)
    d = _decision()
    args = (1e-6, 0.0, "fp32")
    assert d.fn_for((xs, ws, *args)) is registry.load_impl(specs["cuda_jit"])
    assert d.fn_for((xl, wl, *args)) is registry.load_impl(specs["cute_dsl"])  # (a forward/backward split is its attribute)


def test_a_lookup_error_in_a_new_bucket_is_raised_and_marks_nothing_broken(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    small, large = two_impls()
    impls = {"cuda_jit": small, "cute_dsl": large}
    xs, ws = xw(SMALL)
    polykernel.rms_norm(xs, ws)
    monkeypatch.setenv("POLYKERNEL_TUNE", "sometimes")  # read again by the new bucket's lookup
    with pytest.raises(ValueError, match="POLYKERNEL_TUNE"):
        polykernel.rms_norm(*xw(LARGE))
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    assert sel._broken.get(("norm.rms_norm", _decision().key.argclass), {}) == {}
    assert runs(impls, xs, ws) == "cuda_jit"  # the tuned decision stands


def test_tune_stores_a_bucket_met_by_two_cases_from_both_cases_times(monkeypatch):
    # `polykernel tune` stores after each case (a cut run keeps them); the second case of a bucket
    # must not replace the first's times with its own: the choice comes from the slowest of both.
    from polykernel.tools import cli

    plant("cuda_jit", 1, delay=lambda x: 0.006 if _rows(x) == 3 else 0.001)  # alone, 4 rows would pick it
    plant("cute_dsl", 2, delay=0.004)
    only("cuda_jit", "cute_dsl")
    real = polykernel.rms_norm

    def cut_at_16_rows(x, *args, **kwargs):
        if _rows(x) == 16:
            raise KeyboardInterrupt
        return real(x, *args, **kwargs)

    monkeypatch.setattr(polykernel, "rms_norm", cut_at_16_rows)
    assert cli.main(["tune", "rms_norm", "--device", "cpu", "--shapes", "3x8,4x8,16x8", "--dtype", "float32"]) == 130
    polykernel.clear_caches()  # a later process reads the file
    (entry,) = tuning.store().entries().values()
    assert entry["eager"] == "cute_dsl"
