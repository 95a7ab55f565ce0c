"""cuda_jit impls (issue 25): registration, gating and its reasons with nvcc or ninja absent, the
build (one per version, under a file lock), the host's layouts (with a stand-in for the kernel),
and that the kernels compile with nvcc where it is installed; parity on the H200 (``-m gpu``).
"""

from __future__ import annotations

import shutil
import subprocess
import types

import filelock
import pytest
import torch

import polykernel
from _gpu_gates import gpu_tests_need
from polykernel.backends.cuda_jit import _build, _host
from polykernel.backends.cuda_jit import _gates as gates
from polykernel.core import registry
from polykernel.core.op import Case
from polykernel.ops.fused_add_rms_norm import reference as fused_reference
from polykernel.ops.rms_norm import reference as rms_reference
from polykernel.spec import PlatformInfo
from polykernel.testing import check_parity

_needs_cuda_jit = gpu_tests_need("cuda_jit", "rms_norm")  # its GPU tests skip where cuda_jit cannot run (no toolchain)

OPS = ("rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_")
H200 = PlatformInfo("cuda", 0, (9, 0), "NVIDIA H200")


@pytest.fixture(autouse=True)
def _fresh_probe(request):
    if request.node.get_closest_marker("gpu"):
        yield
        return
    gates.reset()
    yield
    gates.reset()


def _arg(dtype="bfloat16", n=4096, weight_dtype=None):
    return types.SimpleNamespace(
        device=torch.device("cuda", 0), dtype=getattr(torch, dtype), n=n, weight_dtype=weight_dtype or getattr(torch, dtype)
    )


def _toolchain(monkeypatch, nvcc=True, ninja=True, tmp_path=None):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    found = {"nvcc": "/opt/cuda/bin/nvcc" if nvcc else None, "ninja": "/usr/bin/ninja" if ninja else None}
    monkeypatch.setattr(gates.shutil, "which", lambda name: found.get(name))
    monkeypatch.setattr(gates.os.path, "isfile", lambda path: False)  # no /usr/local/cuda either


@pytest.mark.parametrize("op", OPS)
def test_registered_forward_only_on_sm80(op):
    spec = registry.specs_for(op)["cuda_jit"]
    assert not spec.format_signature.supports_backward
    assert spec.unavailable_reason(H200) is None
    assert spec.unavailable_reason(PlatformInfo("cuda", 0, (7, 5), "T4")) == "sm_75 < required sm_80"
    row = {r["name"]: r for r in polykernel.explain(op, device="cpu", dtype=torch.bfloat16).impls}["cuda_jit"]
    assert not row["runnable"] and row["reason"] == "needs a CUDA device"


@pytest.mark.parametrize("op", OPS)
def test_gate_reasons(monkeypatch, op):
    pred = registry.specs_for(op)["cuda_jit"].predicate
    _toolchain(monkeypatch)
    assert pred(_arg()) is None and pred(_arg("float32", 4100)) is None
    assert pred(_arg("bfloat16", 4100)) == f"cuda_jit {op} needs N divisible by 8 (128-bit vectors, no scalar tail); N = 4100"
    assert "N divisible by 4" in pred(_arg("float32", 4098))
    assert pred(_arg(weight_dtype=torch.float32)) is None  # fp32 master weights
    assert "weight of x's dtype or float32" in pred(_arg(weight_dtype=torch.float16))


def test_no_nvcc_is_a_reason(monkeypatch):
    _toolchain(monkeypatch, nvcc=False)
    assert gates.rms_norm(_arg()) == "nvcc not found (set CUDA_HOME or put nvcc on PATH)"


def test_cuda_home_without_nvcc_is_a_reason(monkeypatch, tmp_path):
    _toolchain(monkeypatch)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert gates.rms_norm(_arg()) == f"nvcc not found in CUDA_HOME={tmp_path}"


def test_no_ninja_is_a_reason(monkeypatch):
    _toolchain(monkeypatch, ninja=False)
    assert "ninja not found" in gates.fused_add_rms_norm_(_arg())


def test_toolchain_probed_once(monkeypatch):
    calls = []
    _toolchain(monkeypatch)
    real = gates._probe
    monkeypatch.setattr(gates, "_probe", lambda: calls.append(1) or real())
    for _ in range(3):
        gates.rms_norm(_arg())
    assert calls == [1]


# -- the build ---------------------------------------------------------------------------------


