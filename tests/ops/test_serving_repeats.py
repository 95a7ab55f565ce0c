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
from polykernel.core import hit_guard, registry
from polykernel.errors import ImplNotAvailableError, OpArgumentError
from polykernel.ops.rotary_embedding_ import rope_cache
from polykernel.testing import runnable_impls

Call = Callable[[str], object]


def _glu(name: str, bad_out: Callable[[torch.Tensor], torch.Tensor], dev: str) -> tuple[Call, Call, tuple]:
    fn = getattr(polykernel, name)
    x = torch.randn(6, 16, device=dev)
    out = bad_out(x)
    return (lambda impl: fn(x, out=torch.empty(6, 8, device=dev), impl=impl)), (lambda impl: fn(x, out=out, impl=impl)), (x, out)


def _rope(bad: str, dev: str) -> tuple[Call, Call, tuple]:
    pos, cache = torch.arange(6, device=dev).flip(0), rope_cache(6, 8, device=dev)
    if bad == "query":  # a stride-0 query: every token's rotation lands in one row
        q = torch.randn(1, 16, device=dev).expand(6, 16)
        args = (pos, q, None, 8, cache)
    elif bad == "cos_sin_cache":  # the cache inside query: later tokens read rotated values
        q = torch.randn(6, 16, device=dev)
        args = (pos, q, None, 16, q[:, :8])
    else:  # positions beyond the cache (CPU only: checked on the values)
        args = (torch.tensor([0, 1, 2, 3, 4, 99], device=dev), torch.randn(6, 16, device=dev), None, 8, cache)
    other = rope_cache(6, 8, device=dev) if bad != "cos_sin_cache" else torch.randn(6, 8, device=dev)
    good = (pos, torch.randn(6, 16, device=dev), None, args[3], other)
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


def _farn(bad: str, dev: str) -> tuple[Call, Call, tuple]:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=dev)

    w = r(16)
    if bad == "x":
        args = (r(1, 16).expand(6, 16), r(6, 16), w)
    elif bad == "residual":
        args = (r(6, 16), r(1, 16).expand(6, 16), w)
    else:  # the weight inside x: one row would read it after another row wrote it
        x = r(6, 16)
        args = (x, r(6, 16), x[2])
    return (
        (lambda impl: polykernel.fused_add_rms_norm_(r(6, 16), r(6, 16), r(16), impl=impl)),
        (lambda impl: polykernel.fused_add_rms_norm_(*args, impl=impl)),
        args,
    )


BAD_REPEATS: list[tuple[str, str, str, Callable[[str], tuple[Call, Call, tuple]]]] = [
    (
        "silu-out-shared",
        "serving.silu_and_mul",
        "out",
        lambda d: _glu("silu_and_mul", lambda x: torch.zeros(1, 8, device=d).expand(6, 8), d),
    ),
    ("silu-out-inside-x", "serving.silu_and_mul", "out", lambda d: _glu("silu_and_mul", lambda x: x[:, 8:], d)),
    ("gelu-out-inside-x", "serving.gelu_and_mul", "out", lambda d: _glu("gelu_and_mul", lambda x: x[:, 4:12], d)),
    ("rope-query-shared", "serving.rotary_embedding_", "query", lambda d: _rope("query", d)),
    ("rope-cache-in-query", "serving.rotary_embedding_", "cos_sin_cache", lambda d: _rope("cos_sin_cache", d)),
    ("rope-positions", "serving.rotary_embedding_", "positions", lambda d: _rope("positions", d)),
    ("farn-x-shared", "serving.fused_add_rms_norm_", "x", lambda d: _farn("x", d)),
    ("farn-residual-shared", "serving.fused_add_rms_norm_", "residual", lambda d: _farn("residual", d)),
    ("farn-weight-in-x", "serving.fused_add_rms_norm_", "weight", lambda d: _farn("weight", d)),
]


def _impls(op_id: str, dev: str = "cpu") -> list[str]:
    """The CPU's torch and Triton (interpreter); on CUDA every runnable impl, peers included."""
    names = runnable_impls(op_id, dev, torch.float32)
    return [i for i in ("torch", "triton") if i in names] if dev == "cpu" else list(names)


def _guard_accepts(op_id: str, tensors: tuple) -> bool:
    """Whether the most recent guarded decision of ``op_id`` recognises these tensors. Where this
    torch has no guard (``POLYKERNEL_COMPAT_FALLBACKS=1``), every call takes the slow path, which
    validates every call of these ops: True then, once it is checked that no guard was recorded."""
    fast = registry.get_op(op_id)._fast  # type: ignore[attr-defined]
    if not hit_guard.available():
        return not fast
    return bool(fast) and fast[0][0](*tensors)


def _check_bad_repeat(case: tuple, dev: str) -> None:
    _, op_id, arg, make = case
    impls = _impls(op_id, dev)
    assert impls, f"{op_id}: nothing runnable on {dev}"
    ran = 0
    for impl in impls:
        good, bad, tensors = make(dev)
        with torch.no_grad():
            try:
                good(impl)
            except ImplNotAvailableError:  # a peer that refuses this class (its predicate): not this test's
                continue
            good(impl)
            ran += 1
            assert _guard_accepts(op_id, tensors), "the bad call would take the slow path: the test proves nothing"
            before = [t.clone() for t in tensors if isinstance(t, torch.Tensor)]
            with pytest.raises(OpArgumentError) as info:
                bad(impl)
        assert info.value.op == op_id and info.value.arg == arg, (impl, info.value)
        assert all(torch.equal(a, b) for a, b in zip(before, (t for t in tensors if isinstance(t, torch.Tensor)))), (
            "written before the error"
        )
    assert ran, f"{op_id}: no impl took the valid call on {dev}"


@pytest.mark.parametrize("case", BAD_REPEATS, ids=lambda c: c[0])
def test_memory_checks_hold_on_a_guarded_repeat(case):
    _check_bad_repeat(case, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [c for c in BAD_REPEATS if c[0] != "rope-positions"], ids=lambda c: c[0])
def test_memory_checks_hold_on_a_guarded_repeat_cuda(case):
    # every impl runnable there (the peers too): the guarded repeat takes the same checks
    _check_bad_repeat(case, "cuda")


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
