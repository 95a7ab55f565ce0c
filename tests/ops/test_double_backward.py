"""Double backward (create_graph=True): second derivatives equal the reference's, or a clear error.

A backward that builds no graph makes torch take its gradients for constants, so Hessians came
out as zeros (issue 27). The torch impls are checked by gradgradcheck in float64; the Triton
impls (TRITON_INTERPRET on the CPU, fp32) by their second-order products against the
reference's; the fused linear CE, whose gradients are made in the forward, must raise.
"""

import pytest
import torch
import torch.nn.functional as F

import polykernel as pk
from polykernel.backends._double_backward import native_backward
from polykernel.ops import dyt as dyt_op
from polykernel.ops import fused_add_rms_norm as add_rms_op
from polykernel.ops import geglu as geglu_op
from polykernel.ops import group_norm as gn_op
from polykernel.ops import jsd as jsd_op
from polykernel.ops import kl_div as kl_op
from polykernel.ops import layer_norm as ln_op
from polykernel.ops import poly_norm as poly_op
from polykernel.ops import relu_squared as relu2_op
from polykernel.ops import rms_norm as rms_op
from polykernel.ops import rope as rope_op
from polykernel.ops import softmax as softmax_op
from polykernel.ops import sparsemax as sparsemax_op
from polykernel.ops import swiglu as swiglu_op
from polykernel.ops import tvd as tvd_op
from polykernel.ops.cross_entropy import reference as ce_reference
from polykernel.testing import runnable_impls


