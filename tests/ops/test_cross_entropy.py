"""cross_entropy: parity of every runnable impl with the reference, PyTorch's edge cases, the
out-of-range-target flag, both Triton gradient strategies, and argument errors."""

import os

import pytest
import torch
import torch.nn.functional as F

import polykernel
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.cross_entropy import cases, reference
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("cross_entropy", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("cross_entropy", [impl], device="cpu", dtypes=[dtype])


def test_reference_is_f_cross_entropy():
    # The fp64-evaluated reference is F.cross_entropy's function: equal to fp32 F.cross_entropy
    # within fp32 rounding, for every option.
    x = 3 * torch.randn(16, 700)
    t = torch.randint(0, 700, (16,)).masked_fill(torch.rand(16) < 0.3, -100)
    for kw in ({}, {"label_smoothing": 0.2}, {"reduction": "sum"}, {"reduction": "none", "label_smoothing": 0.5}):
        torch.testing.assert_close(reference(x, t, **kw), F.cross_entropy(x, t, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_and_all_ignored_match_pytorch(impl):
    _need(impl)
    for n, ignored in ((0, False), (5, True)):
        for reduction, want in (("mean", float("nan")), ("sum", 0.0)):
            x = torch.randn(n, 300, requires_grad=True)
            t = torch.full((n,), -100) if ignored else torch.zeros(n, dtype=torch.long)
            loss = polykernel.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1, impl=impl)
            ref = F.cross_entropy(x.detach(), t, reduction=reduction, label_smoothing=0.1)
            assert loss.dtype == torch.float32 and loss.shape == ()
            assert (loss.isnan() and ref.isnan() and want != want) or (loss.item() == ref.item() == want)
            (g,) = torch.autograd.grad(loss, x)
            assert g.shape == x.shape and bool((g == 0).all())  # PyTorch: zero, not NaN


@pytest.mark.parametrize("impl", IMPLS)
def test_logits_are_not_modified(impl):
    _need(impl)
    x = torch.randn(6, 2000, dtype=torch.bfloat16, requires_grad=True)
    before = x.detach().clone()
    loss = polykernel.cross_entropy(x, torch.randint(0, 2000, (6,)), impl=impl)
    loss.backward()
    assert torch.equal(x.detach(), before) and x.grad is not None and not torch.equal(x.grad, torch.zeros_like(x.grad))


def test_torch_impl_row_chunks(monkeypatch):
    # Force many row chunks (a few rows per fp32 temporary): same results as one chunk.
    import polykernel.backends._cross_entropy as tce

    monkeypatch.setattr(tce, "TEMP_BYTES", 3 * 4 * 1000)
    assert tce._step(1000) == 3
    sel = [c for c in cases("cpu", torch.float32) if c.label in ("13x3001-ignored", "11x4999-none-smooth", "8x1000-smooth", "2x3x500-3d")]
    assert len(sel) == 4
    assert_parity("cross_entropy", ["torch"], device="cpu", dtypes=[torch.float32], cases=sel)


def test_triton_out_of_range_target_gives_nan_not_garbage():
    # On CUDA the host does not check the range (a sync); the kernel must flag the row. Call the
    # registered impl directly (the public function refuses this target on the CPU).
    _need("triton")
    from polykernel.backends.triton.cross_entropy import cross_entropy as tri

    x = torch.randn(4, 1000, requires_grad=True)
    t = torch.tensor([3, 1000, -100, -7])
    loss = tri(x, t, -100, 0.0, "none")
    assert loss[1].isnan() and loss[3].isnan() and loss[2] == 0
    torch.testing.assert_close(loss[0], reference(x.detach()[:1], t[:1], reduction="none")[0])
    (g,) = torch.autograd.grad(loss.sum(), x)
    assert g[1].isnan().all() and g[3].isnan().all() and bool((g[2] == 0).all()) and g[0].isfinite().all()
    assert tri(x.detach(), t, -100, 0.0, "mean").isnan()


@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1}, {"softcap": 5.0, "z_loss": 1e-3}], ids=["plain", "smooth", "softcap-z"])
def test_torch_impl_flags_an_out_of_range_target_like_the_kernels(options):
    """The torch impl reads class 0 for an out-of-range target and makes that row's loss and
    gradient NaN, as the kernels do: on a GPU the first-use check runs it first on the caller's
    values, and its gather would otherwise be a device-side assert (here: an IndexError)."""
    from polykernel.backends.torch.cross_entropy import cross_entropy as tce

    x = torch.randn(4, 1000, requires_grad=True)
    t = torch.tensor([3, 1000, -100, -7])
    ls = options.get("label_smoothing", 0.0)
    extra = (None, options.get("softcap"), options.get("z_loss", 0.0))
    loss = tce(x, t, -100, ls, "none", *extra)
    assert loss[1].isnan() and loss[3].isnan() and loss[2] == 0 and loss[0].isfinite()
    want = reference(x.detach()[:1], t[:1], reduction="none", label_smoothing=ls, softcap=extra[1], z_loss=extra[2])[0]
    torch.testing.assert_close(loss[0], want)
    (g,) = torch.autograd.grad(loss.sum(), x)
    assert g[1].isnan().all() and g[3].isnan().all() and bool((g[2] == 0).all()) and g[0].isfinite().all()
    assert tce(x.detach(), t, -100, ls, "mean", *extra).isnan()


