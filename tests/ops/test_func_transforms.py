"""torch.func transforms (grad, vmap, hessian) through polykernel ops.

The torch impls run plain torch ops under a transform (their autograd Functions have no
functorch rules), so every transform torch has works and gives the reference's results. The
Triton impls cannot read a transform's wrapped tensors: they hand such calls to the torch impl,
and auto selection must not count them as a Triton fault (issue 27: ``must override the
setup_context staticmethod``, ``Cannot access storage of BatchedTensorImpl``).
"""

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, hessian, vmap

import polykernel as pk
from polykernel.ops import dyt as dyt_op
from polykernel.ops import fused_add_rms_norm as add_rms_op
from polykernel.ops import fused_linear_cross_entropy as flce_op
from polykernel.ops import geglu as geglu_op
from polykernel.ops import group_norm as gn_op
from polykernel.ops import layer_norm as ln_op
from polykernel.ops import poly_norm as poly_op
from polykernel.ops import relu_squared as relu2_op
from polykernel.ops import rms_norm as rms_op
from polykernel.ops import rope as rope_op
from polykernel.ops import softmax as softmax_op
from polykernel.ops import sparsemax as sparsemax_op
from polykernel.ops import swiglu as swiglu_op
from polykernel.ops.cross_entropy import reference as ce_reference
from polykernel.testing import runnable_impls