def _need(op, impl, dtype=torch.float32):
    if impl not in runnable_impls(op, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


def _rows(*shape, dtype, scale=1.0):
    return (scale * torch.randn(*shape, dtype=dtype)).requires_grad_()


def _target(v, *shape):
    t = torch.randint(0, v, shape)
    return t.masked_fill(torch.rand(shape) < 0.25, -100)


# name -> (inputs(dtype) -> (tensors that require grad, fixed tensors), f(impl, *tensors, *fixed), reference(*tensors, *fixed))
def _cases():
    def rope_tables(dtype):
        ang = torch.randn(1, 3, 4, dtype=dtype)
        return (torch.cos(ang).repeat(1, 1, 2), torch.sin(ang).repeat(1, 1, 2))

    def logp(*shape, dtype):
        return torch.randn(*shape, dtype=dtype).log_softmax(-1).requires_grad_()

    def probs(*shape, dtype):
        return torch.randn(*shape, dtype=dtype).softmax(-1)

    return {
        "rms_norm": (
            lambda dt: ((_rows(2, 3, 8, dtype=dt), (1 + 0.2 * torch.randn(8, dtype=dt)).requires_grad_()), ()),
            lambda impl, x, w: pk.rms_norm(x, w, 1e-5, offset=0.5, impl=impl),
            lambda x, w: rms_op.reference(x, w, 1e-5, 0.5),
        ),
        "rms_norm-llama-2d": (
            lambda dt: ((_rows(5, 8, dtype=dt), (1 + 0.2 * torch.randn(8, dtype=dt)).requires_grad_()), ()),
            lambda impl, x, w: pk.rms_norm(x, w, casting="llama", impl=impl),
            lambda x, w: rms_op.reference(x, w, 1e-6, 0.0, "llama"),
        ),
        "layer_norm": (
            lambda dt: ((_rows(2, 3, 8, dtype=dt), _rows(8, dtype=dt), _rows(8, dtype=dt)), ()),
            lambda impl, x, w, b: pk.layer_norm(x, w, b, impl=impl),
            lambda x, w, b: ln_op.reference(x, w, b),
        ),
        "layer_norm-noaffine-2d": (
            lambda dt: ((_rows(5, 8, dtype=dt),), ()),
            lambda impl, x: pk.layer_norm(x, impl=impl),
            lambda x: ln_op.reference(x),
        ),
        "layer_norm-bias-only": (
            lambda dt: ((_rows(5, 8, dtype=dt), _rows(8, dtype=dt)), ()),
            lambda impl, x, b: pk.layer_norm(x, None, b, impl=impl),
            lambda x, b: ln_op.reference(x, None, b),
        ),
        "fused_add_rms_norm": (
            lambda dt: ((_rows(2, 3, 8, dtype=dt), _rows(2, 3, 8, dtype=dt), (1 + 0.2 * torch.randn(8, dtype=dt)).requires_grad_()), ()),
            lambda impl, x, r, w: pk.fused_add_rms_norm(x, r, w, offset=1.0, impl=impl),
            lambda x, r, w: add_rms_op.reference(x, r, w, 1e-6, 1.0),
        ),
        "fused_add_rms_norm-y-only-2d": (
            lambda dt: ((_rows(5, 8, dtype=dt), _rows(5, 8, dtype=dt), (1 + 0.2 * torch.randn(8, dtype=dt)).requires_grad_()), ()),
            lambda impl, x, r, w: pk.fused_add_rms_norm(x, r, w, impl=impl)[0],
            lambda x, r, w: add_rms_op.reference(x, r, w)[0],
        ),
        "swiglu": (
            lambda dt: ((_rows(3, 8, dtype=dt), _rows(3, 8, dtype=dt)), ()),
            lambda impl, g, u: pk.swiglu(g, u, impl=impl),
            lambda g, u: swiglu_op.reference(g, u),
        ),
        "geglu-tanh": (
            lambda dt: ((_rows(3, 8, dtype=dt), _rows(3, 8, dtype=dt)), ()),
            lambda impl, g, u: pk.geglu(g, u, impl=impl),
            lambda g, u: geglu_op.reference(g, u, "tanh"),
        ),
        "geglu-erf": (
            lambda dt: ((_rows(3, 8, dtype=dt), _rows(3, 8, dtype=dt)), ()),
            lambda impl, g, u: pk.geglu(g, u, "none", impl=impl),
            lambda g, u: geglu_op.reference(g, u, "none"),
        ),
        "softmax": (
            lambda dt: ((_rows(2, 3, 7, dtype=dt),), ()),
            lambda impl, x: pk.softmax(x, impl=impl),
            lambda x: softmax_op.reference(x),
        ),
        "rope": (
            lambda dt: ((_rows(1, 2, 3, 8, dtype=dt), _rows(1, 1, 3, 8, dtype=dt)), rope_tables(dt)),
            lambda impl, q, k, cos, sin: pk.rope(q, k, cos, sin, impl=impl),
            lambda q, k, cos, sin: rope_op.reference(q, k, cos, sin),
        ),
        "cross_entropy": (
            lambda dt: ((_rows(6, 9, dtype=dt, scale=2.0),), (_target(9, 6),)),
            lambda impl, x, t: pk.cross_entropy(x, t, impl=impl),
            lambda x, t: ce_reference(x, t),
        ),
        "cross_entropy-smoothed-sum-3d": (
            lambda dt: ((_rows(2, 3, 9, dtype=dt, scale=2.0),), (_target(9, 2, 3),)),
            lambda impl, x, t: pk.cross_entropy(x, t, label_smoothing=0.2, reduction="sum", impl=impl),
            lambda x, t: ce_reference(x, t, label_smoothing=0.2, reduction="sum"),
        ),
        "cross_entropy-none": (
            lambda dt: ((_rows(6, 9, dtype=dt, scale=2.0),), (_target(9, 6),)),
            lambda impl, x, t: pk.cross_entropy(x, t, label_smoothing=0.1, reduction="none", impl=impl),
            lambda x, t: ce_reference(x, t, label_smoothing=0.1, reduction="none"),
        ),
        "group_norm": (
            lambda dt: ((_rows(2, 6, 5, dtype=dt), (1 + 0.2 * torch.randn(6, dtype=dt)).requires_grad_(), _rows(6, dtype=dt)), ()),
            lambda impl, x, w, b: pk.group_norm(x, 3, w, b, impl=impl),
            lambda x, w, b: gn_op.reference(x, 3, w, b),
        ),
        "group_norm-noaffine-4d": (
            lambda dt: ((_rows(2, 4, 3, 2, dtype=dt),), ()),
            lambda impl, x: pk.group_norm(x, 2, impl=impl),
            lambda x: gn_op.reference(x, 2),
        ),
        "dyt": (
            lambda dt: (
                (_rows(2, 3, 8, dtype=dt), torch.full((1,), 0.7, dtype=dt, requires_grad=True), _rows(8, dtype=dt), _rows(8, dtype=dt)),
                (),
            ),
            lambda impl, x, a, w, b: pk.dyt(x, a, w, b, impl=impl),
            lambda x, a, w, b: dyt_op.reference(x, a, w, b),
        ),
        "poly_norm": (
            lambda dt: ((_rows(2, 3, 8, dtype=dt), _rows(3, dtype=dt), torch.full((), 0.3, dtype=dt, requires_grad=True)), ()),
            lambda impl, x, w, b: pk.poly_norm(x, w, b, impl=impl),
            lambda x, w, b: poly_op.reference(x, w, b),
        ),
        "relu_squared": (
            lambda dt: ((_rows(3, 8, dtype=dt),), ()),
            lambda impl, x: pk.relu_squared(x, impl=impl),
            lambda x: relu2_op.reference(x),
        ),
        "sparsemax": (
            lambda dt: ((_rows(2, 3, 7, dtype=dt, scale=0.3),), ()),  # a wide support
            lambda impl, x: pk.sparsemax(x, impl=impl),
            lambda x: sparsemax_op.reference(x),
        ),
        "sparsemax-dim0": (
            lambda dt: ((_rows(7, 3, dtype=dt, scale=0.3),), ()),
            lambda impl, x: pk.sparsemax(x, 0, impl=impl),
            lambda x: sparsemax_op.reference(x, 0),
        ),
        # the distillation losses (the Triton JSD refuses: test_distill_double_backward_raises)
        "jsd": (
            lambda dt: ((logp(2, 3, 7, dtype=dt),), (logp(2, 3, 7, dtype=dt).detach(), _target(7, 2, 3))),
            lambda impl, s, t, lab: pk.jsd(s, t, lab, beta=0.3, impl=impl),
            lambda s, t, lab: jsd_op.reference(s, t, lab, 0.3),
        ),
        "jsd-beta1": (
            lambda dt: ((logp(4, 6, dtype=dt),), (logp(4, 6, dtype=dt).detach(),)),
            lambda impl, s, t: pk.jsd(s, t, beta=1.0, impl=impl),
            lambda s, t: jsd_op.reference(s, t, None, 1.0),
        ),
        "tvd": (
            lambda dt: ((probs(2, 3, 7, dtype=dt).requires_grad_(),), (probs(2, 3, 7, dtype=dt), _target(7, 2, 3))),
            lambda impl, p, q, lab: pk.tvd(p, q, lab, impl=impl),
            lambda p, q, lab: tvd_op.reference(p, q, lab),
        ),
        "tvd-none-q-grad": (
            lambda dt: ((probs(4, 7, dtype=dt).requires_grad_(), probs(4, 7, dtype=dt).requires_grad_()), (_target(7, 4),)),
            lambda impl, p, q, lab: pk.tvd(p, q, lab, reduction="none", impl=impl),
            lambda p, q, lab: tvd_op.reference(p, q, lab, "none"),
        ),
        "kl_div": (
            lambda dt: ((logp(2, 3, 7, dtype=dt),), (probs(2, 3, 7, dtype=dt),)),
            lambda impl, x, t: pk.kl_div(x, t, impl=impl),
            lambda x, t: kl_op.reference(x, t),
        ),
        "kl_div-none-log": (
            lambda dt: ((logp(4, 7, dtype=dt),), (logp(4, 7, dtype=dt).detach(),)),
            lambda impl, x, t: pk.kl_div(x, t, reduction="none", log_target=True, impl=impl),
            lambda x, t: kl_op.reference(x, t, "none", True),
        ),
        "kl_div-log-target-grad": (
            lambda dt: ((logp(2, 3, 7, dtype=dt), logp(2, 3, 7, dtype=dt)), ()),
            lambda impl, x, t: pk.kl_div(x, t, reduction="sum", log_target=True, impl=impl),
            lambda x, t: kl_op.reference(x, t, "sum", True),
        ),
        "kl_div-none-target-grad": (
            lambda dt: ((logp(4, 7, dtype=dt), probs(4, 7, dtype=dt).requires_grad_()), ()),
            lambda impl, x, t: pk.kl_div(x, t, reduction="none", impl=impl),
            lambda x, t: kl_op.reference(x, t, "none"),
        ),
    }


CASES = _cases()


def _op_of(name):
    return name.split("-")[0]


# (op, impl) that refuse double backward rather than support it (tested below)
REFUSED = {("jsd", "triton")}
# a scalar loss whose plain backward consumes the gradients made in the forward (a second
# plain backward through a retained graph raises); their first order: the op's own tests
GRAD_IN_FORWARD = {"jsd", "jsd-beta1", "tvd", "kl_div", "kl_div-log-target-grad"}
# second derivatives in the inputs are 0 (linear or piecewise linear), in the cotangents not
LINEAR = ("rope", "sparsemax", "tvd", "kl_div")


@pytest.mark.parametrize("name", list(CASES))
def test_torch_impls_gradgradcheck_float64(name):
    make, f, _ = CASES[name]
    tensors, fixed = make(torch.float64)
    fn = lambda *ts: f("torch", *ts, *fixed)
    if name not in GRAD_IN_FORWARD:  # gradcheck runs the plain backward twice (retain_graph)
        assert torch.autograd.gradcheck(fn, tensors)
    assert torch.autograd.gradgradcheck(fn, tensors)


def _second_order(fn, tensors, seed=0):
    """First-order gradients (for random cotangents dy), then the gradients of <grads, v> w.r.t.
    the inputs and the cotangents (random v): the whole double backward."""
    gen = torch.Generator().manual_seed(seed)
    outs = fn(*tensors)
    outs = outs if isinstance(outs, tuple) else (outs,)
    # drawn on the CPU (one generator, the same draws on every device), then moved to the output's
    dys = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device).requires_grad_() for o in outs]
    grads = torch.autograd.grad(outs, tensors, dys, create_graph=True)
    vs = [torch.randn(g.shape, generator=gen, dtype=g.dtype).to(g.device) for g in grads]
    wrt = [*tensors, *dys]
    second = torch.autograd.grad(grads, wrt, vs, allow_unused=True)
    return [g.detach() for g in grads], [torch.zeros_like(w) if s is None else s for w, s in zip(wrt, second)]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_second_order_matches_reference(impl, name):
    _need(_op_of(name), impl)
    if (_op_of(name), impl) in REFUSED:
        pytest.skip("refuses double backward: test_distill_double_backward_raises")
    make, f, ref = CASES[name]
    tensors, fixed = make(torch.float32)
    got_g, got_2 = _second_order(lambda *ts: f(impl, *ts, *fixed), tensors)
    want_g, want_2 = _second_order(lambda *ts: ref(*ts, *fixed), tensors)
    for got, want in zip(got_g + got_2, want_g + want_2):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
    # not all zeros, but where the op is (piecewise) linear in its inputs: rope, sparsemax
    assert any(bool(s.abs().sum() > 0) for s in got_2[: len(tensors)]) or _op_of(name) in LINEAR
    assert any(bool(s.abs().sum() > 0) for s in got_2[len(tensors) :])  # d/d(cotangent)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_cross_entropy_hessian_is_pytorchs(impl):
    # The probe: the Hessian was all zeros where F.cross_entropy's is not.
    _need("cross_entropy", impl)
    z, t = torch.randn(4, 5), torch.tensor([0, 3, -100, 4])
    got = torch.autograd.functional.hessian(lambda a: pk.cross_entropy(a, t, impl=impl), z)
    want = torch.autograd.functional.hessian(lambda a: F.cross_entropy(a, t), z)
    assert bool(want.abs().sum() > 0.01)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_norm_create_graph_first_order_unchanged(impl):
    # create_graph=True computes the same first-order gradients as a plain backward.
    _need("rms_norm", impl)
    x, w = torch.randn(4, 3, 16, requires_grad=True), (1 + 0.1 * torch.randn(16)).requires_grad_()
    dy = torch.randn(4, 3, 16)
    plain = torch.autograd.grad(pk.rms_norm(x, w, impl=impl), (x, w), dy)
    graph = torch.autograd.grad(pk.rms_norm(x, w, impl=impl), (x, w), dy, create_graph=True)
    assert all(g.requires_grad for g in graph)
    for a, b in zip(plain, graph):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_linear_cross_entropy_double_backward_raises(impl, reduction):
    # Its gradients are made in buffers (in the forward for mean/sum): a second derivative must
    # raise, naming the op and the impl, where it read zeros before.
    _need("fused_linear_cross_entropy", impl)
    h, w, t = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True), _target(11, 6)

    def loss(a, b):
        return pk.fused_linear_cross_entropy(a, b, t, reduction=reduction, impl=impl).sum()

    match = rf"loss\.fused_linear_cross_entropy \[{impl}\]: double backward \(create_graph=True\) is not supported"
    with pytest.raises(RuntimeError, match=match):
        torch.autograd.functional.hessian(lambda a: loss(a, w), h)
    with pytest.raises(RuntimeError, match=match):
        torch.autograd.functional.hessian(lambda b: loss(h, b), w)
    # A create_graph backward itself still works and gives the first-order gradients.
    plain = torch.autograd.grad(loss(h, w), (h, w))
    graph = torch.autograd.grad(loss(h, w), (h, w), create_graph=True)
    for a, b in zip(plain, graph):
        torch.testing.assert_close(a, b.detach())


