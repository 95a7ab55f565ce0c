"""Reliability: the ops that write the caller's tensors (in-place arguments, ``out=``) under
autograd, property-based (hypothesis), for every impl runnable here (issue 32).

Each example draws a shape, a dtype, a layout of the written tensors (own memory, or every other
row of a larger buffer), which written tensor the autograd graph saved (the tensor itself or the
buffer it is a view of), and the mode of the call (grad mode on, ``no_grad``, ``inference_mode``
on inference tensors, inference tensors outside it). What must hold is torch's in-place rule:
a backward that saved an overwritten value raises, and an inference tensor is written only
inside inference mode, and is left untouched when refused (the values written are the parity
suite's concern).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _inplace_helpers import CALLS, save_for_backward
from _property import examples, property_settings
from polykernel.core import registry
from polykernel.errors import OpArgumentError
from polykernel.testing import runnable_impls


def _impls(device: str) -> list[tuple[str, str]]:
    return [(op, impl) for op in sorted(CALLS) for impl in runnable_impls(op, device, torch.float32)]


def _check(data: st.DataObject, op: str, impl: str) -> None:
    dtype = data.draw(st.sampled_from(registry.get_op(op).dtypes), label="dtype")
    if impl not in runnable_impls(op, "cpu", dtype):
        return
    tokens = data.draw(st.sampled_from([1, 2, 5]), label="tokens")
    width = data.draw(st.sampled_from([2, 8, 34]), label="width")
    strided = data.draw(st.booleans(), label="rows_strided")
    mode = data.draw(st.sampled_from(["grad", "no_grad", "inference", "inference_outside"]), label="mode")
    if mode.startswith("inference"):
        with torch.inference_mode():
            call, written = CALLS[op](tokens, width, dtype, strided)
            before = {n: t.clone() for n, t in written.items()}
        if mode == "inference_outside":
            with pytest.raises(OpArgumentError, match="Inplace update to inference tensor outside InferenceMode"):
                call(impl)
            assert all(torch.equal(before[n], t) for n, t in written.items())  # refused before any write
            return
        with torch.inference_mode():
            call(impl)
        return
    call, written = CALLS[op](tokens, width, dtype, strided)
    name = data.draw(st.sampled_from(sorted(written)), label="saved")
    t = written[name]
    saved = t._base if t._base is not None and data.draw(st.booleans(), label="save the base") else t
    loss = save_for_backward(saved)
    if mode == "no_grad":
        with torch.no_grad():
            call(impl)
    else:
        call(impl)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# CPU: torch and (through the interpreter) Triton, a few examples per op and impl.
@pytest.mark.parametrize(("op", "impl"), _impls("cpu"))
def test_inplace_autograd_property_cpu(op, impl):
    @property_settings(examples(12 if impl != "torch" else 20))
    @given(st.data())
    def run(data):
        _check(data, op, impl)

    run()
