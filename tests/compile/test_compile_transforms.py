"""Forward-mode AD and torch.func transforms inside compiled code.

A custom op has no forward-mode rule: a dual tensor's tangent does not reach its outputs, so a
compiled call under ``torch.func.jvp`` or ``torch.autograd.forward_ad`` gave a zero (or no)
tangent, silently, where the eager call gives the reference's (``Op.forward_ad``); under
``torch.func.grad`` the custom op's fake impl could not take the transform's wrapped tensors.
Such calls trace the op's torch reference, as eager ones run it.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, jvp

import polykernel
from polykernel import _compat
from polykernel.ops.cross_entropy import reference as ce_reference
from polykernel.ops.rms_norm import reference as rms_reference

# A trace reads the transform and dual-level state through torch's private flags; their fallbacks
# (POLYKERNEL_COMPAT_FALLBACKS=1) cannot tell it while Dynamo traces.
pytestmark = pytest.mark.skipif(
    bool({"functorch_transforms_active", "forward_ad_level"} & set(_compat.fallbacks())), reason="private flags fell back"
)


@pytest.fixture(autouse=True)
def _dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _args():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    return x, 1 + 0.1 * torch.randn(8, generator=gen, dtype=torch.float64), torch.randn(4, 8, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_jvp_carries_the_tangent(backend):
    x, w, t = _args()

    def f(x):
        return jvp(lambda a: polykernel.rms_norm(a, w), (x,), (t,))

    out, tangent = torch.compile(f, backend=backend, fullgraph=True)(x)
    want_out, want_tangent = jvp(lambda a: rms_reference(a, w), (x,), (t,))
    torch.testing.assert_close(out, want_out)
    assert bool(want_tangent.abs().sum() > 0)
    torch.testing.assert_close(tangent, want_tangent)


def test_compiled_call_inside_a_dual_level_carries_the_tangent():
    x, w, t = _args()
    compiled = torch.compile(lambda a: polykernel.rms_norm(a, w), backend="eager", fullgraph=True)
    compiled(x)  # compiled first outside any dual level: the dual call must not reuse that graph
    with fwAD.dual_level():
        got = fwAD.unpack_dual(compiled(fwAD.make_dual(x, t))).tangent
        want = fwAD.unpack_dual(rms_reference(fwAD.make_dual(x, t), w, 1e-6)).tangent
    assert got is not None, "the compiled call lost the tangent"
    torch.testing.assert_close(got, want)


def test_compiled_func_grad_is_the_references():
    x, w, _ = _args()
    target = torch.tensor([1, 7, -100, 0])

    def loss(a, fn, ce):
        return ce(fn(a), target)

    def f(x):
        return grad(loss)(x, lambda a: polykernel.rms_norm(a, w), polykernel.cross_entropy)

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    want = grad(loss)(x, lambda a: rms_reference(a, w, 1e-6), ce_reference)
    torch.testing.assert_close(got, want)