def test_triton_cross_entropy_grad_in_forward_double_backward_raises(monkeypatch):
    _need("cross_entropy", "triton")
    from polykernel.backends.triton import cross_entropy as triton_ce

    monkeypatch.setattr(triton_ce, "GRAD_IN_FORWARD", True)
    z, t = torch.randn(4, 5), torch.tensor([0, 3, -100, 4])
    with pytest.raises(RuntimeError, match=r"loss\.cross_entropy \[triton\]: double backward .* use impl=\"torch\""):
        torch.autograd.functional.hessian(lambda a: pk.cross_entropy(a, t, impl="triton"), z)


def _raises_naming(op_id, impl, fn):
    with pytest.raises(RuntimeError, match=rf"{op_id} \[{impl}\]: double backward \(create_graph=True\) is not supported"):
        fn()


def test_distill_double_backward_raises():
    # The Triton JSD keeps no inputs (its gradient is made in the forward): a Hessian, and a
    # derivative in the cotangent, raise naming the op and impl, where they read zeros before.
    _need("jsd", "triton")
    s, t = torch.randn(3, 7).log_softmax(-1), torch.randn(3, 7).log_softmax(-1)
    _raises_naming("loss.jsd", "triton", lambda: torch.autograd.functional.hessian(lambda a: pk.jsd(a, t, impl="triton"), s))
    a = s.clone().requires_grad_()
    dy = torch.ones((), requires_grad=True)
    (g,) = torch.autograd.grad(pk.jsd(a, t, impl="triton"), a, dy, create_graph=True)
    torch.testing.assert_close(g.detach(), torch.autograd.grad(pk.jsd(a, t, impl="triton"), a)[0])  # first order unchanged
    _raises_naming("loss.jsd", "triton", lambda: torch.autograd.grad(g.sum(), dy))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_linear_jsd_double_backward_raises(impl):
    _need("fused_linear_jsd", impl)
    h, w = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    ht, wt = torch.randn(5, 8), torch.randn(11, 8)
    lab = _target(11, 5)

    def loss(a, b):
        return pk.fused_linear_jsd(a, b, ht, wt, lab, impl=impl)

    _raises_naming("loss.fused_linear_jsd", impl, lambda: torch.autograd.functional.hessian(lambda a: loss(a, w), h))
    _raises_naming("loss.fused_linear_jsd", impl, lambda: torch.autograd.functional.hessian(lambda b: loss(h, b), w))
    plain = torch.autograd.grad(loss(h, w), (h, w))
    graph = torch.autograd.grad(loss(h, w), (h, w), create_graph=True)
    for a, b in zip(plain, graph):
        torch.testing.assert_close(a, b.detach())