def test_build_is_versioned_locked_and_fails_once(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", str(tmp_path))
    seen = []

    def fake_load_inline(**kw):
        lock = filelock.FileLock(str(tmp_path / "cuda_jit" / _build.tag() / "build.lock"), timeout=0)
        with pytest.raises(filelock.Timeout):  # held by build(): a second process would wait here
            lock.acquire()
        seen.append(kw)
        raise RuntimeError("nvcc fatal: no such arch\nerror: build stopped")

    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline)
    monkeypatch.setattr(_build, "_module", None)
    monkeypatch.setattr(_build, "_failed", None)
    with pytest.raises(RuntimeError, match=r"cuda_jit build failed \(RuntimeError: error: build stopped\)"):
        _build.module()
    with pytest.raises(RuntimeError, match="build stopped"):  # kept: no second build in this process
        _build.module()
    assert len(seen) == 1
    (kw,) = seen
    assert kw["build_directory"] == str(_build.build_dir()) and _build.build_dir().parent == tmp_path / "cuda_jit"
    assert kw["functions"] == ["rms_norm_fwd"] and '#include "rms_norm.cuh"' in kw["cuda_sources"][0]
    assert torch.__version__.replace("+", "_") in _build.tag()


# -- the host's layouts, with a stand-in for the kernel ----------------------------------------


class _FakeKernel:
    """rms_norm_fwd's contract in torch: checks what binding.cu checks, writes out/res_out."""

    def __init__(self):
        self.launches = 0

    def rms_norm_fwd(self, x, residual, weight, out, res_out, eps, offset, add, llama):
        vec = 16 // x.element_size()
        for t in (x, out, *((residual, res_out) if add else ())):
            assert t.dim() == 2 and t.stride(1) == 1 and t.stride(0) % vec == 0 and t.data_ptr() % 16 == 0
        assert weight.is_contiguous() and weight.data_ptr() % 16 == 0
        self.launches += 1
        if add:
            y, s = fused_reference(x.clone(), residual.clone(), weight, eps, offset)
            res_out.copy_(s)
            out.copy_(y)
        else:
            out.copy_(rms_reference(x, weight, eps, offset, "llama" if llama else "fp32"))


@pytest.fixture
def fake(monkeypatch):
    k = _FakeKernel()
    monkeypatch.setattr(_build, "module", lambda: k)
    return k


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(6, 64, dtype=torch.bfloat16),
        lambda: torch.randn(2, 3, 64, dtype=torch.bfloat16),
        lambda: torch.randn(12, 64, dtype=torch.bfloat16)[::2],  # row-strided: a view
        lambda: torch.randn(6, 72, dtype=torch.bfloat16)[:, 8:],  # aligned offset view
        lambda: torch.randn(6, 65, dtype=torch.bfloat16)[:, 1:],  # misaligned: copied
        lambda: torch.randn(64, 6, dtype=torch.bfloat16).t(),  # column-major: copied
    ],
    ids=["plain", "3d", "rowstrided", "offset", "misaligned", "transposed"],
)
def test_host_layouts(fake, make):
    x, r = make(), make()
    w = torch.randn(64, dtype=torch.float32)
    torch.testing.assert_close(_host.rms_norm(x, w, 1e-6, 0.5, True), rms_reference(x, w, 1e-6, 0.5, "llama"), rtol=0, atol=0)
    y, s = _host.fused_add_rms_norm(x, r, w, 1e-6, 0.0)
    ry, rs = fused_reference(x, r, w, 1e-6, 0.0)
    assert torch.equal(y, ry) and torch.equal(s, rs)
    xi, ri = x.clone() if x.is_contiguous() else x, r.clone() if r.is_contiguous() else r
    base_x = xi.data_ptr()
    out = _host.fused_add_rms_norm(xi, ri, w, 1e-6, 0.0, in_place=True)
    assert out[0] is xi and out[1] is ri and xi.data_ptr() == base_x
    assert torch.equal(xi, ry) and torch.equal(ri, rs)  # whatever the layout, written in place


def test_host_empty_launches_nothing(fake):
    x = torch.empty(0, 64, dtype=torch.float16)
    assert _host.rms_norm(x, torch.ones(64, dtype=torch.float16), 1e-6, 0.0, False).shape == (0, 64)
    assert fake.launches == 0


# -- the kernels compile (CPU, where nvcc is installed) ---------------------------------------

_INSTANTIATIONS = """
#include "rms_norm.cuh"
#define PK_INST(T, W, ADD) template cudaError_t pk_jit::launch_rms_norm<T, W, ADD>(const T*, int64_t, const T*, int64_t, T*, int64_t, T*, int64_t, const W*, int64_t, int, float, float, bool, cudaStream_t);
PK_INST(float, float, false) PK_INST(float, float, true)
PK_INST(__half, __half, false) PK_INST(__half, __half, true) PK_INST(__half, float, false) PK_INST(__half, float, true)
PK_INST(__nv_bfloat16, __nv_bfloat16, false) PK_INST(__nv_bfloat16, __nv_bfloat16, true)
PK_INST(__nv_bfloat16, float, false) PK_INST(__nv_bfloat16, float, true)
"""


