"""The cross-entropy options (class weights, softcap, z_loss; token accuracy on the fused op) on
``cross_entropy`` and ``fused_linear_cross_entropy``: the reference against PyTorch and
independent formulas, parity of the torch and Triton impls with the float64 reference on
hypothesis shapes and option combinations (forward and backward, through the error model),
all-ignored batches, argument errors, the peers' exclusions, the Liger adapter through the
interpreter, the modules and a compiled call."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import polykernel
import polykernel.nn as pnn
from _distill_helpers import INTERPRETER_WARNINGS, liger_matches_reference, need, property_settings
from polykernel.core import registry
from polykernel.core.op import Case
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.cross_entropy import reference as ce_reference
from polykernel.ops.fused_linear_cross_entropy import reference as flce_reference
from polykernel.ops.fused_linear_cross_entropy import token_accuracy
from polykernel.testing import check_parity

pytestmark = INTERPRETER_WARNINGS
IMPLS = ["torch", "triton"]


def _weights(v: int, zeros: float = 0.25) -> torch.Tensor:
    w = 2 * torch.rand(v, dtype=torch.float64)
    return w.masked_fill(torch.rand(v) < zeros, 0.0)


def _target(v: int, n: int, ignored: float = 0.2) -> torch.Tensor:
    return torch.randint(0, v, (n,)).masked_fill(torch.rand(n) < ignored, -100)


# -- the reference ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ls", [0.0, 0.3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_weight_is_f_cross_entropy(ls, reduction):
    x, t, w = 3 * torch.randn(9, 40, dtype=torch.float64), _target(40, 9), _weights(40)
    want = F.cross_entropy(x, t, weight=w, label_smoothing=ls, reduction=reduction)
    torch.testing.assert_close(ce_reference(x, t, label_smoothing=ls, reduction=reduction, weight=w), want, rtol=1e-12, atol=1e-12)


def test_reference_softcap_and_z_loss_by_formula():
    # softcap: F.cross_entropy of cap·tanh(x/cap); z_loss: + z·w[t]·lse² per scored row, and the
    # weighted mean divides the whole sum by Σ w[t] (one divisor)
    x, t, w = 8 * torch.randn(7, 30, dtype=torch.float64), _target(30, 7, 0.3), _weights(30, 0.0)
    cap, z = 3.0, 0.05
    xc = cap * torch.tanh(x / cap)
    valid = t != -100
    wt = torch.where(valid, w[t.clamp(min=0)], 0.0)
    rows = F.cross_entropy(xc, t, weight=w, reduction="none") + z * wt * torch.logsumexp(xc, -1) ** 2
    got = ce_reference(x, t, weight=w, softcap=cap, z_loss=z, reduction="none")
    torch.testing.assert_close(got, rows, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ce_reference(x, t, weight=w, softcap=cap, z_loss=z), rows.sum() / wt.sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ce_reference(x, t, softcap=cap), F.cross_entropy(xc, t), rtol=1e-12, atol=1e-12)


def test_reference_all_ignored_with_options_is_nan_with_zero_grads():
    x = torch.randn(4, 20, dtype=torch.float64, requires_grad=True)
    t = torch.full((4,), -100)
    loss = ce_reference(x, t, weight=_weights(20), softcap=2.0, z_loss=0.1)
    assert loss.isnan()
    (g,) = torch.autograd.grad(loss, x)
    assert bool((g == 0).all())


# -- impls against the reference (the error model judges) -----------------------------------------


@st.composite
def _ce_cases(draw):
    n = draw(st.integers(0, 6))
    v = draw(st.sampled_from([1, 2, 7, 63, 130, 257]))
    scale = draw(st.sampled_from([1.0, 5.0, 30.0]))
    x = (scale * torch.randn(n, v)).requires_grad_()
    ignored = draw(st.sampled_from([0.0, 0.3, 1.0]))
    kwargs = {"reduction": draw(st.sampled_from(["mean", "sum", "none"]))}
    if draw(st.booleans()):
        kwargs["weight"] = _weights(v).float()
    if draw(st.booleans()):
        kwargs["softcap"] = draw(st.sampled_from([0.5, 4.0, 30.0]))
    if draw(st.booleans()):
        kwargs["z_loss"] = draw(st.sampled_from([1e-4, 0.1]))
    if draw(st.booleans()):
        kwargs["label_smoothing"] = draw(st.sampled_from([0.1, 1.0]))
    return Case(f"{n}x{v}", (x, _target(v, n, ignored)), kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_options_property(impl):
    need("cross_entropy", impl)

    @property_settings(25 if impl == "torch" else 12)
    @given(_ce_cases())
    def run(case):
        (result,) = check_parity("cross_entropy", [impl], dtypes=[torch.float32], cases=[case])
        assert result.ok, str(result)

    run()


@st.composite
def _flce_cases(draw):
    n = draw(st.integers(1, 5))
    h = draw(st.sampled_from([1, 8, 16]))
    v = draw(st.sampled_from([3, 50, 129]))
    hidden = torch.randn(n, h).requires_grad_()
    weight = (draw(st.sampled_from([1.0, 6.0])) * torch.randn(v, h) / h**0.5).requires_grad_()
    args = [hidden, weight, _target(v, n, draw(st.sampled_from([0.0, 0.3, 1.0])))]
    if draw(st.booleans()):
        args.append(torch.randn(v).requires_grad_())
    kwargs = {"reduction": draw(st.sampled_from(["mean", "sum", "none"]))}
    if draw(st.booleans()):
        kwargs["ce_weight"] = _weights(v).float()
    if draw(st.booleans()):
        kwargs["softcap"] = draw(st.sampled_from([0.5, 3.0]))
    if draw(st.booleans()):
        kwargs["z_loss"] = draw(st.sampled_from([1e-4, 0.1]))
    if draw(st.booleans()):
        kwargs["label_smoothing"] = 0.2
    return Case(f"{n}x{h}x{v}", tuple(args), kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_linear_cross_entropy_options_property(impl):
    need("fused_linear_cross_entropy", impl)

    @property_settings(20 if impl == "torch" else 10)
    @given(_flce_cases())
    def run(case):
        (result,) = check_parity("fused_linear_cross_entropy", [impl], dtypes=[torch.float32], cases=[case])
        assert result.ok, str(result)

    run()


@pytest.mark.parametrize("impl", IMPLS)
def test_options_in_low_precision(impl):
    # bf16 / fp16 logits: the cases' option rows, judged by the error model
    need("cross_entropy", impl)
    for dtype in (torch.bfloat16, torch.float16):
        sel = [c for c in registry.get_op("cross_entropy").cases("cpu", dtype) if "all-options" in c.label or "softcap" in c.label]
        assert len(sel) == 2
        for result in check_parity("cross_entropy", [impl], dtypes=[dtype], cases=sel):
            assert result.ok, str(result)


@pytest.mark.parametrize("impl", IMPLS)
def test_flce_many_chunks_with_options(impl, monkeypatch):
    # several row chunks (the weighted divisor and z-loss are per call, not per chunk)
    need("fused_linear_cross_entropy", impl)
    import polykernel.backends._fused_linear_cross_entropy as drv

    monkeypatch.setattr(drv, "CHUNK_BYTES", 4 * 3 * 300)
    assert drv.chunk_rows(300, 4) == 3
    h, w = torch.randn(10, 8, requires_grad=True), (3 * torch.randn(300, 8)).requires_grad_()
    t, cw = _target(300, 10), _weights(300).float()
    for reduction in ("mean", "none"):
        case = Case("chunks", (h, w, t), {"ce_weight": cw, "softcap": 2.0, "z_loss": 0.01, "reduction": reduction})
        (result,) = check_parity("fused_linear_cross_entropy", [impl], dtypes=[torch.float32], cases=[case])
        assert result.ok, str(result)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_ignored_and_zero_weights_give_the_references_nan(impl):
    need("cross_entropy", impl)
    x = torch.randn(5, 60, requires_grad=True)
    w = torch.ones(60)
    w[:30] = 0.0
    cases = [
        (torch.full((5,), -100), w, 0.0),  # nothing scored: NaN, zero gradients
        (torch.randint(0, 30, (5,)), w, float("nan")),  # scored, every weight 0: 0/0, NaN gradients
    ]
    for t, weight, grad in cases:
        loss = polykernel.cross_entropy(x, t, weight=weight, softcap=3.0, z_loss=0.01, impl=impl)
        xr = x.detach().clone().requires_grad_()
        want = F.cross_entropy(xr, t, weight=weight)
        want.backward()
        assert loss.isnan() and want.isnan()
        (g,) = torch.autograd.grad(loss, x)
        torch.testing.assert_close(g, torch.full_like(g, grad), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(g, xr.grad, rtol=0, atol=0, equal_nan=True)
        s = polykernel.cross_entropy(x, t, weight=weight, softcap=3.0, z_loss=0.01, reduction="sum", impl=impl)
        assert s.item() == 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_weight_sum_with_label_smoothing_is_nan_as_f_cross_entropy(impl):
    # Scored targets whose class weights sum to 0, with label smoothing: F.cross_entropy's mean is
    # (1-ε)·0/0 + ε·smooth/0 = NaN with NaN gradients on the scored rows (0 on ignored ones), not
    # the +inf of one division of the whole sum by 0
    need("cross_entropy", impl)
    x = torch.randn(6, 60)
    w = torch.rand(60) + 0.5
    w[:30] = 0.0
    t = torch.tensor([3, 7, -100, 29, -100, 0])
    xr = x.double().requires_grad_()
    want = F.cross_entropy(xr, t, weight=w.double(), label_smoothing=0.1)
    want.backward()
    assert want.isnan()
    ref = ce_reference(x.double(), t, weight=w, label_smoothing=0.1)
    assert ref.isnan()
    xi = x.clone().requires_grad_()
    loss = polykernel.cross_entropy(xi, t, weight=w, label_smoothing=0.1, impl=impl)
    loss.backward()
    assert loss.isnan()
    torch.testing.assert_close(xi.grad.double(), xr.grad, rtol=0, atol=0, equal_nan=True)
    h = torch.randn(6, 8, requires_grad=True)
    head = torch.randn(60, 8, requires_grad=True)
    flce = polykernel.fused_linear_cross_entropy(h, head, t, ce_weight=w, label_smoothing=0.1, impl=impl)
    flce.backward()
    assert flce.isnan()
    assert bool(h.grad[t != -100].isnan().all()) and bool((h.grad[t == -100] == 0).all())
    gf = torch.func.grad(lambda a: polykernel.cross_entropy(a, t, weight=w, label_smoothing=0.1, impl=impl))(x)
    torch.testing.assert_close(gf.double(), xr.grad, rtol=0, atol=0, equal_nan=True)


def test_triton_plain_path_is_unchanged_by_the_options():
    # the options are constexpr flags: a call without them launches the plain kernel
    need("cross_entropy", "triton")
    from polykernel.backends._cross_entropy import NO_EXTRAS, extras

    assert extras(None, None, 0.0) is NO_EXTRAS and extras(None, None, 0) is NO_EXTRAS
    assert extras(None, 1.0, 0.0) is not NO_EXTRAS


# -- token accuracy --------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_token_accuracy(impl, monkeypatch):
    need("fused_linear_cross_entropy", impl)
    import polykernel.ops.fused_linear_cross_entropy as mod

    monkeypatch.setattr(mod, "ACCURACY_CHUNK_BYTES", 4 * 2 * 50)  # 2 rows per chunk
    h, w = torch.randn(9, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    logits = F.linear(h.detach(), w.detach())
    t = logits.argmax(-1).clone()
    t[[1, 4]] = (t[[1, 4]] + 1) % 50  # 2 wrong
    t[7] = -100  # 1 ignored
    loss, acc = polykernel.fused_linear_cross_entropy(h, w, t, softcap=2.0, return_token_accuracy=True, impl=impl)
    assert acc.shape == () and acc.dtype == torch.float32 and not acc.requires_grad
    assert acc.item() == pytest.approx(6 / 8)
    torch.testing.assert_close(loss, polykernel.fused_linear_cross_entropy(h, w, t, softcap=2.0, impl=impl))
    loss.backward()
    assert h.grad is not None
    assert math.isnan(token_accuracy(h, w, torch.full((9,), -100)).item())  # nothing scored


# -- bad input -------------------------------------------------------------------------------------


def _ce_errors():
    x, t = torch.randn(3, 10), torch.randint(0, 10, (3,))
    return (
        x,
        t,
        [
            ({"weight": torch.ones(9)}, OpArgumentError, "weight"),
            ({"weight": torch.ones(10, dtype=torch.long)}, OpTypeError, "weight"),
            ({"weight": torch.ones(10, device="meta")}, OpArgumentError, "weight"),
            ({"weight": torch.ones(10, requires_grad=True)}, OpArgumentError, "weight"),
            ({"weight": [1.0] * 10}, OpTypeError, "weight"),
            ({"softcap": 0.0}, OpArgumentError, "softcap"),
            ({"softcap": -2.0}, OpArgumentError, "softcap"),
            ({"softcap": float("inf")}, OpArgumentError, "softcap"),
            ({"softcap": float("nan")}, OpArgumentError, "softcap"),
            ({"softcap": True}, OpArgumentError, "softcap"),
            ({"softcap": "30"}, OpArgumentError, "softcap"),
            ({"z_loss": -1e-4}, OpArgumentError, "z_loss"),
            ({"z_loss": float("inf")}, OpArgumentError, "z_loss"),
            ({"z_loss": True}, OpArgumentError, "z_loss"),
            ({"z_loss": None}, OpArgumentError, "z_loss"),
        ],
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_bad_options(impl):
    need("cross_entropy", impl)
    x, t, bad = _ce_errors()
    for kwargs, err, arg in bad:
        with pytest.raises(err, match=rf"loss\.cross_entropy: argument '{arg}'"):
            polykernel.cross_entropy(x, t, impl=impl, **kwargs)
    # nothing was marked broken: the impl still runs
    assert polykernel.cross_entropy(x, t, softcap=5.0, impl=impl).isfinite()
    with torch.no_grad():  # a weight that requires grad is fine without grad mode (as F.cross_entropy)
        polykernel.cross_entropy(x, t, weight=torch.ones(10, requires_grad=True), impl=impl)


def test_fused_linear_cross_entropy_bad_options():
    h, w, t = torch.randn(3, 4), torch.randn(10, 4), torch.randint(0, 10, (3,))
    _, _, bad = _ce_errors()
    for kwargs, err, arg in bad:
        kwargs = {("ce_weight" if k == "weight" else k): v for k, v in kwargs.items()}
        arg = "ce_weight" if arg == "weight" else arg
        with pytest.raises(err, match=rf"loss\.fused_linear_cross_entropy: argument '{arg}'"):
            polykernel.fused_linear_cross_entropy(h, w, t, **kwargs)
    for flag in (1, "yes", None):
        with pytest.raises(OpTypeError, match="argument 'return_token_accuracy'"):
            polykernel.fused_linear_cross_entropy(h, w, t, return_token_accuracy=flag)


def test_module_bad_options():
    for kwargs, arg in (({"softcap": 0.0}, "softcap"), ({"z_loss": -1.0}, "z_loss")):
        with pytest.raises(OpArgumentError, match=arg):
            pnn.CrossEntropyLoss(**kwargs)
        with pytest.raises(OpArgumentError, match=arg):
            pnn.FusedLinearCrossEntropyLoss(**kwargs)
    with pytest.raises(OpTypeError, match="return_token_accuracy"):
        pnn.FusedLinearCrossEntropyLoss(return_token_accuracy=1)


# -- peers: excluded where they lack an option; Liger's adapter ------------------------------------


def _why(op: str, impl: str, *args, **kwargs) -> str | None:
    the_op = registry.get_op(op)
    spec = registry.specs_for(op)[impl]
    return spec.predicate(the_op.arg_class(the_op.key(*args, **kwargs))) if spec.predicate else None


def test_peers_are_excluded_for_options_they_lack():
    x, t, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.long), torch.ones(64)
    for impl in ("quack", "cute_dsl"):
        assert _why("cross_entropy", impl, x, t) is None
        for kwargs, word in (({"weight": w}, "weight"), ({"softcap": 30.0}, "softcap"), ({"z_loss": 1e-4}, "z_loss")):
            assert word in _why("cross_entropy", impl, x, t, **kwargs), (impl, kwargs)
    h, hw = torch.randn(2, 8), torch.randn(64, 8)
    for op, args, wname in (("cross_entropy", (x.float(), t), "weight"), ("fused_linear_cross_entropy", (h, hw, t), "ce_weight")):
        assert _why(op, "liger", *args, **{wname: w, "softcap": 30.0}) is None
        assert _why(op, "liger", *args, z_loss=1e-4) is None
        assert "z_loss" in _why(op, "liger", *args, **{wname: w, "z_loss": 1e-4})


def test_explain_names_the_exclusion():
    x, t = torch.randn(2, 64), torch.zeros(2, dtype=torch.long)
    report = polykernel.explain("cross_entropy", x, t, weight=torch.ones(64), z_loss=1e-3)
    reasons = {r["name"]: r["reason"] for r in report.impls}
    assert reasons["torch"] is None
    # on the CPU the peers' device requirement may come first; the predicate is named otherwise
    assert reasons["liger"] and ("z_loss" in reasons["liger"] or "CUDA" in reasons["liger"] or "installed" in reasons["liger"])


needs_liger_interpreter = pytest.mark.skipif(
    registry.specs_for("cross_entropy")["liger"].missing_modules() != [] or not polykernel.env.triton_interpret(),
    reason="needs liger_kernel and TRITON_INTERPRET=1",
)


@needs_liger_interpreter
def test_liger_adapters_pass_the_options():
    # Liger's own kernels through the interpreter, with z_loss (its lse_square_scale). Its softcap
    # and weight paths call .to() on Python scalars, which only compiled Triton has: those run in
    # the GPU parity cases (the ops' cases hold every option)
    x, t = (6 * torch.randn(6, 100)).requires_grad_(), _target(100, 6)
    for reduction in ("mean", "sum", "none"):
        liger_matches_reference("cross_entropy", Case("opts", (x, t), {"z_loss": 0.05, "label_smoothing": 0.1, "reduction": reduction}))
    h, hw = torch.randn(6, 8, requires_grad=True), (3 * torch.randn(100, 8)).requires_grad_()
    liger_matches_reference("fused_linear_cross_entropy", Case("opts", (h, hw, t), {"z_loss": 0.05}))


# -- modules, compile ------------------------------------------------------------------------------


def test_modules_pass_the_options():
    x, t, w = torch.randn(2, 3, 40), torch.randint(0, 40, (2, 3)), _weights(40).float()
    m = pnn.CrossEntropyLoss(weight=w, softcap=4.0, z_loss=0.01)
    assert "softcap=4.0" in repr(m) and "z_loss=0.01" in repr(m) and "weight" in dict(m.named_buffers())
    torch.testing.assert_close(m(x, t), polykernel.cross_entropy(x, t, weight=w, softcap=4.0, z_loss=0.01))
    h, hw = torch.randn(2, 3, 8), torch.randn(40, 8)
    f = pnn.FusedLinearCrossEntropyLoss(ce_weight=w, softcap=4.0, z_loss=0.01, return_token_accuracy=True)
    loss, acc = f(h, hw, t)
    want = flce_reference(h, hw, t, ce_weight=w, softcap=4.0, z_loss=0.01)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    assert 0.0 <= acc.item() <= 1.0


def test_compiled_call_with_options():
    x = torch.randn(5, 30, requires_grad=True)
    t, w = _target(30, 5), _weights(30).float()

    def fn(x):
        return polykernel.cross_entropy(x, t, weight=w, softcap=3.0, z_loss=0.01)

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    (g,) = torch.autograd.grad(got, x)
    xd = x.detach().double().requires_grad_()
    want = ce_reference(xd, t, weight=w, softcap=3.0, z_loss=0.01)
    (gw,) = torch.autograd.grad(want, xd)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g.double(), gw, rtol=1e-4, atol=1e-6)