def _need(op, impl, dtype=torch.float32):
    if impl not in runnable_impls(op, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


def _sq(out):
    """A scalar loss of an op's output(s)."""
    outs = out if isinstance(out, tuple) else (out,)
    return sum(o.float().pow(2).sum() for o in outs)


T6 = torch.tensor([1, 8, -100, 0, 3, 3])
ANG = torch.randn(1, 3, 4)
COS, SIN = torch.cos(ANG).repeat(1, 1, 2), torch.sin(ANG).repeat(1, 1, 2)

# name -> (op(impl, *tensors) -> output(s), reference(*tensors), example tensors(dtype)); every
# tensor of the example is differentiated, and vmapped over its first dim (one sample: [0]).
CASES = {
    "rms_norm": (
        lambda impl, x, w: pk.rms_norm(x, w, offset=1.0, impl=impl),
        lambda x, w: rms_op.reference(x, w, 1e-6, 1.0),
        lambda dt: (torch.randn(4, 3, 16, dtype=dt), 0.1 * torch.randn(4, 16, dtype=dt)),
    ),
    "layer_norm": (
        lambda impl, x, w, b: pk.layer_norm(x, w, b, impl=impl),
        lambda x, w, b: ln_op.reference(x, w, b),
        lambda dt: (torch.randn(4, 3, 16, dtype=dt), torch.randn(4, 16, dtype=dt), torch.randn(4, 16, dtype=dt)),
    ),
    "fused_add_rms_norm": (
        lambda impl, x, r, w: pk.fused_add_rms_norm(x, r, w, impl=impl),
        lambda x, r, w: add_rms_op.reference(x, r, w),
        lambda dt: (torch.randn(4, 3, 16, dtype=dt), torch.randn(4, 3, 16, dtype=dt), torch.randn(4, 16, dtype=dt)),
    ),
    "swiglu": (
        lambda impl, g, u: pk.swiglu(g, u, impl=impl),
        swiglu_op.reference,
        lambda dt: (torch.randn(4, 3, 16, dtype=dt), torch.randn(4, 3, 16, dtype=dt)),
    ),
    "geglu": (
        lambda impl, g, u: pk.geglu(g, u, "none", impl=impl),
        lambda g, u: geglu_op.reference(g, u, "none"),
        lambda dt: (torch.randn(4, 3, 16, dtype=dt), torch.randn(4, 3, 16, dtype=dt)),
    ),
    "softmax": (
        lambda impl, x: pk.softmax(x, impl=impl),
        softmax_op.reference,
        lambda dt: (torch.randn(4, 3, 16, dtype=dt),),
    ),
    "rope": (
        lambda impl, q, k: pk.rope(q, k, COS, SIN, impl=impl),
        lambda q, k: rope_op.reference(q, k, COS, SIN),
        lambda dt: (torch.randn(2, 1, 2, 3, 8, dtype=dt), torch.randn(2, 1, 1, 3, 8, dtype=dt)),
    ),
    "cross_entropy": (
        lambda impl, x: pk.cross_entropy(x, T6, label_smoothing=0.1, impl=impl),
        lambda x: ce_reference(x, T6, label_smoothing=0.1),
        lambda dt: (3 * torch.randn(2, 6, 9, dtype=dt),),
    ),
    "cross_entropy-none": (
        lambda impl, x: pk.cross_entropy(x, T6, reduction="none", impl=impl),
        lambda x: ce_reference(x, T6, reduction="none"),
        lambda dt: (3 * torch.randn(2, 6, 9, dtype=dt),),
    ),
    "fused_linear_cross_entropy": (
        lambda impl, h, w: pk.fused_linear_cross_entropy(h, w, T6, impl=impl),
        lambda h, w: flce_op.reference(h, w, T6),
        lambda dt: (torch.randn(2, 6, 8, dtype=dt), torch.randn(2, 9, 8, dtype=dt)),
    ),
    "group_norm": (
        lambda impl, x, w, b: pk.group_norm(x, 2, w, b, impl=impl),
        lambda x, w, b: gn_op.reference(x, 2, w, b),
        lambda dt: (torch.randn(4, 3, 6, 5, dtype=dt), torch.randn(4, 6, dtype=dt), torch.randn(4, 6, dtype=dt)),
    ),
    "dyt": (
        lambda impl, x, a, w, b: pk.dyt(x, a, w, b, impl=impl),
        lambda x, a, w, b: dyt_op.reference(x, a, w, b),
        lambda dt: (
            torch.randn(4, 3, 16, dtype=dt),
            torch.rand(4, 1, dtype=dt),
            torch.randn(4, 16, dtype=dt),
            torch.randn(4, 16, dtype=dt),
        ),
    ),
    "poly_norm": (
        lambda impl, x, w, b: pk.poly_norm(x, w, b, impl=impl),
        lambda x, w, b: poly_op.reference(x, w, b),
        lambda dt: (torch.randn(4, 3, 16, dtype=dt), torch.randn(4, 3, dtype=dt), torch.randn(4, dtype=dt)),
    ),
    "relu_squared": (
        lambda impl, x: pk.relu_squared(x, impl=impl),
        relu2_op.reference,
        lambda dt: (torch.randn(4, 3, 16, dtype=dt),),
    ),
    "sparsemax": (
        lambda impl, x: pk.sparsemax(x, impl=impl),
        sparsemax_op.reference,
        lambda dt: (torch.randn(4, 3, 16, dtype=dt),),
    ),
}


def _op_of(name):
    return name.split("-")[0]


def _tol(dtype):
    return {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_func_grad_is_the_references(impl, name, dtype):
    _need(_op_of(name), impl, dtype)
    op, ref, example = CASES[name]
    args = tuple(a[0] for a in example(dtype))  # one sample (the vmapped dim dropped)
    argnums = tuple(range(len(args)))
    got = grad(lambda *a: _sq(op(impl, *a)), argnums=argnums)(*args)
    want = grad(lambda *a: _sq(ref(*a)), argnums=argnums)(*args)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **_tol(dtype))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_vmap_and_vmap_of_grad(impl, name):
    _need(_op_of(name), impl)
    op, ref, example = CASES[name]
    args = example(torch.float32)
    got = vmap(lambda *a: op(impl, *a))(*args)
    want = vmap(ref)(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    argnums = tuple(range(len(args)))
    got = vmap(grad(lambda *a: _sq(op(impl, *a)), argnums=argnums))(*args)
    want = vmap(grad(lambda *a: _sq(ref(*a)), argnums=argnums))(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_func_hessian_of_cross_entropy(impl):
    # jacfwd(jacrev): forward-mode AD too, which a custom Function without jvp could not take
    _need("cross_entropy", impl)
    z, t = torch.randn(4, 5), torch.tensor([0, 3, -100, 4])
    got = hessian(lambda a: pk.cross_entropy(a, t, impl=impl))(z)
    want = hessian(lambda a: ce_reference(a, t))(z)
    assert bool(want.abs().sum() > 0.01)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["rms_norm", "swiglu", "softmax", "cross_entropy"])
def test_auto_selection_under_vmap_is_not_a_fault(name):
    # Auto picks Triton here (TRITON_INTERPRET); under vmap it must not fail, fall back and mark
    # Triton broken for the class (the fault path warns): the Triton impl hands the call over.
    op, ref, example = CASES[name]
    args = example(torch.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="polykernel")  # the fault path's warning
        got = vmap(lambda *a: op(None, *a))(*args)
        torch.testing.assert_close(got, vmap(ref)(*args), rtol=1e-4, atol=1e-5)
        plain = op(None, *(a[0] for a in args))  # the plain call after it: no fault either
    torch.testing.assert_close(plain, ref(*(a[0] for a in args)), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_triton_under_transforms_cuda(name, monkeypatch):
    # On CUDA auto selection picks Triton (and the native path where built): under grad and vmap
    # the call must reach the torch impl, and no fault may mark Triton broken.
    for table in ("T6", "COS", "SIN"):  # the cases' fixed tensors, on the GPU
        monkeypatch.setitem(globals(), table, globals()[table].cuda())
    op, ref, example = CASES[name]
    args = tuple(a.cuda() for a in example(torch.float32))
    argnums = tuple(range(len(args)))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="polykernel")
        for impl in ("triton", None):
            got = vmap(grad(lambda *a, impl=impl: _sq(op(impl, *a)), argnums=argnums))(*args)
            want = vmap(grad(lambda *a: _sq(ref(*a)), argnums=argnums))(*args)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("impl", [None, "torch", "triton"])
def test_forward_ad_dual_tensors_get_the_references_tangents(impl, name):
    # torch.autograd.forward_ad: a dual tensor does not require grad, so the argument class said
    # "no gradient" and a kernel reading raw memory returned an output without a tangent (a zero
    # derivative, silently): auto picks Triton here, and so did impl="triton".
    if impl is not None:
        _need(_op_of(name), impl)
    op, ref, example = CASES[name]
    args = tuple(a[0] for a in example(torch.float32))  # one sample (the vmapped dim dropped)
    tangents = tuple(torch.randn_like(a) for a in args)
    with fwAD.dual_level():
        got = op(impl, *(fwAD.make_dual(a, t) for a, t in zip(args, tangents)))
        want = ref(*(fwAD.make_dual(a, t) for a, t in zip(args, tangents)))
        got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
            w_tangent = fwAD.unpack_dual(w).tangent
            assert bool(w_tangent.abs().sum() > 0)
            g_tangent = fwAD.unpack_dual(g).tangent
            assert g_tangent is not None, f"{name} [{impl}]: the output lost its tangent"
            torch.testing.assert_close(g_tangent, w_tangent, rtol=1e-4, atol=1e-5)
    plain, want = op(impl, *args), ref(*args)  # outside the dual level: the plain call, as before
    for g, w in zip(plain if isinstance(plain, tuple) else (plain,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


PREFERENCE = ("dpo", "orpo", "cpo", "simpo", "kto", "grpo")


@pytest.mark.parametrize("name", PREFERENCE)
def test_preference_losses_under_torch_func(name):
    # The chunked walk writes in place and its autograd.Function has no functorch rules: under
    # grad, jvp and vmap the losses take plain torch ops and give what the eager path gives (the
    # gradient in hidden and weight, the tangent, each sample of a batch).
    from polykernel.core.registry import REGISTRY
    from polykernel.testing import fresh

    op = REGISTRY.get_op(f"loss.fused_linear_{name}_loss")
    case = next(iter(op.cases("cpu", torch.float32)))
    hidden, weight, *rest = (fresh(a) for a in case.args)
    fn = getattr(pk, op.name)

    def loss(h, w):
        return fn(h, w, *rest, impl="torch", **case.kwargs)[0]

    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    want = torch.autograd.grad(loss(h, w), (h, w))
    got = torch.func.grad(loss, argnums=(0, 1))(hidden.detach(), weight.detach())
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)

    tangent = torch.randn_like(hidden)
    _, jvp_out = torch.func.jvp(lambda x: loss(x, weight.detach()), (hidden.detach(),), (tangent,))
    torch.testing.assert_close(jvp_out, (want[0] * tangent).sum(), rtol=1e-4, atol=1e-6)

    batch = torch.stack([hidden.detach(), 0.5 * hidden.detach()])
    got_b = torch.func.vmap(lambda x: loss(x, weight.detach()))(batch)
    want_b = torch.stack([loss(x, weight.detach()).detach() for x in batch])
    torch.testing.assert_close(got_b, want_b, rtol=1e-5, atol=1e-6)