@pytest.mark.skipif(gates.nvcc() is None, reason="nvcc not installed")
def test_kernels_compile_with_nvcc(tmp_path):
    """Every kernel the launcher instantiates compiles for sm_80 and sm_90, without spilling the
    rows it holds in registers at the common widths (torch's headers are not needed for this)."""
    src = tmp_path / "check.cu"
    src.write_text(_INSTANTIATIONS)
    cmd = [gates.nvcc(), "-std=c++17", "-O3", "-c", f"-I{_build.CSRC}", str(src), "-o", str(tmp_path / "check.o"), "--resource-usage"]
    cmd += ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
    # the half/bf16 operator switches torch's extension loader passes to nvcc
    cmd += [f"-D__CUDA_NO_{what}__" for what in ("HALF_OPERATORS", "HALF_CONVERSIONS", "BFLOAT16_CONVERSIONS", "HALF2_OPERATORS")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "check.o").stat().st_size > 0


@pytest.mark.skipif(shutil.which("ninja") is None or gates.nvcc() is None, reason="needs nvcc and ninja")
def test_toolchain_found_here():
    assert gates.toolchain_reason() is None


# -- on the H200 --------------------------------------------------------------------------------


def _norm_cases(device, dtype):
    def t(*shape):
        return torch.randn(shape, device=device, dtype=dtype)

    def w(n, wdtype=dtype):
        return (1 + 0.1 * torch.randn(n, device=device)).to(wdtype)

    return [
        Case("1x8", (t(1, 8), w(8))),
        Case("3x24", (t(3, 24), w(24))),
        Case("2x5x4096", (t(2, 5, 4096), w(4096))),
        Case("1031x5120-llama", (t(1031, 5120), w(5120)), {"casting": "llama"}),
        Case("7x4104-gemma", (t(7, 4104), w(4104)), {"offset": 1.0, "eps": 1e-5}),
        Case("9x200-rowstrided", (t(18, 200)[::2], w(200))),
        Case("5x64-misaligned", (t(5, 65)[:, 1:], w(64))),
        Case("4x4096-fp32w", (t(4, 4096), w(4096, torch.float32))),
        Case("16384x4096", (t(16384, 4096), w(4096))),
        Case("3x32768", (t(3, 32768), w(32768))),
        Case("2x65536-llama", (t(2, 65536), w(65536)), {"casting": "llama"}),
        Case("2x131072-reread", (t(2, 131072), w(131072))),
        Case("0x64", (t(0, 64), w(64))),
    ]


def _fused_cases(device, dtype):
    out = []
    for c in _norm_cases(device, dtype):
        if "llama" in c.label or "eps" in c.kwargs:
            continue
        x, wt = c.args
        out.append(Case(c.label, (x, torch.randn_like(x), wt), c.kwargs))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_parity_rms_norm(dtype):
    results = check_parity("rms_norm", ["cuda_jit"], device="cuda", dtypes=[dtype], cases=_norm_cases("cuda", dtype), backward=False)
    assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fused_add_rms_norm", "fused_add_rms_norm_"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_parity_fused(op, dtype):
    results = check_parity(op, ["cuda_jit"], device="cuda", dtypes=[dtype], cases=_fused_cases("cuda", dtype), backward=False)
    assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)


@pytest.mark.gpu
def test_gpu_in_place_writes_the_callers_tensors_under_a_graph():
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    want_y, want_s = fused_reference(x, r, w, 1e-6, 0.0)
    xs, rs = x.clone(), r.clone()
    polykernel.fused_add_rms_norm_(xs, rs, w, impl="cuda_jit")  # built and warm before the capture
    xs.copy_(x)
    rs.copy_(r)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        polykernel.fused_add_rms_norm_(xs, rs, w, impl="cuda_jit")
    xs.copy_(x)
    rs.copy_(r)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(rs, want_s)
    torch.testing.assert_close(xs, want_y, rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
def test_gpu_training_falls_through():
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rows = {r["name"]: r for r in polykernel.explain("rms_norm", x, torch.ones(4096, device="cuda", dtype=torch.bfloat16)).impls}
    assert rows["cuda_jit"]["reason"] == "has no backward (inputs require grad)"
