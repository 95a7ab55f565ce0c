"""fused_linear_jsd: parity of every impl with the float64 reference, equality with jsd on
materialized logits, no [N, V] tensor ever built, the chunk size, gradients for the student
only, all-ignored batches, argument errors, property tests, the Liger adapter, the module and
torch.compile."""

import pytest
import torch
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import polykernel
import polykernel.nn as pnn
from _distill_helpers import (
    DTYPES,
    INTERPRETER_WARNINGS,
    cpu_parity,
    gpu_parity,
    liger_matches_reference,
    need,
    parity_property,
    raises_naming,
)
from _matmul_helpers import Matmuls, assert_padded, assert_same, padded_then_plain
from polykernel.core import registry
from polykernel.core.op import Case
from polykernel.errors import OpArgumentError, OpTypeError

pytestmark = INTERPRETER_WARNINGS
IMPLS = ["torch", "triton"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    cpu_parity("fused_linear_jsd", impl, dtype)


def _heads(n=12, h=16, ht=24, v=300):
    hs = torch.randn(n, h, requires_grad=True)
    ws = (torch.randn(v, h) / h**0.5).requires_grad_()
    return hs, ws, torch.randn(n, ht), torch.randn(v, ht) / ht**0.5


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_equals_jsd_of_the_log_softmaxes(impl, beta):
    need("fused_linear_jsd", impl)
    hs, ws, ht, wt = _heads()
    labels = torch.randint(0, 300, (12,)).masked_fill(torch.rand(12) < 0.3, -100)
    got = polykernel.fused_linear_jsd(hs, ws, ht, wt, labels, beta=beta, temperature=1.7, impl=impl)
    hs2, ws2 = hs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    want = polykernel.jsd((hs2 @ ws2.T / 1.7).log_softmax(-1), (ht @ wt.T / 1.7).log_softmax(-1), labels, beta=beta, impl="torch")
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got, (hs, ws)), torch.autograd.grad(want, (hs2, ws2))):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