# -- peers: refusing() around a peer's autograd Function (Liger's run only on CUDA: a stand-in here) --


class _PeerStandIn(torch.autograd.Function):
    """A peer's Function: x² · w, a backward that computes without a graph (as Liger's kernels)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        return x * x * w + eps

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.no_grad():
            return 2 * g * x * w, (g * x * x).sum(0), None


@pytest.mark.parametrize("kept", [True, False])
def test_refusing_peer_function(kept):
    from polykernel.backends._double_backward import refusing

    fn = refusing(_PeerStandIn, "norm.stand_in", "liger", (0, 1), kept=kept)
    a, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    # first order: the peer's own gradients, with and without create_graph
    want = torch.autograd.grad(_PeerStandIn.apply(a * 1.5, w, 1e-3).sum(), (a, w))
    got = torch.autograd.grad(fn.apply(a * 1.5, w, 1e-3).sum(), (a, w))
    graph = torch.autograd.grad(fn.apply(a * 1.5, w, 1e-3).sum(), (a, w), create_graph=True)
    for x, y, z in zip(want, got, graph):
        assert torch.equal(x, y) and torch.equal(x, z.detach())
    # before: the unguarded peer reads a zero Hessian in x (the true one is 2·w on the diagonal)
    zero = torch.autograd.functional.hessian(lambda z: _PeerStandIn.apply(z * 1.5, w, 1e-3).sum(), a)
    assert not bool(zero.abs().sum() > 0)
    for wrt in (lambda: torch.autograd.functional.hessian(lambda z: fn.apply(z * 1.5, w, 1e-3).sum(), a),
                lambda: torch.autograd.functional.hessian(lambda v: fn.apply(a * 1.5, v, 1e-3).sum(), w)):  # fmt: skip
        _raises_naming("norm.stand_in", "liger", wrt)
    # a derivative in the cotangent raises too (the double-backward trick of jvp)
    y = fn.apply(a * 1.5, w, 1e-3)
    dy = torch.randn_like(y, requires_grad=True)
    (gw,) = torch.autograd.grad(y, w, dy, create_graph=True)
    _raises_naming("norm.stand_in", "liger", lambda: torch.autograd.grad(gw.sum(), dy))
    # the inputs' handles are released by the backward (not held with the graph)
    y = fn.apply(a * 1.5, w, 1e-3)
    node = y.grad_fn
    y.sum().backward()
    assert node.pk_anchors is None


def test_refusing_liger_cross_entropy_interpreted():
    # A real Liger adapter: Liger's CE kernel runs in Triton's CPU interpreter
    from polykernel.core import registry

    spec = registry.specs_for("cross_entropy")["liger"]
    if spec.missing_modules() or not pk.env.triton_interpret():
        pytest.skip("needs liger_kernel and TRITON_INTERPRET=1")
    impl = spec.load()
    z, t = torch.randn(4, 5), torch.tensor([0, 3, -100, 4])
    loss = lambda a: impl(a, t, -100, 0.0, "mean")
    _raises_naming("loss.cross_entropy", "liger", lambda: torch.autograd.functional.hessian(loss, z))
    a = z.clone().requires_grad_()
    torch.testing.assert_close(torch.autograd.grad(loss(a), a)[0], torch.autograd.grad(F.cross_entropy(a, t), a)[0])


@pytest.mark.parametrize(("op", "call", "ref"), [
    ("softmax", lambda impl, a: impl(a), lambda a: torch.softmax(a, -1)),
    ("sparsemax", lambda impl, a: impl(a, -1), lambda a: sparsemax_op.reference(a, -1)),
])  # fmt: skip
def test_refusing_liger_softmax_and_sparsemax_interpreted(op, call, ref):
    # Liger keeps y, not x: x is held by an empty anchor; first order unchanged
    from polykernel.core import registry

    spec = registry.specs_for(op)["liger"]
    if spec.missing_modules() or not pk.env.triton_interpret():
        pytest.skip("needs liger_kernel and TRITON_INTERPRET=1")
    impl = spec.load()
    z = 0.5 * torch.randn(3, 7)
    _raises_naming(registry.get_op(op).id, "liger", lambda: torch.autograd.functional.hessian(lambda a: (call(impl, a) ** 2).sum(), z))
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    dy = torch.randn(3, 7)
    torch.testing.assert_close(torch.autograd.grad(call(impl, a), a, dy)[0], torch.autograd.grad(ref(b), b, dy)[0], rtol=1e-4, atol=1e-5)


# -- native_backward: the torch formulas a C++ node would call for create_graph (not wired: csrc/common.h refuses) --


def _graph_check(grads, inputs, want_fn, dys):
    """grads equal want_fn's reference gradients, and so do their own gradients w.r.t. inputs."""
    want = torch.autograd.grad(want_fn(*inputs), inputs, dys, create_graph=True, allow_unused=True)
    for g, r in zip(grads, want):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r)
    vs = [torch.randn_like(g) for g in grads if g is not None]
    got2 = torch.autograd.grad([g for g in grads if g is not None], inputs, vs, allow_unused=True)
    want2 = torch.autograd.grad([r for r in want if r is not None], inputs, vs, allow_unused=True)
    for a, b in zip(got2, want2):
        torch.testing.assert_close(torch.zeros(()) if a is None else a, torch.zeros(()) if b is None else b)