def test_torch_fused_linear_impl_flags_an_out_of_range_target():
    from polykernel.backends.torch.fused_linear_cross_entropy import fused_linear_cross_entropy as flce

    h, w = torch.randn(4, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    t = torch.tensor([3, 50, -100, 7])
    assert flce(h.detach(), w.detach(), t, None, -100, 0.0, "none")[1].isnan()
    loss = flce(h, w, t, None, -100, 0.0, "mean")
    assert loss.isnan()
    gh, _gw = torch.autograd.grad(loss, (h, w))
    assert gh[1].isnan().all()


@pytest.mark.gpu
def test_gpu_first_call_with_an_out_of_range_target_keeps_the_cuda_context(tmp_path):
    """With the first-use check on (CUDA's default), the first call of an argument class runs the
    torch impl on the caller's values first: an out-of-range target must give NaN there too, not a
    device-side assert that loses the process's CUDA context (run apart: it would)."""
    import subprocess
    import sys

    script = (
        "import torch, polykernel\n"
        "x = torch.randn(8, 32000, device='cuda', requires_grad=True)\n"
        "t = torch.randint(0, 32000, (8,), device='cuda'); t[5] = 32000\n"
        "for impl in (None, 'torch', 'triton'):\n"
        "    loss = polykernel.cross_entropy(x, t, impl=impl)\n"
        "    (g,) = torch.autograd.grad(loss, x)\n"
        "    assert loss.isnan() and g[5].isnan().all() and g[0].isfinite().all(), impl\n"
        "torch.cuda.synchronize(); print('flagged')\n"
    )
    env = {**os.environ, "POLYKERNEL_VERIFY": "first"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "flagged" in run.stdout, run.stderr[-2000:]


def test_triton_grad_in_forward_strategy(monkeypatch):
    # The alternative strategy (gradient written in the forward, scaled in the backward). In fp32:
    # with bf16/fp16 logits a grad_output != 1 rounds the gradient twice (documented cost).
    _need("triton")
    import polykernel.backends.triton.cross_entropy as tce

    monkeypatch.setattr(tce, "GRAD_IN_FORWARD", True)
    labels = ("13x3001-ignored", "9x2000-allignored", "8x1000-smooth", "11x4999-sum", "2x3x500-3d-none")
    sel = [c for c in cases("cpu", torch.float32) if c.label in labels]
    assert len(sel) == len(labels)
    assert_parity("cross_entropy", ["triton"], device="cpu", dtypes=[torch.float32], cases=sel)
    # grad_output exactly 1 takes the no-scaling path (bf16: one rounding, as the reference)
    x = (3 * torch.randn(5, 700)).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 700, (5,))
    for g in (1.0, 3.0):
        (gi,) = torch.autograd.grad(polykernel.cross_entropy(x, t, impl="triton"), x, torch.tensor(g))
        (gr,) = torch.autograd.grad(reference(x, t), x, torch.tensor(g))
        torch.testing.assert_close(gi, gr, rtol=1e-2 if g == 1.0 else 2e-2, atol=1e-9)
    loss = polykernel.cross_entropy(x, t, impl="triton")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_float64_uses_torch_and_matches_reference():
    x = torch.randn(7, 300, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 300, (7,))
    assert polykernel.explain("cross_entropy", x, t).chosen == "torch"
    loss = polykernel.cross_entropy(x, t, label_smoothing=0.1)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, reference(x, t, label_smoothing=0.1), rtol=1e-12, atol=1e-12)


