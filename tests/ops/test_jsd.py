"""jsd: parity of every impl with the float64 reference, the reference against an independent
formula (TRL's, through F.kl_div) for every β branch, the zero-probability convention, empty and
all-ignored batches, argument errors, property tests, the Liger adapter, the module, compile."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import polykernel
import polykernel.nn as pnn
from _distill_helpers import (
    DTYPES,
    INTERPRETER_WARNINGS,
    cpu_parity,
    gpu_parity,
    layout,
    liger_matches_reference,
    need,
    parity_property,
    raises_naming,
    rows_shape,
)
from polykernel.core import registry
from polykernel.core.op import Case
from polykernel.errors import OpArgumentError, OpTypeError

pytestmark = INTERPRETER_WARNINGS
IMPLS = ["torch", "triton"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    cpu_parity("jsd", impl, dtype)


def _trl_jsd(s, t, labels, beta):
    """TRL's generalized_jsd_loss (GKD trainer) on log-probs, batchmean over the scored rows: an
    independent formula (F.kl_div with log targets, a logsumexp mixture), float64."""
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        mix = torch.logsumexp(torch.stack([s + torch.log(1 - b), t + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(mix, t, reduction="none", log_target=True) + (1 - b) * F.kl_div(mix, s, reduction="none", log_target=True)
    rows = jsd.sum(-1)
    if labels is None:
        return rows.mean()
    mask = labels != -100
    return rows[mask].sum() / mask.sum()


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_reference_is_trls_generalized_jsd(beta):
    s = (3 * torch.randn(6, 50, dtype=torch.float64)).log_softmax(-1).requires_grad_()
    t = (3 * torch.randn(6, 50, dtype=torch.float64)).log_softmax(-1)
    labels = torch.tensor([1, -100, 3, 4, -100, 0])
    ref = registry.get_op("jsd").reference
    for lab in (None, labels):
        got, want = ref(s, t, lab, beta), _trl_jsd(s, t, lab, beta)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(torch.autograd.grad(got, s)[0], torch.autograd.grad(want, s)[0], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_zero_probabilities_add_nothing(impl, beta):
    # a vocabulary entry masked to -inf in both (0·log 0 = 0): the same loss and gradient as
    # without those columns, finite (Liger and TRL give NaN there)
    need("jsd", impl)
    z = 2 * torch.randn(2, 2, 64)
    zs, zt = z[0].clone(), z[1].clone()
    zs[:, 10:20] = zt[:, 10:20] = float("-inf")
    keep = torch.ones(64, dtype=torch.bool)
    keep[10:20] = False
    s, t = zs.log_softmax(-1).requires_grad_(), zt.log_softmax(-1)
    s_kept = s.detach()[:, keep].clone().requires_grad_()
    got = polykernel.jsd(s, t, beta=beta, impl=impl)
    want = polykernel.jsd(s_kept, t[:, keep], beta=beta, impl="torch")
    assert got.isfinite()
    torch.testing.assert_close(got, want)
    (g,) = torch.autograd.grad(got, s)
    (gk,) = torch.autograd.grad(want, s_kept)
    assert bool((g[:, ~keep] == 0).all())
    torch.testing.assert_close(g[:, keep], gk)


@pytest.mark.parametrize("impl", IMPLS)
def test_identical_distributions_give_zero(impl):
    need("jsd", impl)
    s = torch.randn(5, 300).log_softmax(-1)
    for beta in (0.0, 0.5, 1.0):
        assert abs(polykernel.jsd(s, s, beta=beta, impl=impl).item()) < 1e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_and_all_ignored_give_nan_with_zero_gradients(impl):
    need("jsd", impl)
    for n, labels in ((0, None), (0, torch.zeros(0, dtype=torch.long)), (5, torch.full((5,), -100))):
        for beta in (0.0, 0.5, 1.0):
            s = torch.randn(n, 40).log_softmax(-1).requires_grad_()
            loss = polykernel.jsd(s, torch.randn(n, 40).log_softmax(-1), labels, beta=beta, impl=impl)
            assert loss.shape == () and loss.dtype == torch.float32 and loss.isnan()
            (g,) = torch.autograd.grad(loss, s)
            assert bool((g == 0).all())


@pytest.mark.parametrize("impl", IMPLS)
def test_teacher_takes_no_gradient(impl):
    need("jsd", impl)
    s = torch.randn(3, 20).log_softmax(-1).requires_grad_()
    t = torch.randn(3, 20).log_softmax(-1).requires_grad_()
    gs, gt = torch.autograd.grad(polykernel.jsd(s, t, impl=impl), (s, t), allow_unused=True)
    assert gs is not None and gt is None


def _bad(*shape):
    return torch.randn(*shape)


_L = torch.zeros(4, dtype=torch.long)


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        ((_bad(4, 8).int(), _bad(4, 8)), {}, OpTypeError, "'student_logp'"),
        ((_bad(()), _bad(())), {}, OpArgumentError, "'student_logp'"),
        ((_bad(4, 0), _bad(4, 0)), {}, OpArgumentError, "'student_logp'"),
        ((_bad(4, 8), _bad(4, 9)), {}, OpArgumentError, "'teacher_logp'"),
        ((_bad(4, 8), _bad(4, 8).long()), {}, OpTypeError, "'teacher_logp'"),
        ((_bad(4, 8), torch.zeros(4, 8, device="meta")), {}, OpArgumentError, "'teacher_logp'"),
        ((_bad(4, 8), _bad(4, 8), torch.zeros(5, dtype=torch.long)), {}, OpArgumentError, "'labels'"),
        ((_bad(4, 8), _bad(4, 8), torch.zeros(4, 1, dtype=torch.long)), {}, OpArgumentError, "'labels'"),
        ((_bad(4, 8), _bad(4, 8), torch.zeros(4)), {}, OpTypeError, "'labels'"),
        ((_bad(4, 8), _bad(4, 8), [0, 1, 2, 3]), {}, OpTypeError, "'labels'"),
        ((_bad(4, 8), _bad(4, 8), torch.zeros(4, dtype=torch.long, device="meta")), {}, OpArgumentError, "'labels'"),
        ((_bad(4, 8), _bad(4, 8), _L), {"beta": -0.1}, OpArgumentError, "'beta'"),
        ((_bad(4, 8), _bad(4, 8), _L), {"beta": 1.5}, OpArgumentError, "'beta'"),
        ((_bad(4, 8), _bad(4, 8), _L), {"beta": float("nan")}, OpArgumentError, "'beta'"),
        ((_bad(4, 8), _bad(4, 8), _L), {"beta": True}, OpArgumentError, "'beta'"),
        ((_bad(4, 8), _bad(4, 8), _L), {"ignore_index": 1.0}, OpArgumentError, "'ignore_index'"),
        ((_bad(4, 8), _bad(4, 8), _L), {"ignore_index": None}, OpArgumentError, "'ignore_index'"),
    ],
)
def test_bad_input_names_op_and_argument(args, kwargs, exc, words):
    raises_naming(polykernel.jsd, "loss.jsd", args, kwargs, exc, words)


def test_bad_input_never_marks_an_impl_broken():
    with pytest.raises(OpArgumentError):
        polykernel.jsd(torch.randn(4, 8), torch.randn(4, 8), torch.zeros(3, dtype=torch.long), impl="triton")
    s = torch.randn(4, 8).log_softmax(-1)
    polykernel.jsd(s, s, torch.zeros(4, dtype=torch.long), impl="triton")  # still runs


@st.composite
def _cases(draw, dtype):
    lead, v, how = draw(rows_shape())
    scale = draw(st.sampled_from([0.3, 1.0, 10.0]))
    s = layout((scale * torch.randn(*lead, v)).log_softmax(-1).to(dtype).requires_grad_(), how)
    t = layout((scale * torch.randn(*lead, v)).log_softmax(-1).to(dtype), how)
    args = [s, t]
    if draw(st.booleans()):
        args.append(torch.randint(0, 5, lead).masked_fill(torch.rand(lead) < 0.3, -100))
    kwargs = {"beta": draw(st.sampled_from([0.0, 0.1, 0.5, 0.8, 1.0]))}
    return Case(f"{how},x{scale:g}", tuple(args), kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_parity_property_cpu(impl):
    parity_property("jsd", impl, _cases, 12 if impl != "torch" else 30)


needs_liger_interpreter = pytest.mark.skipif(
    registry.specs_for("jsd")["liger"].missing_modules() != [] or not polykernel.env.triton_interpret(),
    reason="needs liger_kernel and TRITON_INTERPRET=1",
)


@needs_liger_interpreter
def test_liger_adapter_on_the_cases():
    # Liger's own kernel, through Triton's interpreter: the reference's semantics on every case
    # but those with a probability of 0 (NaN in Liger's kernel: the documented divergence)
    cases = registry.get_op("jsd").cases("cpu", torch.float32)
    for case in cases:
        if "masked" not in case.label:
            liger_matches_reference("jsd", case)
    masked = next(c for c in cases if c.label == "4x500-masked-vocab")
    impl = registry.specs_for("jsd")["liger"].load()
    assert impl(*[a.detach() for a in masked.args], None, 0.5, -100).isnan()


def test_module():
    loss_fn = pnn.JSDLoss(beta=0.3, ignore_index=7, impl="torch")
    s, t = torch.randn(2, 4, 9).log_softmax(-1), torch.randn(2, 4, 9).log_softmax(-1)
    labels = torch.tensor([[1, 7, 7, 2], [0, 1, 2, 7]])
    torch.testing.assert_close(loss_fn(s, t, labels), polykernel.jsd(s, t, labels, beta=0.3, ignore_index=7))
    assert "beta=0.3, ignore_index=7, impl='torch'" in repr(loss_fn)
    with pytest.raises(OpArgumentError, match=r"JSDLoss.*beta"):
        pnn.JSDLoss(beta=2.0)
    with pytest.raises(OpTypeError, match=r"JSDLoss.*ignore_index"):
        pnn.JSDLoss(ignore_index="x")


def test_compiles_fullgraph():
    s = torch.randn(4, 50).log_softmax(-1).requires_grad_()
    t = torch.randn(4, 50).log_softmax(-1)
    labels = torch.tensor([1, -100, 2, 3])

    @torch.compile(fullgraph=True, backend="eager")
    def f(s, t, labels):
        return polykernel.jsd(s, t, labels, beta=0.25) * 3

    got = f(s, t, labels)
    (g,) = torch.autograd.grad(got, s)
    sr = s.detach().double().requires_grad_()
    want = 3 * _trl_jsd(sr, t.double(), labels, 0.25)
    torch.testing.assert_close(got.double(), want)
    torch.testing.assert_close(g.double(), torch.autograd.grad(want, sr)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    gpu_parity("jsd", dtype, peer_skips=("masked",))