def test_native_backward_rms_norm_and_layer_norm():
    f64 = torch.float64
    x, w, b = _rows(4, 8, dtype=f64), _rows(8, dtype=f64), _rows(8, dtype=f64)
    dy = torch.randn(4, 8, dtype=f64, requires_grad=True)
    grads = native_backward("rms_norm", (x, w), (1e-5, 0.5, True), (dy,), (True, True))
    _graph_check(grads, (x, w, dy), lambda x, w, dy: rms_op.reference(x, w, 1e-5, 0.5, "llama"), (dy,))
    grads = native_backward("layer_norm", (x, w, b), (1e-5,), (dy,), (True, True, True))
    _graph_check(grads, (x, w, b, dy), lambda x, w, b, dy: ln_op.reference(x, w, b, 1e-5), (dy,))
    grads = native_backward("layer_norm", (x, None, None), (1e-5,), (dy,), (True, False, False))
    assert grads[1] is None and grads[2] is None
    _graph_check(grads[:1], (x, dy), lambda x, dy: ln_op.reference(x, None, None, 1e-5), (dy,))


def test_native_backward_fused_add_rms_norm():
    # The node saves its output s = x + residual (whose graph, through the node, leads to x and
    # residual); here s's graph is x + r itself.
    f64 = torch.float64
    x, r, w = _rows(4, 8, dtype=f64), _rows(4, 8, dtype=f64), _rows(8, dtype=f64)
    dy, ds = torch.randn(4, 8, dtype=f64, requires_grad=True), torch.randn(4, 8, dtype=f64, requires_grad=True)
    grads = native_backward("fused_add_rms_norm", (x + r, w), (1e-6, 1.0), (dy, ds), (True, True, True))
    _graph_check(grads, (x, r, w, dy, ds), lambda x, r, w, dy, ds: add_rms_op.reference(x, r, w, 1e-6, 1.0), (dy, ds))
    only_s = native_backward("fused_add_rms_norm", (x + r, w), (1e-6, 1.0), (None, ds), (True, True, True))
    assert only_s[2] is None and torch.equal(only_s[0], ds)