def test_unbatched_logits():
    x, t = torch.randn(50), torch.tensor(7)
    out = polykernel.cross_entropy(x, t, reduction="none")
    assert out.shape == () and torch.allclose(out, F.cross_entropy(x, t, reduction="none"))


def _bad(*shape, **kw):
    return torch.randn(*shape, **kw)


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        ((_bad(4, 8).int(), torch.zeros(4, dtype=torch.long)), {}, OpTypeError, "'logits'"),
        (([1.0, 2.0], torch.zeros(1, dtype=torch.long)), {}, OpTypeError, "'logits'"),
        ((_bad(()), torch.zeros((), dtype=torch.long)), {}, OpArgumentError, "'logits'"),
        ((_bad(4, 0), torch.zeros(4, dtype=torch.long)), {}, OpArgumentError, "'logits'"),
        ((_bad(4, 8), torch.zeros(4)), {}, OpTypeError, "'target'"),
        ((_bad(4, 8), torch.zeros(4, dtype=torch.int16)), {}, OpTypeError, "'target'"),
        ((_bad(4, 8), torch.zeros(5, dtype=torch.long)), {}, OpArgumentError, "'target'"),
        ((_bad(4, 8), torch.zeros(4, 1, dtype=torch.long)), {}, OpArgumentError, "'target'"),
        ((_bad(4, 8), [0, 1, 2, 3]), {}, OpTypeError, "'target'"),
        ((_bad(4, 8), torch.zeros(4, dtype=torch.long, device="meta")), {}, OpArgumentError, "'target'"),
        ((_bad(4, 8), torch.tensor([0, 1, 8, 2])), {}, OpArgumentError, "'target'"),
        ((_bad(4, 8), torch.tensor([0, -1, 2, 2])), {}, OpArgumentError, "'target'"),
        ((_bad(4, 8), torch.tensor([0, 1, -100, 2])), {"ignore_index": 3}, OpArgumentError, "'target'"),
        ((_bad(4, 8), torch.zeros(4, dtype=torch.long)), {"reduction": "avg"}, OpArgumentError, "'reduction'"),
        ((_bad(4, 8), torch.zeros(4, dtype=torch.long)), {"reduction": None}, OpArgumentError, "'reduction'"),
        ((_bad(4, 8), torch.zeros(4, dtype=torch.long)), {"label_smoothing": -0.1}, OpArgumentError, "'label_smoothing'"),
        ((_bad(4, 8), torch.zeros(4, dtype=torch.long)), {"label_smoothing": 1.5}, OpArgumentError, "'label_smoothing'"),
        ((_bad(4, 8), torch.zeros(4, dtype=torch.long)), {"label_smoothing": float("nan")}, OpArgumentError, "'label_smoothing'"),
        ((_bad(4, 8), torch.zeros(4, dtype=torch.long)), {"label_smoothing": True}, OpArgumentError, "'label_smoothing'"),
        ((_bad(4, 8), torch.zeros(4, dtype=torch.long)), {"ignore_index": 1.0}, OpArgumentError, "'ignore_index'"),
    ],
)
def test_bad_input_names_op_and_argument(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        polykernel.cross_entropy(*args, **kwargs)
    assert "loss.cross_entropy" in str(info.value) and words in str(info.value)


_M = {"device": "meta"}  # meta tensors stand in for a GPU: off the CPU validation is per class


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        ((_bad(4, 8, **_M).int(), torch.zeros(4, dtype=torch.long, **_M)), {}, OpTypeError, "'logits'"),
        ((_bad(4, 8, **_M), torch.zeros(4, **_M)), {}, OpTypeError, "'target'"),
        ((_bad(4, 8, **_M), torch.zeros(4, dtype=torch.int16, **_M)), {}, OpTypeError, "'target'"),
        ((_bad(4, 8, **_M), torch.zeros(5, dtype=torch.long, **_M)), {}, OpArgumentError, "'target'"),
        ((_bad(4, 8, **_M), torch.zeros(4, 1, dtype=torch.long, **_M)), {}, OpArgumentError, "'target'"),
        ((_bad(4, 8, **_M), torch.zeros(4, dtype=torch.long, **_M)), {"reduction": "avg"}, OpArgumentError, "'reduction'"),
        ((_bad(4, 8, **_M), torch.zeros(4, dtype=torch.long, **_M)), {"label_smoothing": 1.5}, OpArgumentError, "'label_smoothing'"),
        ((_bad(4, 8, **_M), torch.zeros(4, dtype=torch.long, **_M)), {"label_smoothing": True}, OpArgumentError, "'label_smoothing'"),
        ((_bad(4, 8, **_M), torch.zeros(4, dtype=torch.long, **_M)), {"ignore_index": 1.0}, OpArgumentError, "'ignore_index'"),
    ],
)
def test_off_the_cpu_a_bad_call_after_good_ones_is_rejected_every_time(args, kwargs, exc, words):
    good = (_bad(4, 8, **_M), torch.zeros(4, dtype=torch.long, **_M))
    for _ in range(2):  # a decision and its guard for the valid class
        polykernel.cross_entropy(*good)
    for _ in range(2):
        with pytest.raises(exc) as info:
            polykernel.cross_entropy(*args, **kwargs)
        assert "loss.cross_entropy" in str(info.value) and words in str(info.value)


