"""Reliability: faults. Planted impls that raise while compiling, raise at launch, or return the
wrong shape or dtype are caught on their first call and fall back with one warning (an error
under ``POLYKERNEL_STRICT=1`` or when forced), without touching any other key; an exception in an
impl's backward propagates with a note naming the op and the impl.

Complements tests/test_dispatch.py (warn-once, strict re-raise, forced impls, last runnable impl).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import polykernel
from polykernel.core.first_call import ImplOutputError
from polykernel.ops.rms_norm import reference


class CompilationError(Exception):
    """Stands for triton.compiler.errors.CompilationError (raised on the first launch)."""


def _faulty(kind: str, bad_n: int = 8) -> list[int]:
    """Plant a top-ranked rms_norm impl that misbehaves (as ``kind``) for rows of ``bad_n`` only."""
    calls: list[int] = []

    @polykernel.register_impl(op="rms_norm", backend="cuda_jit", rank=1)
    def impl(x, weight, eps, offset, casting):
        calls.append(x.shape[-1])
        y = reference(x, weight, eps, offset, casting)
        if x.shape[-1] != bad_n:
            return y
        if kind == "compile":
            raise CompilationError("at 12:8: unsupported tensor index")
        if kind == "launch":
            raise RuntimeError("Triton Error [CUDA]: invalid argument")
        if kind == "shape":
            return y[:-1]
        if kind == "dtype":
            return y.double()
        if kind == "count":
            return y, y
        raise AssertionError(kind)

    return calls


KINDS = ["compile", "launch", "shape", "dtype", "count"]


@pytest.mark.parametrize("kind", KINDS)
def test_fault_falls_back_with_one_warning_and_the_right_result(kind):
    calls = _faulty(kind)
    x, w = torch.randn(3, 8), torch.rand(8) + 0.5
    with pytest.warns(RuntimeWarning, match=r"norm\.rms_norm: impl 'cuda_jit' failed at run time") as record:
        y = polykernel.rms_norm(x, w)
    assert len([r for r in record if "cuda_jit" in str(r.message)]) == 1
    torch.testing.assert_close(y, reference(x, w))  # the next impl's result, not the planted one's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert torch.equal(polykernel.rms_norm(x, w), y)  # no second warning, no second try
    assert calls == [8]
    d = polykernel.decisions("rms_norm")[-1]
    assert d["impl"] != "cuda_jit" and d["source"] == "fallback"
    reason = {r["name"]: r["reason"] for r in polykernel.explain("rms_norm", x, w).impls}["cuda_jit"]
    assert reason.startswith("failed at run time")


@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_never_poisons_another_key(kind):
    calls = _faulty(kind, bad_n=8)
    with pytest.warns(RuntimeWarning):
        polykernel.rms_norm(torch.randn(3, 8), torch.ones(8))
    x, w = torch.randn(3, 16), torch.ones(16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(polykernel.rms_norm(x, w), reference(x, w))
        xg = torch.randn(3, 8, requires_grad=True)  # the same n with grad: another key, tried anew
        with pytest.warns(RuntimeWarning):
            polykernel.rms_norm(xg, torch.ones(8))
    assert calls == [8, 16, 8]
    assert polykernel.explain("rms_norm", x, w).chosen == "cuda_jit"


@pytest.mark.parametrize("kind", KINDS)
def test_fault_under_strict_mode_raises(kind, monkeypatch):
    _faulty(kind)
    monkeypatch.setenv("POLYKERNEL_STRICT", "1")
    expected = {"compile": CompilationError, "launch": RuntimeError}.get(kind, ImplOutputError)
    with pytest.raises(expected):
        polykernel.rms_norm(torch.randn(3, 8), torch.ones(8))


@pytest.mark.parametrize("kind", ["shape", "dtype", "count"])
def test_wrong_outputs_of_a_forced_impl_are_an_error_naming_op_and_impl(kind):
    _faulty(kind)
    for _ in range(2):  # not only the first call: the check stays until the impl passes it
        with pytest.raises(ImplOutputError, match=r"norm\.rms_norm: impl 'cuda_jit' returned"):
            polykernel.rms_norm(torch.randn(3, 8), torch.ones(8), impl="cuda_jit")


def test_wrong_outputs_in_a_fallback_chain_fall_through():
    _faulty("shape")

    @polykernel.register_impl(op="rms_norm", backend="cute_dsl", rank=2)
    def wrong_dtype(x, weight, eps, offset, casting):
        return reference(x, weight, eps, offset, casting).half()

    x, w = torch.randn(3, 8), torch.ones(8)
    with pytest.warns(RuntimeWarning) as record:
        y = polykernel.rms_norm(x, w)
    torch.testing.assert_close(y, reference(x, w))
    assert {m for m in ("cuda_jit", "cute_dsl") if any(m in str(r.message) for r in record)} == {"cuda_jit", "cute_dsl"}


class _BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        return reference(x, weight)

    @staticmethod
    def backward(ctx, dy):
        raise RuntimeError("illegal memory access in the dW kernel")


def test_backward_fault_names_op_and_impl():
    @polykernel.register_impl(op="rms_norm", backend="cuda_jit", rank=1)
    def impl(x, weight, eps, offset, casting):
        return _BadBackward.apply(x, weight)

    x = torch.randn(3, 8, requires_grad=True)
    for _ in range(2):  # the first call and a memoized one
        y = polykernel.rms_norm(x, torch.ones(8))
        with pytest.raises(RuntimeError, match="illegal memory access") as info:
            y.sum().backward()
        notes = getattr(info.value, "__notes__", [])
        assert notes == ["polykernel: raised in the backward of impl 'cuda_jit' of norm.rms_norm"]
    # forward results are unchanged by the tag, and a correct backward still runs
    xt = torch.randn(3, 8, requires_grad=True)
    polykernel.rms_norm(xt, torch.ones(8), impl="torch").sum().backward()
    assert xt.grad is not None


def test_after_a_good_first_call_the_impl_is_called_directly():
    from polykernel.core import selection as dispatch

    @polykernel.register_impl(op="rms_norm", backend="cuda_jit", rank=1)
    def impl(x, weight, eps, offset, casting):
        return reference(x, weight, eps, offset, casting)

    x, w = torch.randn(2, 8), torch.ones(8)
    polykernel.rms_norm(x, w)
    (d,) = [d for (op_id, _), d in dispatch._record.items() if op_id == "norm.rms_norm"]
    assert d.fn is impl  # after a good first call the decision calls the impl directly
