"""The serving ops' checks hold on a call the guard recognises (a repeat of a valid call's
metadata and options, which runs without building its argument class or validating): what
validity reads of memory and values (overlaps, strides, CPU positions) is checked on every call
before anything is written, and what torch's in-place ops refuse is refused. Each bad call below
has the metadata of the valid call made before it, and the test asserts that the guard of the
valid call's decision accepts the bad call's tensors, so that the check is not passed vacuously
by the slow path."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import polykernel
from polykernel.core import registry
from polykernel.errors import OpArgumentError
from polykernel.ops.rotary_embedding_ import rope_cache
from polykernel.testing import runnable_impls

Call = Callable[[str], object]


def _glu(name: str, bad_out: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Call, Call, tuple]:
    fn = getattr(polykernel, name)
    x = torch.randn(6, 16)
    out = bad_out(x)
    return (lambda impl: fn(x, out=torch.empty(6, 8), impl=impl)), (lambda impl: fn(x, out=out, impl=impl)), (x, out)


def _rope(bad: str) -> tuple[Call, Call, tuple]:
    pos, cache = torch.arange(6).flip(0), rope_cache(6, 8)
    if bad == "query":  # a stride-0 query: every token's rotation lands in one row
        q = torch.randn(1, 16).expand(6, 16)
        args = (pos, q, None, 8, cache)
    elif bad == "cos_sin_cache":  # the cache inside query: later tokens read rotated values
        q = torch.randn(6, 16)
        args = (pos, q, None, 16, q[:, :8])
    else:  # positions beyond the cache (CPU: checked on the values)
        args = (torch.tensor([0, 1, 2, 3, 4, 99]), torch.randn(6, 16), None, 8, cache)
    good = (pos, torch.randn(6, 16), None, args[3], rope_cache(6, 8) if bad != "cos_sin_cache" else torch.randn(6, 8))
    return (
        (lambda impl: polykernel.rotary_embedding_(*good, impl=impl)),
        (lambda impl: polykernel.rotary_embedding_(*args, impl=impl)),
        (
            args[0],
            args[1],
            args[2],
            args[4],
        ),
    )


def _farn(bad: str) -> tuple[Call, Call, tuple]:
    w = torch.randn(16)
    if bad == "x":
        args = (torch.randn(1, 16).expand(6, 16), torch.randn(6, 16), w)
    elif bad == "residual":
        args = (torch.randn(6, 16), torch.randn(1, 16).expand(6, 16), w)
    else:  # the weight inside x: one row would read it after another row wrote it
        x = torch.randn(6, 16)
        args = (x, torch.randn(6, 16), x[2])
    return (
        (lambda impl: polykernel.fused_add_rms_norm_(torch.randn(6, 16), torch.randn(6, 16), torch.randn(16), impl=impl)),
        (lambda impl: polykernel.fused_add_rms_norm_(*args, impl=impl)),
        args,
    )


BAD_REPEATS: list[tuple[str, str, str, Callable[[], tuple[Call, Call, tuple]]]] = [
    ("silu-out-shared", "serving.silu_and_mul", "out", lambda: _glu("silu_and_mul", lambda x: torch.zeros(1, 8).expand(6, 8))),
    ("silu-out-inside-x", "serving.silu_and_mul", "out", lambda: _glu("silu_and_mul", lambda x: x[:, 8:])),
    ("gelu-out-inside-x", "serving.gelu_and_mul", "out", lambda: _glu("gelu_and_mul", lambda x: x[:, 4:12])),
    ("rope-query-shared", "serving.rotary_embedding_", "query", lambda: _rope("query")),
    ("rope-cache-in-query", "serving.rotary_embedding_", "cos_sin_cache", lambda: _rope("cos_sin_cache")),
    ("rope-positions", "serving.rotary_embedding_", "positions", lambda: _rope("positions")),
    ("farn-x-shared", "serving.fused_add_rms_norm_", "x", lambda: _farn("x")),
    ("farn-residual-shared", "serving.fused_add_rms_norm_", "residual", lambda: _farn("residual")),
    ("farn-weight-in-x", "serving.fused_add_rms_norm_", "weight", lambda: _farn("weight")),
]


def _impls(op_id: str) -> list[str]:
    return [i for i in ("torch", "triton") if i in runnable_impls(op_id, "cpu", torch.float32)]


def _guard_accepts(op_id: str, tensors: tuple) -> bool:
    """Whether the most recent guarded decision of ``op_id`` recognises these tensors."""
    fast = registry.get_op(op_id)._fast  # type: ignore[attr-defined]
    return bool(fast) and fast[0][0](*tensors)


@pytest.mark.parametrize("case", BAD_REPEATS, ids=lambda c: c[0])
def test_memory_checks_hold_on_a_guarded_repeat(case):
    _, op_id, arg, make = case
    for impl in _impls(op_id):
        good, bad, tensors = make()
        with torch.no_grad():
            good(impl)
            good(impl)
            assert _guard_accepts(op_id, tensors), "the bad call would take the slow path: the test proves nothing"
            before = [t.clone() for t in tensors if isinstance(t, torch.Tensor)]
            with pytest.raises(OpArgumentError) as info:
                bad(impl)
        assert info.value.op == op_id and info.value.arg == arg, (impl, info.value)
        assert all(torch.equal(a, b) for a, b in zip(before, (t for t in tensors if isinstance(t, torch.Tensor)))), (
            "written before the error"
        )


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_strided_destination_on_a_repeat_is_written_through_its_strides(impl):
    if impl not in runnable_impls("serving.silu_and_mul", "cpu", torch.float32):
        pytest.skip(f"{impl} not runnable on the CPU here")
    x = torch.randn(6, 16)
    with torch.no_grad():
        polykernel.silu_and_mul(x, out=torch.empty(6, 8), impl=impl)
        polykernel.silu_and_mul(x, out=torch.empty(6, 8), impl=impl)
        for out in (torch.zeros(8, 6).t(), torch.zeros(6, 16)[:, ::2], torch.zeros(12, 8)[::2]):
            assert _guard_accepts("serving.silu_and_mul", (x, out))
            polykernel.silu_and_mul(x, out=out, impl=impl)
            torch.testing.assert_close(out, torch.nn.functional.silu(x[:, :8]) * x[:, 8:])


def test_inference_tensors_on_a_repeat_outside_inference_mode_are_refused():
    with torch.inference_mode():
        x, out = torch.randn(6, 16), torch.empty(6, 8)
        polykernel.silu_and_mul(x, out=out)
        polykernel.silu_and_mul(x, out=out)  # a guarded repeat in inference mode
    with pytest.raises(OpArgumentError, match="Inplace update to inference tensor outside InferenceMode"):
        polykernel.silu_and_mul(x, out=out)


def test_a_tensor_that_needs_grad_on_a_repeat_in_grad_mode_is_refused():
    x = torch.randn(6, 16, requires_grad=True)
    with torch.no_grad():
        polykernel.silu_and_mul(x)
        polykernel.silu_and_mul(x)
    with pytest.raises(OpArgumentError, match="inference only") as info:
        polykernel.silu_and_mul(x)
    assert info.value.arg == "x"


def test_a_repeat_bumps_the_written_tensors_version():
    x, out = torch.randn(6, 16), torch.empty(6, 8)
    polykernel.silu_and_mul(x, out=out)
    v = out._version
    polykernel.silu_and_mul(x, out=out)
    assert _guard_accepts("serving.silu_and_mul", (x, out)) and out._version > v
