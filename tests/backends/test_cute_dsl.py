"""cute_dsl rms_norm and layer_norm (issue 8, F1): registration, gating reasons, predicates and lazy
imports on any machine; compile-only checks where ``cutlass`` is installed (sm_90a, no GPU needed);
parity with the float64 reference on the H200 (``-m gpu``: fwd and bwd, fp32/bf16/fp16, awkward
shapes, long rows over a cluster, CUDA-graph capture, one compile per key)."""

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
from polykernel.backends.cute_dsl import _gates as gates
from polykernel.core import registry
from polykernel.core.op import Case

_needs_cute_dsl = gpu_tests_need("cute_dsl", "rms_norm")  # its GPU tests skip where cute_dsl is not staged

OPS = ("rms_norm", "layer_norm")


@pytest.mark.parametrize("op", OPS)
def test_registered_and_gated(op):
    spec = assert_registered_and_gated(op)
    assert spec.deterministic  # dW/dB from per-CTA partials, no atomics


@pytest.mark.parametrize("op", OPS)
def test_arch_gate(op):
    from polykernel.spec import PlatformInfo

    (cap,) = registry.specs_for(op)["cute_dsl"].capabilities
    assert cap.unmet_reason(PlatformInfo("cuda", 0, (8, 0), "A100")) == "sm_80 < required sm_90"
    assert cap.unmet_reason(PlatformInfo("cuda", 0, (9, 0), "H200")) is None
    assert cap.unmet_reason(PlatformInfo("cuda", 0, (10, 0), "B200")) is None


