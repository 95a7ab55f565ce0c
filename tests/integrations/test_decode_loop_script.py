"""benchmarks/models/decode_loop.py's records of what ran: a provider variant (``set_impl`` is a
preference, skipped where the provider cannot run) never claims a provider that ran nowhere."""

from __future__ import annotations

import sys

import pytest
import torch

import polykernel
from _scripts import BENCHMARKS, load_benchmark


@pytest.fixture
def decode_loop(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS / "models"))  # its `from _common import ...`
    yield load_benchmark("decode_loop")
    sys.modules.pop("decode_loop", None)


def test_a_provider_that_ran_nowhere_is_recorded_and_noted(decode_loop):
    polykernel.set_impl("flashinfer")  # on the CPU: a preference skipped everywhere
    polykernel.clear_caches()
    polykernel.rms_norm(torch.randn(2, 8), torch.ones(8))
    polykernel.silu_and_mul(torch.randn(2, 8))
    ran = decode_loop.impls_ran(polykernel.decisions())
    polykernel.set_impl(None)
    assert set(ran) == {"norm.rms_norm", "serving.silu_and_mul"} and all("flashinfer" not in v for v in ran.values())
    assert not decode_loop.provider_ran("flashinfer", ran)
    rec = {"variant": "polykernel[flashinfer][eager]", "provider_ran": False, "first_logits_max_abs_diff": 0.0}
    assert decode_loop.note(rec).startswith("flashinfer ran nowhere")


def test_impls_ran_counts_each_size_buckets_impl(decode_loop):
    decisions = [
        {"op": "norm.rms_norm", "impl": "triton", "by_size": {"a": "flashinfer", "b": "triton (static)"}},
        {"op": "norm.rms_norm", "impl": "torch"},
    ]
    ran = decode_loop.impls_ran(decisions)
    assert ran == {"norm.rms_norm": ["flashinfer", "torch", "triton"]}
    assert decode_loop.provider_ran("flashinfer", ran) and not decode_loop.provider_ran("sgl_kernel", ran)