def test_native_backward_glu_and_rope():
    f64 = torch.float64
    g, u = _rows(3, 8, dtype=f64), _rows(3, 8, dtype=f64)
    dy = torch.randn(3, 8, dtype=f64, requires_grad=True)
    for act, ref in (
        (0, swiglu_op.reference),
        (1, lambda g, u: geglu_op.reference(g, u, "tanh")),
        (2, lambda g, u: geglu_op.reference(g, u, "none")),
    ):
        grads = native_backward("glu", (g, u), (act,), (dy,), (True, True))
        _graph_check(grads, (g, u, dy), lambda g, u, dy, ref=ref: ref(g, u), (dy,))
    q, k = _rows(1, 2, 3, 8, dtype=f64), _rows(1, 1, 3, 8, dtype=f64)
    ang = torch.randn(1, 3, 4, dtype=f64)
    cos, sin = torch.cos(ang).repeat(1, 1, 2), torch.sin(ang).repeat(1, 1, 2)
    gq, gk = torch.randn_like(q).requires_grad_(), torch.randn_like(k).requires_grad_()
    dq, dk = native_backward("rope", (cos, sin), (), (gq, gk), (True, True))
    want = torch.autograd.grad(rope_op.reference(q, k, cos, sin), (q, k), (gq, gk), create_graph=True)
    torch.testing.assert_close(dq, want[0])
    torch.testing.assert_close(dk, want[1])
    v = torch.randn_like(dq)
    torch.testing.assert_close(torch.autograd.grad(dq, gq, v)[0], torch.autograd.grad(want[0], gq, v)[0])
    assert native_backward("rope", (cos, sin), (), (None, gk), (True, True))[0] is None