def _rms(dtype: str, n: int | None, weight_dtype: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(dtype=dtype, n=n, weight_dtype=weight_dtype or dtype, casting="fp32", offset=0.0)


def _ln(dtype: str, n: int | None, weight_dtype: str | None = None, bias_dtype: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(dtype=dtype, n=n, weight_dtype=weight_dtype, bias_dtype=bias_dtype)


def test_rms_norm_predicate():
    assert gates.rms_norm(_rms("bfloat16", 4096)) is None
    assert gates.rms_norm(_rms("bfloat16", 262144)) is None
    assert gates.rms_norm(_rms("float32", 4, "bfloat16")) is None
    assert gates.rms_norm(_rms("float16", 0)) is None  # empty rows: no launch
    assert gates.rms_norm(_rms("float32", None)) is None  # no argument class yet
    assert "N divisible by 8" in gates.rms_norm(_rms("bfloat16", 4100))
    assert "N divisible by 4" in gates.rms_norm(_rms("float32", 70001))
    assert "N <= 262144" in gates.rms_norm(_rms("bfloat16", 262152))
    assert "float64" in gates.rms_norm(_rms("float64", 64))
    assert "weight" in gates.rms_norm(_rms("float32", 64, "float64"))


def test_layer_norm_predicate():
    assert gates.layer_norm(_ln("bfloat16", 4096, "bfloat16", "bfloat16")) is None
    assert gates.layer_norm(_ln("float16", 768)) is None  # no affine parameters
    assert gates.layer_norm(_ln("bfloat16", 5120, "float32", None)) is None
    assert "N divisible by 8" in gates.layer_norm(_ln("bfloat16", 33))
    assert "bias" in gates.layer_norm(_ln("float32", 64, None, "float64"))


def test_forced_on_cpu_names_the_reason():
    with pytest.raises(polykernel.ImplNotAvailableError, match=r"needs a CUDA device|not installed"):
        polykernel.rms_norm(torch.randn(2, 64), torch.ones(64), impl="cute_dsl")
    with pytest.raises(polykernel.ImplNotAvailableError, match=r"needs a CUDA device|not installed"):
        polykernel.layer_norm(torch.randn(2, 64), impl="cute_dsl")


_SCRIPT = (
    r"""
import json, sys, torch, polykernel
x = torch.randn(4, 64, requires_grad=True)
w = torch.ones(64, requires_grad=True)
(polykernel.rms_norm(x, w).sum() + polykernel.layer_norm(x, w, w).sum()).backward()
for op in ("rms_norm", "layer_norm"):
    str(polykernel.explain(op, device="cpu", dtype=torch.bfloat16))
"""
    + IMPORTED_KERNEL_MODULES
)


@pytest.mark.parametrize("env", [{}, {"POLYKERNEL_IMPL": "cute_dsl"}])
def test_cpu_use_imports_no_cutlass(env):
    """On the CPU the norms run (torch) and neither cutlass nor our kernel modules are imported."""
    assert_imports_no_cutlass(_SCRIPT, env)


# -- compile-only: where cutlass is installed, kernels compile for sm_90a on any machine ------------


def test_row_config():
    cute()
    from polykernel.backends.cute_dsl._common import MAX_CLUSTER, row_config

    for bits in (16, 32):
        for n in (8, 64, 1000, 4096, 16384, 16392, 65536, 131072, 262144):
            if n * bits % 128:
                continue
            cfg = row_config(n, bits)
            # the CTAs of a row cover it, each thread holds at most 32 elements, a CTA <= 512 threads
            assert cfg.tile_n * cfg.cluster >= n
            assert cfg.vecs * cfg.vec <= 32 and cfg.threads <= 512 and cfg.cluster <= MAX_CLUSTER
            assert cfg.rows * cfg.threads_per_row == cfg.threads
    assert row_config(262144, 16).cluster == 16
    assert row_config(4096, 16).cluster == 1
    with pytest.raises(ValueError, match="cluster"):
        row_config(2 * 262144, 16)


def test_compile_cache_builds_once():
    cute()
    from polykernel.backends.cute_dsl import _common as common

    calls = []
    key = ("test", object())
    first = common.compiled(key, lambda: calls.append(1) or "fn")
    assert common.compiled(key, lambda: calls.append(1) or "other") == first == "fn"
    assert calls == [1]


@pytest.mark.parametrize(
    "dtype,wdtype,n,layer,llama",
    [
        ("bfloat16", "bfloat16", 4096, False, False),
        ("float16", "float32", 1032, False, True),  # mixed parameter dtype, llama casting
        ("float32", "float32", 4, False, False),  # one vector, many rows per CTA
        ("bfloat16", "bfloat16", 65536, False, False),  # cluster of 8
        ("float32", "float32", 262144, False, False),  # cluster of 16, dW in shared memory
        ("bfloat16", "bfloat16", 4096, True, False),
        ("float16", None, 768, True, False),  # no affine parameters
        ("bfloat16", "float32", 131072, True, False),
    ],
)
def test_norm_kernels_compile(dtype, wdtype, n, layer, llama):
    cute()
    import cutlass

    from polykernel.backends.cute_dsl import _norms

    dt = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
    w = None if wdtype is None else dt[wdtype]
    assert _norms.compile_fwd(dt[dtype], w, w if layer else None, n, layer, llama) is not None
    assert _norms.compile_bwd(dt[dtype], w, n, layer, llama, w is not None, layer and w is not None) is not None


# -- H200 parity (-m gpu) ----------------------------------------------------------------------------


def _t(*shape: int, dtype: torch.dtype, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, device="cuda") + shift).to(dtype).requires_grad_()


def _p(n: int, dtype: torch.dtype, base: float = 1.0) -> torch.Tensor:
    return (base + 0.1 * torch.randn(n, device="cuda")).to(dtype).requires_grad_()


def _rms_cases(dtype: torch.dtype) -> list[Case]:
    t = lambda *s: _t(*s, dtype=dtype)
    return [
        Case("1x8", (t(1, 8), _p(8, dtype))),
        Case("0x4096", (t(0, 4096), _p(4096, dtype))),
        Case("300x64-rows-per-cta", (t(300, 64), _p(64, dtype))),
        Case("33x1032-tail", (t(33, 1032), _p(1032, dtype))),  # last vectors of a thread masked
        Case("2x5x4096-3d-gemma", (t(2, 5, 4096), _p(4096, dtype, 0.0)), {"offset": 1.0}),
        Case("9x4096-llama", (t(9, 4096), _p(4096, dtype)), {"casting": "llama"}),
        Case("7x2048-fp32w", (t(7, 2048), _p(2048, torch.float32))),
        Case("9x2048-rowstrided", (t(18, 2048)[::2], _p(2048, dtype))),
        Case("5x1024-colstrided", (t(5, 2048)[:, ::2], _p(2048, dtype)[::2])),
        Case("4x4096-misaligned", (t(4, 4104)[:, 4:4100], _p(4104, dtype)[4:4100])),  # 8-byte offsets: copied
        Case("3x4096-odd-row-stride", (t(3, 4100)[:, :4096], _p(4096, dtype))),  # stride not 16 bytes: copied
        Case("2000x16384", (t(2000, 16384), _p(16384, dtype))),
        Case("5x16392-cluster-tail", (t(5, 16392), _p(16392, dtype))),  # 2 CTAs, second nearly empty
        Case("300x32768-cluster2", (t(300, 32768), _p(32768, dtype))),
        Case("70x65544-cluster", (t(70, 65544), _p(65544, dtype)), {"casting": "llama"}),
        Case("3x131072", (t(3, 131072), _p(131072, dtype))),
        Case("64x262144", (t(64, 262144), _p(262144, dtype))),
        Case("1x262144-gemma", (t(1, 262144), _p(262144, dtype, 0.0)), {"offset": 1.0}),
    ]


def _ln_cases(dtype: torch.dtype) -> list[Case]:
    t = lambda *s, shift=0.0: _t(*s, dtype=dtype, shift=shift)
    p = lambda n, pd=dtype: _p(n, pd)
    b = lambda n, pd=dtype: _p(n, pd, 0.0)
    return [
        Case("1x8", (t(1, 8), p(8), b(8))),
        Case("0x4096", (t(0, 4096), p(4096), b(4096))),
        Case("300x64", (t(300, 64), p(64), b(64))),
        Case("33x1032-shifted", (t(33, 1032, shift=40.0), p(1032), b(1032))),
        Case("8x768-no-affine", (t(8, 768), None, None)),
        Case("6x4096-weight-only", (t(6, 4096), p(4096), None)),
        Case("7x4096-bias-only", (t(7, 4096), None, b(4096))),
        Case("5x5120-fp32-params", (t(5, 5120), p(5120, torch.float32), b(5120, torch.float32))),
        Case("9x2048-rowstrided", (t(18, 2048)[::2], p(2048), b(2048))),
        Case("2000x4096", (t(2000, 4096), p(4096), b(4096))),
        Case("5x16392-cluster-tail-shifted", (t(5, 16392, shift=40.0), p(16392), b(16392))),
        Case("70x65544", (t(70, 65544), p(65544), b(65544))),
        Case("8x262144", (t(8, 262144), p(262144), b(262144))),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_parity_gpu(dtype):
    assert_parity("rms_norm", runnable("rms_norm", _rms_cases(dtype)), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_parity_gpu_op_cases(dtype):
    """The op's own cases (awkward shapes, large ones), where the predicate admits them."""
    assert_parity("rms_norm", runnable("rms_norm", registry.get_op("rms_norm").cases("cuda", dtype, large=True)), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_parity_gpu(dtype):
    assert_parity("layer_norm", runnable("layer_norm", _ln_cases(dtype)), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_parity_gpu_op_cases(dtype):
    assert_parity("layer_norm", runnable("layer_norm", registry.get_op("layer_norm").cases("cuda", dtype, large=True)), dtype)


@pytest.mark.gpu
def test_norms_compile_once_per_key():
    """A new row count reuses the compiled kernel (M is symbolic): no second compile per key."""
    from polykernel.backends.cute_dsl import _common as common

    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    polykernel.rms_norm(torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16), w, impl="cute_dsl")
    before = common.compile_count
    for m in (1, 5, 4097):
        polykernel.rms_norm(torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16), w, impl="cute_dsl")
    assert common.compile_count == before


@pytest.mark.gpu
@pytest.mark.parametrize("op,n", [("rms_norm", 4096), ("rms_norm", 131072), ("layer_norm", 4096)])
def test_norms_under_cuda_graph(op, n):
    """Launches follow torch's current stream (TVM-FFI env stream): capture and replay match eager."""
    x = torch.randn(8, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    fn = getattr(polykernel, op)
    eager = fn(x, w, impl="cute_dsl")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x, w, impl="cute_dsl")  # warm (compile outside capture)
        with torch.cuda.graph(graph, stream=stream):
            out = fn(x, w, impl="cute_dsl")
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fn(x, w, impl="cute_dsl"), rtol=0, atol=0)
    assert not torch.equal(out, eager)


@pytest.mark.gpu
def test_rms_norm_backward_deterministic():
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    grads = [torch.autograd.grad(polykernel.rms_norm(x, w, impl="cute_dsl"), (x, w), dy) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# -- the clustered backward's persistent grid ---------------------------------------------------------


def test_cluster_count_fallback_fits_whole_gpcs(monkeypatch):
    """Without the driver's answer (no cutlass/GPU here) the estimate counts whole clusters per GPC."""
    from polykernel.backends.cute_dsl import _norm_host as host

    monkeypatch.setattr(host, "_sm_count", lambda device: 132)
    monkeypatch.setattr(host, "_clusters", {})
    dev = torch.device("cuda", 0)
    got = {size: host._max_clusters(dev, size) for size in (2, 4, 8, 16)}
    assert got == {2: 64, 4: 32, 8: 16, 16: 8}  # not 132 // 4 = 33: one cluster would run as a second wave


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 4, 8, 16])
def test_cluster_count_from_the_driver(size):
    from polykernel.backends.cute_dsl import _norm_host as host

    dev = torch.device("cuda", torch.cuda.current_device())
    got = host._max_clusters(dev, size)
    assert 1 <= got <= host._sm_count(dev) // size


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "n"), [(1024, 65536), (97, 131072)])
def test_wide_backward_more_rows_than_clusters(rows, n):
    """Every cluster group walks several rows (weight re-read per row, dW summed in shared memory)."""
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16).requires_grad_()
    assert_parity("rms_norm", [Case(f"{rows}x{n}", (x, w))], torch.bfloat16)


def test_the_gpu_parity_helper_skips_where_cute_dsl_cannot_run():
    # On a GPU without CuTeDSL (or on no GPU) every case is refused: a skip, not "no case ran".
    rows = {r["name"]: r for r in polykernel.explain("rms_norm", device="cuda", dtype=torch.bfloat16).impls}
    if rows["cute_dsl"]["runnable"]:
        pytest.skip("cute_dsl runs here: the parity tests run")
    with pytest.raises(pytest.skip.Exception, match="cute_dsl cannot run here: "):
        assert_parity("rms_norm", [], torch.bfloat16)  # what runnable() leaves of the cases then
