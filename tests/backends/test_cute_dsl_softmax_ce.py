"""cute_dsl softmax and cross_entropy (issue 8, F2): registration, gating reasons, predicates and
lazy imports on any machine; compile-only checks where ``cutlass`` is installed (sm_90a, no GPU
needed); parity with the reference on the H200 (``-m gpu``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import polykernel
from _cute_helpers import (
    DTYPES,
    IMPORTED_KERNEL_MODULES,
    assert_imports_no_cutlass,
    assert_parity,
    assert_registered_and_gated,
    cute,
    runnable,
)
from _gpu_gates import gpu_tests_need
from polykernel.backends.cute_dsl import _predicates as pred
from polykernel.core import registry
from polykernel.core.op import Case

_needs_cute_dsl = gpu_tests_need("cute_dsl", "softmax")  # its GPU tests skip where cute_dsl is not staged

OPS = ("softmax", "cross_entropy")


@pytest.mark.parametrize("op", OPS)
def test_registered_and_gated(op):
    assert_registered_and_gated(op)


@pytest.mark.parametrize("op", OPS)
def test_arch_gate(op):
    from polykernel.spec import PlatformInfo

    spec = registry.specs_for(op)["cute_dsl"]
    (cap,) = spec.capabilities
    assert cap.unmet_reason(PlatformInfo("cuda", 0, (8, 0), "A100")) == "sm_80 < required sm_90"
    assert cap.unmet_reason(PlatformInfo("cuda", 0, (9, 0), "H200")) is None


def _sm(dtype: str, n: int | None) -> SimpleNamespace:
    return SimpleNamespace(dtype=dtype, n=n)


def _ce(dtype: str, v: int | None) -> SimpleNamespace:
    return SimpleNamespace(dtype=dtype, n_classes=v, label_smoothing=0.0)


def test_softmax_predicate():
    assert pred.softmax(_sm("bfloat16", 32768)) is None
    assert pred.softmax(_sm("float32", 4)) is None
    assert pred.softmax(_sm("float32", None)) is None  # no argument class yet: decided per call
    assert "multiple of 8" in pred.softmax(_sm("bfloat16", 4100))
    assert "multiple of 4" in pred.softmax(_sm("float32", 4101))
    assert "N = 0" in pred.softmax(_sm("float16", 0))
    assert "N <= 32768" in pred.softmax(_sm("bfloat16", 32776))


def test_cross_entropy_predicate():
    assert pred.cross_entropy(_ce("bfloat16", 128256)) is None
    assert pred.cross_entropy(_ce("float32", 256000)) is None
    assert "V = 3001" in pred.cross_entropy(_ce("float32", 3001))
    assert "multiple of 8" in pred.cross_entropy(_ce("bfloat16", 50257))
    assert "V <= " in pred.cross_entropy(_ce("float32", (1 << 20) + 4))


def _cute_row(op: str, *args: torch.Tensor) -> dict:
    return {r["name"]: r for r in polykernel.explain(op, *args).impls}["cute_dsl"]


@pytest.mark.parametrize(
    ("dtype", "n", "preferred"),
    [
        (torch.bfloat16, 32768, True),  # measured: fwd 3.41 vs triton 3.23, fwd+bwd 3.63 vs 3.53
        (torch.float16, 16384, True),  # the threshold (a guess between the two measured points)
        (torch.bfloat16, 4096, False),  # measured: triton 3.81 vs 3.30
        (torch.float32, 32768, False),  # fp32 unmeasured: static rank
    ],
)
def test_softmax_measured_rank(dtype, n, preferred):
    row = _cute_row("softmax", torch.randn(2, n, dtype=dtype))
    assert (row["rank"] < registry.specs_for("softmax")["triton"].rank) == preferred
    assert (row["rank_reason"] is not None) == preferred
    if preferred:
        assert "measured at N = 32768 only" in row["rank_reason"]


@pytest.mark.parametrize(
    ("dtype", "v", "preferred"),
    [
        (torch.bfloat16, 128256, True),  # measured: fwd 0.487 vs 0.595 ms, fwd+bwd 1.512 vs 1.613
        (torch.float16, 32768, True),
        (torch.bfloat16, 4096, False),  # unmeasured: behind Triton
        (torch.float32, 128256, False),  # fp32 unmeasured
    ],
)
def test_cross_entropy_measured_rank(dtype, v, preferred):
    row = _cute_row("cross_entropy", torch.randn(2, v, dtype=dtype), torch.zeros(2, dtype=torch.long))
    assert (row["rank"] < registry.specs_for("cross_entropy")["triton"].rank) == preferred
    assert (row["rank_reason"] is not None) == preferred
    if preferred:
        assert "measured at V = 128256 only" in row["rank_reason"]


def test_forced_on_cpu_names_the_reason():
    with pytest.raises(polykernel.ImplNotAvailableError, match=r"needs a CUDA device|not installed"):
        polykernel.softmax(torch.randn(2, 64), impl="cute_dsl")


_SCRIPT = (
    r"""
