"""The ops that write into the caller's tensors (in-place arguments, ``out=``) behave as torch's
in-place ops under autograd, whatever the impl (issue 32): the written tensors' version counters
move, so a backward that saved one raises; inference tensors are refused outside inference mode."""

import pytest
import torch

import polykernel as pk
from _inplace_helpers import CALLS, ops_taking_destinations, save_for_backward
from polykernel.errors import OpArgumentError
from polykernel.testing import runnable_impls

INPLACE_RAISE = "modified by an inplace operation"


def _impls() -> list[tuple[str, str]]:
    return [(op, impl) for op in sorted(CALLS) for impl in runnable_impls(op, "cpu", torch.float32)]


def test_every_op_writing_given_tensors_is_covered():
    assert sorted(CALLS) == ops_taking_destinations()


def test_the_issue_example_raises_with_triton():
    if "triton" not in runnable_impls("fused_add_rms_norm_", "cpu", torch.float32):
        pytest.skip("triton not runnable on the CPU here")
    w = torch.randn(8, requires_grad=True)
    x = torch.randn(4, 8)
    y = (w * x).sum()
    pk.fused_add_rms_norm_(x, torch.randn(4, 8), torch.ones(8), impl="triton")
    assert x._version > 0
    with pytest.raises(RuntimeError, match=INPLACE_RAISE):
        y.backward()


@pytest.mark.parametrize(("op", "impl"), _impls())
def test_a_saved_written_tensor_fails_the_backward(op, impl):
    for name in CALLS[op](3, 8, torch.float32, False)[1]:  # each written tensor in turn
        call, written = CALLS[op](3, 8, torch.float32, False)
        loss = save_for_backward(written[name])
        call(impl)
        with pytest.raises(RuntimeError, match=INPLACE_RAISE):
            loss.backward()


@pytest.mark.parametrize(("op", "impl"), _impls())
def test_a_saved_base_of_a_written_view_fails_the_backward(op, impl):
    # the written tensor is every other row of a buffer: views share their base's version counter
    call, written = CALLS[op](3, 8, torch.float32, True)
    view = next(t for t in written.values() if t._base is not None)
    loss = save_for_backward(view._base)
    with torch.no_grad():  # torch bumps versions under no_grad too
        call(impl)
    with pytest.raises(RuntimeError, match=INPLACE_RAISE):
        loss.backward()


@pytest.mark.parametrize(("op", "impl"), _impls())
def test_inference_tensors_are_written_only_in_inference_mode(op, impl):
    with torch.inference_mode():
        call, written = CALLS[op](3, 8, torch.float32, False)
    with pytest.raises(OpArgumentError, match="Inplace update to inference tensor outside InferenceMode") as info:
        call(impl)
    assert info.value.arg in written
    with torch.inference_mode():
        before = {n: t.clone() for n, t in written.items()}
        call(impl)  # allowed there, as for torch's in-place ops
    assert any(not torch.equal(before[n], t) for n, t in written.items())  # it did write


@pytest.mark.parametrize(("op", "impl"), _impls())
def test_a_leaf_that_requires_grad_is_not_written(op, impl):
    call, written = CALLS[op](3, 8, torch.float32, False)
    name, t = next(iter(written.items()))
    t.requires_grad_()
    with pytest.raises(OpArgumentError) as info:
        call(impl)
    assert info.value.arg == name


def test_a_peer_writing_raw_memory_is_seen_by_autograd():
    # The bump is the dispatcher's, not each impl's: an impl that writes through .data (as a
    # kernel writes through a pointer) leaves the version alone by itself.
    def raw(x, residual, weight, eps, offset):
        s = x + residual
        residual.data.copy_(s)
        x.data.copy_(pk.rms_norm(s, weight, eps, offset=offset, impl="torch"))
        return x, residual

    pk.register_impl(op="fused_add_rms_norm_", backend="cuda_jit", rank=1000)(raw)
    pk.clear_caches()
    x = torch.randn(3, 32)
    loss = save_for_backward(x)
    pk.fused_add_rms_norm_(x, torch.randn(3, 32), torch.ones(32), impl="cuda_jit")
    with pytest.raises(RuntimeError, match=INPLACE_RAISE):
        loss.backward()


def test_a_compiled_call_bumps_the_callers_tensors():
    if "triton" not in runnable_impls("silu_and_mul", "cpu", torch.float32):
        pytest.skip("triton not runnable on the CPU here")
    torch._dynamo.reset()
    x, out = torch.randn(4, 16), torch.randn(4, 8)
    loss = save_for_backward(out)
    torch.compile(lambda x, out: pk.silu_and_mul(x, out=out, impl="triton"), fullgraph=True, backend="aot_eager")(x, out)
    with pytest.raises(RuntimeError, match=INPLACE_RAISE):
        loss.backward()