class _Shapes(TorchDispatchMode):
    """Records the bytes of every tensor an aten op returns (the interpreter's copies of the
    kernels' arguments included)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("impl", IMPLS)
def test_never_builds_the_n_by_v_logits(impl, monkeypatch):
    # with a chunk budget of a few rows, no tensor of the call holds more than a chunk of logits
    need("fused_linear_jsd", impl)
    import polykernel.backends._fused_linear_jsd as drv
    import polykernel.backends.torch.fused_linear_jsd as torch_impl

    n, v, budget = 64, 500, 40000  # 3 rows of two fp32 logits and fp32 dlogits (12 bytes a class)
    monkeypatch.setattr(torch_impl, "TORCH_BUDGET", budget)  # the torch impl's budget
    monkeypatch.setattr(drv, "CHUNK_BYTES", budget)  # the driver's default (the other impls')
    assert drv.chunk_rows(v, 4, n, budget) == 6
    hs, ws, ht, wt = _heads(n=n, h=8, ht=8, v=v)
    with _Shapes() as rec:
        loss = polykernel.fused_linear_jsd(hs, ws, ht, wt, impl=impl)
        torch.autograd.grad(loss, (hs, ws))
    # the largest: a chunk's logits (12 KB) or the weight's gradient (16 KB); [N, V] fp32 is 128 KB
    assert rec.largest <= max(6 * v * 4, v * 8 * 4), rec.largest


@pytest.mark.parametrize("dtype, per", [(torch.bfloat16, 8), (torch.float32, 4)], ids=str)
def test_matmuls_run_on_heads_padded_to_16_bytes(dtype, per, monkeypatch):
    """An odd vocabulary put cuBLAS on its 1-element-aligned kernels (the fused linear
    cross-entropy's, h100-2026-12-06-twentyfirst): every matmul sees both heads' classes padded
    to 16 bytes, and the loss and gradients are those of the walk on the heads as they are."""
    import polykernel.backends._fused_linear_jsd as drv

    v = 999
    torch.manual_seed(3)
    hs, ws, ht, wt = (x.detach().to(dtype) for x in _heads(v=v))
    labels = torch.randint(0, v, (12,)).masked_fill(torch.rand(12) < 0.3, -100)

    checked = []

    def run():
        a, b = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        with Matmuls() as rec:
            loss = polykernel.fused_linear_jsd(a, b, ht, wt, labels, beta=0.3, impl="torch")
            grads = torch.autograd.grad(loss, (a, b))
        if not checked:  # the first run: the padded one
            assert_padded(rec.calls, v, per)
            checked.append(True)
        return (loss, *grads)

    tol = dict(rtol=2e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
    assert_same(*padded_then_plain(monkeypatch, drv, run), **tol)


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_the_heads_changes_nothing_for_a_non_finite_row(impl, monkeypatch):
    """The padded classes add exact zeros, also where a student row is infinite (its logits past
    V are NaN, cleared before the gradient matmuls): the same loss and gradients, NaNs in the
    same places, as the walk on the heads as they are."""
    need("fused_linear_jsd", impl)
    import polykernel.backends._fused_linear_jsd as drv

    torch.manual_seed(4)
    hs, ws, ht, wt = (x.detach() for x in _heads(v=301))
    hs[5, 3] = float("inf")
    labels = torch.randint(0, 301, (12,)).masked_fill(torch.arange(12) == 5, -100)  # the bad row ignored

    def run():
        a, b = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        loss = polykernel.fused_linear_jsd(a, b, ht, wt, labels, impl=impl)
        return (loss, *torch.autograd.grad(loss, (a, b)))

    assert_same(*padded_then_plain(monkeypatch, drv, run), rtol=1e-5, atol=1e-7)


def test_chunk_rows_come_from_the_problem():
    from polykernel.ops.fused_linear_jsd import CHUNK_BYTES, chunk_rows

    assert chunk_rows(128256, 2, 8192) == 384  # bf16 at Llama 3's vocabulary: 1.28 MB a row
    assert chunk_rows(128256, 4, 8192) == 256
    assert chunk_rows(32000, 2, 8192) == 1664
    assert chunk_rows(32000, 2, 100) == 100  # at most N
    assert chunk_rows(10**9, 2, 100) == 1
    for v, elt in ((128256, 2), (50257, 4), (1000, 2)):
        rows = chunk_rows(v, elt, 10**6)
        assert rows * v * (8 + elt) <= CHUNK_BYTES < (rows + 128) * v * (8 + elt)


@pytest.mark.parametrize("impl", IMPLS)
def test_teacher_takes_no_gradient_and_is_not_written(impl):
    need("fused_linear_jsd", impl)
    hs, ws, ht, wt = _heads()
    ht.requires_grad_()
    wt.requires_grad_()
    before = (ht.detach().clone(), wt.detach().clone())
    grads = torch.autograd.grad(polykernel.fused_linear_jsd(hs, ws, ht, wt, impl=impl), (hs, ws, ht, wt), allow_unused=True)
    assert grads[0] is not None and grads[1] is not None and grads[2] is None and grads[3] is None
    assert torch.equal(ht.detach(), before[0]) and torch.equal(wt.detach(), before[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_only_the_weight_or_only_the_hidden(impl):
    need("fused_linear_jsd", impl)
    hs, ws, ht, wt = _heads()
    (gw,) = torch.autograd.grad(polykernel.fused_linear_jsd(hs.detach(), ws, ht, wt, impl=impl), (ws,))
    (gh,) = torch.autograd.grad(polykernel.fused_linear_jsd(hs, ws.detach(), ht, wt, impl=impl), (hs,))
    rg = torch.autograd.grad(polykernel.fused_linear_jsd(hs, ws, ht, wt, impl="torch"), (hs, ws))
    torch.testing.assert_close(gh, rg[0])
    torch.testing.assert_close(gw, rg[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_all_ignored_gives_nan_with_zero_gradients(impl):
    need("fused_linear_jsd", impl)
    hs, ws, ht, wt = _heads()
    loss = polykernel.fused_linear_jsd(hs, ws, ht, wt, torch.full((12,), -100), impl=impl)
    assert loss.isnan() and loss.dtype == torch.float32
    gh, gw = torch.autograd.grad(loss, (hs, ws))
    assert bool((gh == 0).all()) and bool((gw == 0).all())
    loss.detach()
    hs0 = torch.randn(0, 16, requires_grad=True)
    empty = polykernel.fused_linear_jsd(hs0, ws, torch.randn(0, 24), wt, impl=impl)
    assert empty.isnan()
    assert torch.autograd.grad(empty, ws)[0].abs().sum() == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_twice_raises(impl):
    need("fused_linear_jsd", impl)
    hs, ws, ht, wt = _heads()
    loss = polykernel.fused_linear_jsd(hs, ws, ht, wt, impl=impl)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def _bad_case(**change):
    args = {
        "student_hidden": torch.randn(4, 8),
        "student_weight": torch.randn(10, 8),
        "teacher_hidden": torch.randn(4, 6),
        "teacher_weight": torch.randn(10, 6),
        "labels": None,
    }
    kwargs = {k: change.pop(k) for k in ("beta", "ignore_index", "temperature") if k in change}
    args.update(change)
    return tuple(args.values()), kwargs


@pytest.mark.parametrize(
    "change, exc, words",
    [
        ({"student_hidden": torch.randn(4, 8).int()}, OpTypeError, "'student_hidden'"),
        ({"student_hidden": torch.randn(())}, OpArgumentError, "'student_hidden'"),
        ({"student_weight": torch.randn(10, 9)}, OpArgumentError, "'student_weight'"),
        ({"student_weight": torch.randn(10, 8, 1)}, OpArgumentError, "'student_weight'"),
        ({"student_weight": torch.randn(0, 8)}, OpArgumentError, "'student_weight'"),
        ({"student_weight": torch.randn(10, 8, dtype=torch.float64)}, OpTypeError, "'student_weight'"),
        ({"teacher_hidden": torch.randn(5, 6)}, OpArgumentError, "'teacher_hidden'"),
        ({"teacher_hidden": torch.randn(4, 6, device="meta")}, OpArgumentError, "'teacher_weight'"),
        ({"teacher_weight": torch.randn(11, 6)}, OpArgumentError, "'teacher_weight'"),
        ({"teacher_weight": torch.randn(10, 6).half()}, OpTypeError, "'teacher_weight'"),
        ({"labels": torch.zeros(5, dtype=torch.long)}, OpArgumentError, "'labels'"),
        ({"labels": torch.zeros(4)}, OpTypeError, "'labels'"),
        ({"beta": -1.0}, OpArgumentError, "'beta'"),
        ({"ignore_index": "x"}, OpArgumentError, "'ignore_index'"),
        ({"temperature": 0.0}, OpArgumentError, "'temperature'"),
        ({"temperature": float("inf")}, OpArgumentError, "'temperature'"),
        ({"temperature": float("nan")}, OpArgumentError, "'temperature'"),
    ],
)
def test_bad_input_names_op_and_argument(change, exc, words):
    args, kwargs = _bad_case(**change)
    raises_naming(polykernel.fused_linear_jsd, "loss.fused_linear_jsd", args, kwargs, exc, words)


@st.composite
def _cases(draw, dtype):
    n, h, ht, v = (draw(st.sampled_from(x)) for x in ([0, 1, 5, 17], [8, 33], [8, 20], [1, 31, 300]))
    hs = torch.randn(n, h).to(dtype).requires_grad_()
    ws = (torch.randn(v, h) / h**0.5).to(dtype).requires_grad_(draw(st.booleans()))
    args = [hs, ws, torch.randn(n, ht).to(dtype), (torch.randn(v, ht) / ht**0.5).to(dtype)]
    if draw(st.booleans()):
        args.append(torch.randint(0, 5, (n,)).masked_fill(torch.rand(n) < 0.3, -100))
    kwargs = {"beta": draw(st.sampled_from([0.0, 0.5, 1.0])), "temperature": draw(st.sampled_from([0.7, 1.0, 3.0]))}
    return Case(f"{n}x{h}x{v}", tuple(args), kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_parity_property_cpu(impl):
    parity_property("fused_linear_jsd", impl, _cases, 10 if impl != "torch" else 20)


needs_liger_interpreter = pytest.mark.skipif(
    registry.specs_for("fused_linear_jsd")["liger"].missing_modules() != [] or not polykernel.env.triton_interpret(),
    reason="needs liger_kernel and TRITON_INTERPRET=1",
)


@needs_liger_interpreter
def test_liger_adapter_on_the_cases():
    # Liger's whole fused function (its own chunking and JSD kernel, through the interpreter)
    labels = ("1x8x1000", "9x16x2000-allignored", "12x24x1000-beta0-t2", "8x16x1200-teacher-h40", "2x3x16x800-3d")
    cases = [c for c in registry.get_op("fused_linear_jsd").cases("cpu", torch.float32) if c.label in labels]
    assert len(cases) == len(labels)
    for case in cases:  # (a few: the interpreter runs Liger's 4096-wide blocks slowly)
        liger_matches_reference("fused_linear_jsd", case, atol=2e-5)


def test_module():
    student, teacher = torch.nn.Linear(16, 50, bias=False), torch.nn.Linear(32, 50, bias=False)
    loss_fn = pnn.FusedLinearJSDLoss(beta=0.2, temperature=2.0, impl="torch")
    hs, ht = torch.randn(2, 3, 16), torch.randn(2, 3, 32)
    labels = torch.tensor([[1, -100, 2], [3, 4, 5]])
    loss = loss_fn(hs, student.weight, ht, teacher.weight, labels)
    want = polykernel.fused_linear_jsd(hs, student.weight, ht, teacher.weight, labels, beta=0.2, temperature=2.0)
    torch.testing.assert_close(loss, want)
    loss.backward()
    assert student.weight.grad is not None and teacher.weight.grad is None
    assert "beta=0.2, ignore_index=-100, temperature=2.0, impl='torch'" in repr(loss_fn)
    with pytest.raises(OpArgumentError, match=r"FusedLinearJSDLoss.*temperature"):
        pnn.FusedLinearJSDLoss(temperature=-1.0)


def test_compiles_fullgraph():
    hs, ws, ht, wt = _heads()

    @torch.compile(fullgraph=True, backend="eager")
    def f(hs, ws, ht, wt):
        return polykernel.fused_linear_jsd(hs, ws, ht, wt, beta=0.5, temperature=2.0)

    got = f(hs, ws, ht, wt)
    grads = torch.autograd.grad(got, (hs, ws))
    ref = registry.get_op("fused_linear_jsd").reference
    want = ref(hs, ws, ht, wt, None, 0.5, -100, 2.0)
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, torch.autograd.grad(want, (hs, ws))):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    gpu_parity("fused_linear_jsd", dtype)


def test_error_model_makes_no_float64_copy_of_a_head(monkeypatch):
    """The first-call check's error model converts the heads to float64 a block of classes at a
    time (a whole float64 head is 4.2 GB at 128256 x 4096, and it made three), with the bounds of
    one whole block."""
    from polykernel.ops import fused_linear_jsd as flj

    op = registry.get_op("fused_linear_jsd")
    case = op.example((8, 16, 256), torch.float32, "cpu", True)
    weight = case.args[1]

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.shape[-1:] == weight.shape[-1:] and t.dim() == 2:
                    Largest.most = max(Largest.most, t.shape[0])
            return out

    whole = op.error_model(*case.args, **case.kwargs)
    monkeypatch.setattr(flj, "_CLASS_BLOCK", 64)
    with Largest():
        blocks = op.error_model(*case.args, **case.kwargs)
    assert Largest.most <= 64, f"a float64 [{Largest.most}, H] block of a head (the head has {weight.shape[0]} classes)"
    for a, e in zip((*whole.outputs, *whole.grads.values()), (*blocks.outputs, *blocks.grads.values()), strict=True):
        assert a.scale == pytest.approx(e.scale, rel=1e-9) and a.cancel == pytest.approx(e.cancel, rel=1e-9)