def test_on_the_cpu_the_target_range_is_checked_on_every_call():
    x, good, bad = torch.randn(4, 8), torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 8, 3])
    for _ in range(2):
        polykernel.cross_entropy(x, good)
    for _ in range(2):  # same argument class as the good calls: the data decides
        with pytest.raises(OpArgumentError, match="out of range"):
            polykernel.cross_entropy(x, bad)


def test_ignore_index_inside_range_is_accepted():
    x, t = torch.randn(3, 8), torch.tensor([3, 1, 3])
    torch.testing.assert_close(polykernel.cross_entropy(x, t, ignore_index=3), F.cross_entropy(x, t, ignore_index=3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    # includes V = 128256 and 256000 (and 262144 with large logits)
    from _gpu_gates import fewer_rows

    large = fewer_rows(cases("cuda", dtype, large=True))  # float64 reference <= 1 GiB per [N, V]
    assert_parity("cross_entropy", device="cuda", dtypes=[dtype], cases=large)


@pytest.mark.gpu
def test_gpu_out_of_range_target_is_flagged(monkeypatch):
    # No first-use check: it runs the torch impl on a copy of the call first, whose gather of the
    # out-of-range target is a device-side assert (the CUDA context, and every later test of the
    # process, would be lost); the kernel's own flagging is what this checks.
    monkeypatch.setenv("POLYKERNEL_VERIFY", "off")
    x = torch.randn(8, 128256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 128256, (8,), device="cuda")
    t[5] = 128256
    loss = polykernel.cross_entropy(x, t, impl="triton")  # no host check on CUDA: the kernel flags it
    assert loss.isnan()
    (g,) = torch.autograd.grad(loss, x)
    assert g[5].isnan().all()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_positive_inf_logit_gives_the_references_nan(impl):
    # F.cross_entropy (the reference) gives NaN for a row with a +inf logit (log_softmax's
    # inf - inf); the torch impl's logsumexp gave +inf there until the hypothesis suite found it.
    x = torch.randn(3, 40)
    x[1, 7] = float("inf")
    t = torch.tensor([0, 2, 5])
    want = reference(x, t, reduction="none")
    got = polykernel.cross_entropy(x, t, reduction="none", impl=impl)
    assert torch.isnan(want[1]) and torch.isnan(got[1])
    torch.testing.assert_close(got[[0, 2]], want[[0, 2]])


def test_scale_grads_applies_the_cotangent_in_place():
    # the loss backwards scale gradients computed for grad_output = 1 by the real g
    from polykernel.backends._cross_entropy import scale_grads_

    a = torch.randn(4, 3, dtype=torch.bfloat16)
    b = torch.randn(5)
    want_a, want_b = a.float() * 0.3, b * 0.3
    scale_grads_(torch.tensor(0.3), a, None, b)
    torch.testing.assert_close(a.float(), want_a, atol=0, rtol=2**-8)  # one bf16 rounding of a·g
    torch.testing.assert_close(b, want_b)
    kept = a.clone()
    scale_grads_(torch.tensor(1.0), a)
    assert torch.equal(a, kept)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("value", [1.0, 0.37])
def test_fused_linear_ce_in_a_cuda_graph_scales_like_eager(impl, value):
    """Under capture the cotangent cannot be read on the host, so the gradients (computed for
    grad_output = 1) are multiplied by the 0-d device tensor g. The Triton impl does it in fp32
    with g as stored (backends/triton/_scale.py): bit for bit eager's. The torch impl's
    ``t.mul_(g)`` gets TensorIterator's bf16 cast of g first: within a rounding of g for g != 1."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    h = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 1000, (300,), device="cuda")
    g = torch.full((), value, device="cuda")

    def step():
        loss = polykernel.fused_linear_cross_entropy(h, w, t, impl=impl)
        return torch.autograd.grad(loss, (h, w), g)

    want = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up outside capture (compiles, plans)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        if value == 1.0 or impl == "triton":
            assert torch.equal(a, b)
        else:  # one bf16 rounding of g and one of the product: within 2 ulp of bf16
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n", [1, 4097, 9000])
def test_device_scale_equals_eager_host_scale(dtype, n):
    """The Triton cotangent multiply used under capture (g read on the device) rounds like eager
    CUDA's ``t.mul_(g.item())``, whose host number stays fp32 (opmath): fp32 product of t and g,
    one rounding, bit for bit. (torch's CPU kernel rounds the number to bf16 first, so it is not
    the reference here; on the H200 the capture test above checks the match with CUDA eager.)"""
    if "triton" not in runnable_impls("cross_entropy", "cpu", torch.float32):
        pytest.skip("triton not runnable on the CPU here")
    from polykernel.backends.triton._scale import scale_on_device_

    t = torch.randn(n).to(dtype)
    for g in (torch.tensor(0.37), torch.tensor(0.37, dtype=torch.bfloat16), torch.tensor(3.0e-5, dtype=torch.float64)):
        want = (t.float() * g.float()).to(dtype)
        got = t.clone()
        scale_on_device_(got, g)
        if dtype == torch.bfloat16:  # the CPU interpreter rounds fp32 -> bf16 toward zero: one ulp
            torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
        else:
            assert torch.equal(got, want), (g, dtype)