import json, sys, torch, polykernel
x = torch.randn(4, 64, requires_grad=True)
t = torch.randint(0, 64, (4,))
(polykernel.softmax(x).sum() + polykernel.cross_entropy(x, t)).backward()
for op in ("softmax", "cross_entropy"):
    str(polykernel.explain(op, device="cpu", dtype=torch.bfloat16))
"""
    + IMPORTED_KERNEL_MODULES
)


@pytest.mark.parametrize("env", [{}, {"POLYKERNEL_IMPL": "cute_dsl"}])
def test_cpu_use_imports_no_cutlass(env):
    """On the CPU the ops run (torch) and neither cutlass nor our kernel modules are imported."""
    assert_imports_no_cutlass(_SCRIPT, env)


# -- compile-only: where cutlass is installed, kernels compile for sm_90a on any machine ------------


@pytest.mark.parametrize("dtype,n", [("bfloat16", 32768), ("float32", 32768), ("float16", 4104), ("float32", 4)])
def test_softmax_compiles(dtype, n):
    cute()
    from polykernel.backends.cute_dsl import _softmax_kernel as k

    f = k.compile_forward(dtype, n)
    assert k.compile_forward(dtype, n) is f  # cached: one compile per (dtype, N)
    k.compile_backward(dtype, n)


@pytest.mark.parametrize("dtype,v,tdtype", [("bfloat16", 128256, "int64"), ("float32", 1000, "int32"), ("float16", 8, "int64")])
def test_cross_entropy_compiles(dtype, v, tdtype):
    cute()
    from polykernel.backends.cute_dsl import _ce_kernel as k

    for grad, smooth, per_row in [(False, False, False), (False, True, False), (True, True, False), (True, False, True)]:
        f = k.compile_ce(dtype, v, tdtype, grad, smooth, per_row)
        assert k.compile_ce(dtype, v, tdtype, grad, smooth, per_row) is f


def _row_strides_of_compile(monkeypatch, build) -> list:
    """The row stride of each 2-D fake tensor that ``build()`` hands to ``cute.compile``."""
    import cutlass.cute as cute_mod

    seen = []

    def capture(_kernel, *args, **_kw):
        seen.extend(a.stride[0] for a in args if len(getattr(a, "shape", ())) == 2)

    monkeypatch.setattr(cute_mod, "compile", capture)
    build()
    return seen


def test_row_offsets_are_64_bit(monkeypatch):
    """The [M, N] operands are compiled with a runtime int64 row stride. With the static N of a
    compact layout, CuTeDSL computes ``row * N + column`` in 32 bits (sm_90a PTX: ``mad.lo.s32
    %r, %ctaid, 128256, ...``; softmax ``shl.b32 %ctaid, 15``), which wraps past 2^32 elements and
    reads and writes an earlier row: cross_entropy at V = 128256 from row 33488 on, softmax at N =
    32768 from row 131072 on (both reachable on an H200)."""
    cute()
    from polykernel.backends.cute_dsl import _ce_kernel as ce
    from polykernel.backends.cute_dsl import _softmax_kernel as sm

    builds = [
        lambda: ce.compile_ce.__wrapped__("bfloat16", 128256, "int64", False, False, False),
        lambda: ce.compile_ce.__wrapped__("bfloat16", 128256, "int64", True, False, True),
        lambda: sm.compile_forward.__wrapped__("bfloat16", 32768),
        lambda: sm.compile_backward.__wrapped__("bfloat16", 32768),
    ]
    for build in builds:
        strides = _row_strides_of_compile(monkeypatch, build)
        assert strides and all(not isinstance(st, int) and getattr(st, "width", 0) == 64 for st in strides), strides


# -- H200 parity (-m gpu) ----------------------------------------------------------------------------


def _softmax_cases(dtype: torch.dtype) -> list[Case]:
    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device="cuda")).to(dtype).requires_grad_()

    masked = 3 * torch.randn(6, 4096, device="cuda")
    masked[:, :3000] = float("-inf")
    return [
        Case("1x8", (t(1, 8),)),
        Case("0x4096", (t(0, 4096),)),
        Case("3x4104-tail", (t(3, 4104),)),
        Case("2x5x1032-3d", (t(2, 5, 1032),)),
        Case("4x2048-logits-1e4", (t(4, 2048, scale=1e4),)),
        Case("6x4096-masked", (masked.to(dtype).requires_grad_(),)),
        Case("9x2048-rowstrided", (t(18, 2048)[::2],)),
        Case("7x512-colstrided", (t(7, 1024)[:, ::2],)),
        Case("8x20000-mid", (t(8, 20000),)),
        Case("64x32768", (t(64, 32768),)),
        Case("1000x4096", (t(1000, 4096),)),
    ]


def _ce_cases(dtype: torch.dtype) -> list[Case]:
    def x(*shape: int, scale: float = 3.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device="cuda")).to(dtype).requires_grad_()

    def t(v: int, *shape: int, ignored: float = 0.0) -> torch.Tensor:
        out = torch.randint(0, v, shape, device="cuda")
        return out.masked_fill(torch.rand(shape, device="cuda") < ignored, -100)

    return [
        Case("1x8", (x(1, 8), t(8, 1))),
        Case("0x1000", (x(0, 1000), t(1000, 0))),
        Case("0x1000-none", (x(0, 1000), t(1000, 0)), {"reduction": "none"}),
        Case("13x3000-ignored", (x(13, 3000), t(3000, 13, ignored=0.3))),
        Case("9x2000-allignored", (x(9, 2000), t(2000, 9, ignored=1.0))),
        Case("8x1000-smooth", (x(8, 1000), t(1000, 8, ignored=0.25)), {"label_smoothing": 0.1}),
        Case("8x1000-smooth1-sum", (x(8, 1000), t(1000, 8)), {"label_smoothing": 1.0, "reduction": "sum"}),
        Case("11x5000-none-smooth", (x(11, 5000), t(5000, 11, ignored=0.2)), {"reduction": "none", "label_smoothing": 0.2}),
        Case("2x3x504-3d", (x(2, 3, 504), t(504, 2, 3))),
        Case("6x1000-ignore7", (x(6, 1000), torch.tensor([7, 1, 7, 999, 0, 7], device="cuda")), {"ignore_index": 7}),
        Case("7x1504-rowstrided", (x(14, 1504)[::2], t(1504, 7))),
        Case("5x1200-colstrided", (x(5, 2400)[:, ::2], t(1200, 5)), {"label_smoothing": 0.05}),
        Case("4x1000-int32", (x(4, 1000), t(1000, 4).int())),
        Case("3x40000-long", (x(3, 40000, scale=5.0), t(40000, 3)), {"label_smoothing": 0.1}),
        Case("256x128256", (x(256, 128256), t(128256, 256, ignored=0.05))),
        Case("64x262144-sum", (x(64, 262144, scale=10.0), t(262144, 64)), {"reduction": "sum"}),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_parity_gpu(dtype):
    assert_parity("softmax", runnable("softmax", _softmax_cases(dtype)), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_parity_gpu_op_cases(dtype):
    """The op's own cases (awkward shapes), where the predicate admits them."""
    cases = registry.get_op("softmax").cases("cuda", dtype, large=True)
    assert_parity("softmax", runnable("softmax", cases), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_parity_gpu(dtype):
    assert_parity("cross_entropy", runnable("cross_entropy", _ce_cases(dtype)), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_grad_output_not_one_gpu(reduction, dtype):
    """grad_output != 1 (a scalar, or an expanded one for "none": stride 0) against float64 autograd.

    Each dlogit is computed in fp32 and rounded once, so it is within one rounding of the exact
    value (plus fp32 noise): |err| <= u·|g_ref| + (a few fp32 ulps of the largest dlogit).
    """
    x = (3 * torch.randn(33, 4096, device="cuda")).to(dtype).requires_grad_()
    t = torch.randint(0, 4096, (33,), device="cuda").masked_fill(torch.rand(33, device="cuda") < 0.1, -100)
    loss = polykernel.cross_entropy(x, t, reduction=reduction, impl="cute_dsl")
    (g,) = torch.autograd.grad(3.0 * loss.sum(), x)
    x64 = x.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x64, t, reduction=reduction)
    (g_ref,) = torch.autograd.grad(3.0 * ref.sum(), x64)
    torch.testing.assert_close(loss.double(), ref, atol=1e-4 * (33 if reduction == "sum" else 1), rtol=1e-4)
    u = torch.finfo(dtype).eps / 2  # one rounding to nearest
    err = (g.double() - g_ref).abs()
    bound = u * g_ref.abs() + 1e-5 * g_ref.abs().max() + torch.finfo(dtype).tiny
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"


@pytest.mark.gpu
def test_cross_entropy_out_of_range_target_is_nan(monkeypatch):
    # No first-use check: it runs the torch impl on a copy of the call first, whose gather of the
    # out-of-range target is a device-side assert (the CUDA context, and every later test of the
    # process, would be lost); the kernel's own NaN is what this checks.
    monkeypatch.setenv("POLYKERNEL_VERIFY", "off")
    x = torch.randn(3, 1000, device="cuda", requires_grad=True)
    t = torch.tensor([1, 5000, 2], device="cuda")
    loss = polykernel.cross_entropy(x, t, reduction="none", impl="cute_dsl")
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()
    (g,) = torch.autograd.grad(loss.sum(), x)
    assert torch.isnan(g[1]).all() and torch.isfinite(g[[0, 2]]).all()


# -- past 2^32 elements: the rows the 32-bit row offset reached wrongly (~17 GB each) --------------


@pytest.mark.gpu
def test_cross_entropy_past_2_32_elements_gpu(monkeypatch):
    """[33500, 128256] bf16 logits (2^32 elements end at row 33487): the last rows' loss and
    gradient match torch's on those rows alone (they read and wrote rows near the start before)."""
    monkeypatch.setenv("POLYKERNEL_VERIFY", "off")  # no full-size torch copy of the call: the tail is checked here
    n, v = 33500, 128256
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    loss = polykernel.cross_entropy(x, t, reduction="none", impl="cute_dsl")
    (g,) = torch.autograd.grad(loss.sum(), x)
    tail = slice(n - 8, n)
    x_ref = x.detach()[tail].float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x_ref, t[tail], reduction="none")
    (g_ref,) = torch.autograd.grad(ref.sum(), x_ref)
    torch.testing.assert_close(loss[tail].float(), ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(g[tail].float(), g_ref, atol=2e-3, rtol=2e-2)


@pytest.mark.gpu
def test_softmax_past_2_32_elements_gpu(monkeypatch):
    """[131080, 32768] bf16 (2^32 elements end at row 131071): the last rows match torch's."""
    monkeypatch.setenv("POLYKERNEL_VERIFY", "off")
    m, n = 131080, 32768
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    y = polykernel.softmax(x, impl="cute_dsl")
    tail = slice(m - 8, m)
    torch.testing.assert_close(y[tail].float(), torch.softmax(x[tail].float(), -1), atol=1e-5, rtol=2e-2)