# -- on the GPU: the Triton kernels on CUDA (the Python autograd path), and the native path -------


def _cuda(ts):
    return tuple(t.detach().cuda().requires_grad_(t.requires_grad) for t in ts)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_second_order_matches_reference_cuda(name, monkeypatch):
    from polykernel.backends.triton import _native

    monkeypatch.setattr(_native, "ENABLED", False)  # the Python Functions (the C++ nodes: below)
    if (_op_of(name), "triton") in REFUSED:
        pytest.skip("refuses double backward: test_distill_double_backward_raises")
    make, f, ref = CASES[name]
    tensors, fixed = make(torch.float32)
    tensors, fixed = _cuda(tensors), _cuda(fixed)
    got_g, got_2 = _second_order(lambda *ts: f("triton", *ts, *fixed), tensors)
    want_g, want_2 = _second_order(lambda *ts: ref(*ts, *fixed), tensors)
    for got, want in zip(got_g + got_2, want_g + want_2):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cute_dsl", "cutile"])
@pytest.mark.parametrize("name", [n for n in CASES if _op_of(n) in ("rms_norm", "layer_norm", "softmax", "cross_entropy")])
def test_second_order_matches_reference_cuda_other_backends(name, impl):
    """The CuTeDSL and cuTile Functions: their create_graph backward differentiates the torch formula."""
    from polykernel.errors import ImplNotAvailableError

    if impl not in runnable_impls(_op_of(name), "cuda", torch.float32):
        pytest.skip(f"{impl} not runnable here")
    make, f, ref = CASES[name]
    tensors, fixed = make(torch.float32)
    tensors, fixed = _cuda(tensors), _cuda(fixed)
    try:
        got_g, got_2 = _second_order(lambda *ts: f(impl, *ts, *fixed), tensors)
    except ImplNotAvailableError as exc:  # this case's shapes (the impl's predicate)
        pytest.skip(str(exc))
    want_g, want_2 = _second_order(lambda *ts: ref(*ts, *fixed), tensors)
    for got, want in zip(got_g + got_2, want_g + want_2):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rms_norm-llama-2d", "layer_norm", "fused_add_rms_norm", "swiglu", "rope"])
def test_second_order_on_the_native_path_is_a_clear_error(name):
    """The native path's C++ nodes do not build a graph: with create_graph=True they refuse with
    an error naming the op and POLYKERNEL_NATIVE=0 (csrc/common.h), never return zeros."""
    from polykernel.backends.triton import _native

    if _native.module(wait=True) is None:
        pytest.skip("the native path did not build here")
    make, f, _ref = CASES[name]
    tensors, fixed = make(torch.float32)
    # contiguous inputs of at least one row: the shapes the native path takes
    tensors, fixed = _cuda(tensors), _cuda(fixed)
    # a first call is on the native path already: a key without a plan stores one, then runs in
    # C++ (_native.call; benchmarks/results/h100-2026-12-06-sixteenth/grads.log)
    with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True\) is not supported on the native"):
        _second_order(lambda *ts: f("triton", *ts, *fixed), tensors)
    f("triton", *tensors, *fixed)  # the refusal leaves the impl usable without create_graph
