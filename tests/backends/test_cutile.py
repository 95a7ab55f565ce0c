"""cuTile impls (issue 9): registration, gating and its reasons with the module or the compiler
absent, lazy imports (on any machine); parity with the reference on the H200 (``-m gpu``).

The kernels themselves need a GPU to run, but they compile on any machine with cuda-tile and
tileiras 13.4 installed (``cuda.tile.compilation.export_kernel`` to an sm_90 cubin):
``test_kernels_compile_for_sm90`` does that where both are present and skips elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

import polykernel
from _gpu_gates import gpu_tests_need
from polykernel.backends.cutile import _gates as gates
from polykernel.core import registry
from polykernel.core.op import Case
from polykernel.spec import PlatformInfo
from polykernel.testing import check_parity, refusal

_needs_cutile = gpu_tests_need("cutile", "rms_norm")  # its GPU tests skip where cutile is not staged

OPS = ("swiglu", "geglu", "rms_norm", "rope", "softmax")
H200 = PlatformInfo("cuda", 0, (9, 0), "NVIDIA H200")


@pytest.fixture(autouse=True)
def _fresh_probe(request):
    # The probe's tests fake the compiler and must not see (or leave) a cached answer. The GPU tests
    # keep the real answer: re-probing runs tileiras again, about a second per test.
    if request.node.get_closest_marker("gpu"):
        yield
        return
    gates.reset()
    yield
    gates.reset()


# -- registration and metadata gates -------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_registered_behind_triton(op):
    specs = registry.specs_for(op)
    spec = specs["cutile"]
    assert spec.target == f"polykernel.backends.cutile.{op}:{op}"
    assert spec.requires_modules == ("cuda.tile",)
    assert {str(c) for c in spec.capabilities} == {"cuda[sm_80..sm_121]"}
    assert spec.predicate is not None
    assert specs["triton"].rank < spec.rank < specs["torch"].rank  # auto unchanged until measured
    assert not spec.accepts_subclasses


def test_softmax_is_forward_only():
    assert not registry.specs_for("softmax")["cutile"].format_signature.supports_backward
    x = torch.randn(2, 8, requires_grad=True)
    rows = {r["name"]: r for r in polykernel.explain("softmax", x).impls}
    assert rows["cutile"]["reason"] in ("needs a CUDA device", "has no backward (inputs require grad)")


def test_arch_window_and_module_reasons(monkeypatch):
    from polykernel import spec as spec_mod

    spec = registry.specs_for("rms_norm")["cutile"]
    assert spec.unavailable_reason(PlatformInfo("cuda", 0, (7, 5), "T4")) == "sm_75 < required sm_80"
    assert spec.unavailable_reason(PlatformInfo("cuda", 0, (13, 0), "future")) == "sm_130 > supported sm_121"
    assert spec.unavailable_reason(PlatformInfo()) == "needs a CUDA device"
    monkeypatch.setitem(spec_mod._findable, "cuda.tile", False)
    assert spec.unavailable_reason(H200) == "module 'cuda.tile' not installed"


@pytest.mark.parametrize("op", OPS)
def test_cpu_explain_says_why(op):
    rows = {r["name"]: r for r in polykernel.explain(op, device="cpu", dtype=torch.bfloat16).impls}
    assert not rows["cutile"]["runnable"]
    assert rows["cutile"]["reason"] == "needs a CUDA device"


# -- the compiler probe --------------------------------------------------------------------------


def _fake_probe(monkeypatch, compile_for) -> list[int | None]:
    """Make the module look installed and replace the probe kernel's compile with ``compile_for``."""
    calls: list[int | None] = []

    def wrapped(sm):
        calls.append(sm)
        return compile_for(sm)

    monkeypatch.setattr(gates, "_module_missing", lambda: False)
    fake = types.ModuleType("polykernel.backends.cutile._probe_kernel")
    fake.compile_for = wrapped
    monkeypatch.setitem(sys.modules, "polykernel.backends.cutile._probe_kernel", fake)
    monkeypatch.setattr(sys.modules["polykernel.backends.cutile"], "_probe_kernel", fake, raising=False)
    return calls


def test_probe_module_absent(monkeypatch):
    monkeypatch.setattr(gates, "_module_missing", lambda: True)
    assert gates.compiler_reason(90) == "module 'cuda.tile' not installed"


def test_probe_tileiras_not_found(monkeypatch):
    def missing(sm):
        raise FileNotFoundError("'tileiras' compiler not found, make sure it is available ...")

    _fake_probe(monkeypatch, missing)
    assert gates.compiler_reason(90) == "tileiras not found"


def test_probe_tileiras_fails_first_line(monkeypatch):
    class TileCompilerExecutionError(Exception):  # the name is what the gate recognises
        pass

    def fails(sm):
        raise TileCompilerExecutionError("failed to compile Tile IR program\nsecond line")

    _fake_probe(monkeypatch, fails)
    assert gates.compiler_reason(90) == "tileiras failed: failed to compile Tile IR program"


def test_probe_other_failure_is_named(monkeypatch):
    def boom(sm):
        raise OSError("libcuda.so.1: cannot open shared object file")

    _fake_probe(monkeypatch, boom)
    assert gates.compiler_reason(90) == "cuTile probe failed: OSError: libcuda.so.1: cannot open shared object file"


def test_probe_runs_once_per_arch(monkeypatch):
    calls = _fake_probe(monkeypatch, lambda sm: 1)
    assert gates.compiler_reason(90) is None
    assert gates.compiler_reason(90) is None
    assert gates.compiler_reason(100) is None
    assert calls == [90, 100]
    gates.reset()
    assert gates.compiler_reason(90) is None
    assert calls == [90, 100, 90]


def test_predicates_carry_the_probe_reason(monkeypatch):
    def missing(sm):
        raise FileNotFoundError("'tileiras' compiler not found")

    calls = _fake_probe(monkeypatch, missing)
    monkeypatch.setattr(gates, "_sm", lambda device: 90)
    a = types.SimpleNamespace(
        device="cuda:0", rot_grad=False, k_dtype=torch.bfloat16, dtype=torch.bfloat16, partial=False, interleaved=False
    )
    for op in OPS:
        assert getattr(gates, op)(a) == "tileiras not found"
    assert calls == [90]  # one probe for every op


def test_rope_predicate_refuses_rotation_grads_before_probing(monkeypatch):
    calls = _fake_probe(monkeypatch, lambda sm: 1)
    opts = dict(partial=False, interleaved=False)
    a = types.SimpleNamespace(device="cuda:0", rot_grad=True, k_dtype=torch.bfloat16, dtype=torch.bfloat16, **opts)
    assert "cos/sin require grad" in gates.rope(a)
    a = types.SimpleNamespace(device="cuda:0", rot_grad=False, k_dtype=torch.float64, dtype=torch.bfloat16, **opts)
    assert gates.rope(a) == "k dtype float64 not supported"
    a = types.SimpleNamespace(
        device="cuda:0", rot_grad=False, k_dtype=torch.bfloat16, dtype=torch.bfloat16, partial=True, interleaved=False
    )
    assert "partial rotary" in gates.rope(a)  # rope's options: the kernel has neither
    a = types.SimpleNamespace(
        device="cuda:0", rot_grad=False, k_dtype=torch.bfloat16, dtype=torch.bfloat16, partial=False, interleaved=True
    )
    assert "interleaved" in gates.rope(a)
    assert calls == []


# -- nothing is imported -------------------------------------------------------------------------


def test_nothing_imported_without_a_gpu():
    """Explaining and running every op (auto, and POLYKERNEL_IMPL=cutile) on the CPU imports
    neither cuda.tile nor a cuTile kernel module, and never probes the compiler."""
    code = """
import json, sys, torch, polykernel
x = torch.randn(4, 8)
polykernel.rms_norm(x, torch.ones(8)); polykernel.swiglu(x, x); polykernel.geglu(x, x); polykernel.softmax(x)
q = torch.randn(1, 2, 3, 4); polykernel.rope(q, q, torch.randn(1, 3, 4), torch.randn(1, 3, 4))
for op in ("rms_norm", "swiglu", "geglu", "softmax", "rope"):
    polykernel.explain(op, device="cpu", dtype=torch.float32)
from polykernel.backends.cutile import _gates
print(json.dumps({"mods": sorted(m for m in sys.modules if m.split(".")[:2] == ["cuda", "tile"] or "cutile." in m), "probed": len(_gates._probed)}))
"""
    for env in ({}, {"POLYKERNEL_IMPL": "cutile"}):
        full = {k: v for k, v in os.environ.items() if not k.startswith("POLYKERNEL_")} | env
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got == {"mods": ["polykernel.backends.cutile._gates", "polykernel.backends.cutile.manifest"], "probed": 0}, (env, got)


def test_preference_runs_everything_on_cpu(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_IMPL", "cutile")
    polykernel.clear_caches()
    try:
        x, w = torch.randn(3, 16), torch.ones(16)
        torch.testing.assert_close(polykernel.rms_norm(x, w), polykernel.rms_norm(x, w, impl="torch"))
        torch.testing.assert_close(polykernel.softmax(x), torch.softmax(x, -1))
    finally:
        polykernel.clear_caches()


# -- compile check (CPU, where cuda-tile and tileiras are installed) ------------------------------


def _compiler_here() -> bool:
    return not gates._module_missing() and gates.compiler_reason(90) is None


def test_kernels_compile_for_sm90():
    """Every kernel, in each dtype and mode, compiles to an sm_90 cubin with the installed tileiras
    (no GPU needed): catches typing and lowering errors before the H200 sees the code."""
    if not _compiler_here():
        pytest.skip("cuda-tile with a working tileiras is not installed here")
    import io

    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint, export_kernel

    from polykernel.backends.cutile import glu, rms_norm, rope, softmax

    dt = {torch.float32: ct.float32, torch.bfloat16: ct.bfloat16, torch.float16: ct.float16}

    def arr(t: torch.Tensor) -> ArrayConstraint:
        return ArrayConstraint(
            dt[t.dtype], t.dim(), index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(), may_alias_internally=False
        )

    def compile_(kernel, *args) -> None:
        params = [arr(a) if isinstance(a, torch.Tensor) else ScalarConstraint(ct.int32) if a is int else a for a in args]
        export_kernel(
            kernel, [KernelSignature(params, CallingConvention.cutile_python_v2())], io.BytesIO(), gpu_code="sm_90", output_format="cubin"
        )

    x, w, r = torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16), torch.empty(4)
    q, c = torch.empty(2, 4, 8, 16, dtype=torch.bfloat16), torch.empty(1, 8, 16)
    flat = torch.empty(64, dtype=torch.bfloat16)
    for act in (glu.SILU, glu.GELU_TANH, glu.GELU_ERF):
        compile_(glu._glu_fwd_flat, flat, flat, flat, act, glu.FLAT_BLOCK)
        compile_(glu._glu_bwd_flat, flat, flat, flat, flat, flat, act, glu.FLAT_BLOCK)
        compile_(glu._glu_fwd_kernel, x, x, x, act, 4, 1024)
        compile_(glu._glu_bwd_kernel, x, x, x, x, x, act, 4, 1024)
    for llama in (False, True):
        compile_(rms_norm._fwd_tile, x, w, x, r, 1e-6, 0.0, llama, 2, 4096)
        compile_(rms_norm._fwd_chunked, x, w, x, r, 1e-6, 1.0, llama, rms_norm.CHUNK_N)
        compile_(rms_norm._bwd_tile, x, w, x, r, x, r.view(1, 4), 0.0, llama, 1, 4096)
        compile_(rms_norm._bwd_chunked, x, w, x, r, x, r.view(1, 4), 0.5, llama, rms_norm.CHUNK_N)
    compile_(softmax._softmax_tile, x, x, 8, 1024)
    compile_(softmax._softmax_chunked, x, x, softmax.CHUNK_N)
    for backward in (False, True):
        compile_(rope._rope_kernel, q, q, q, q, c, c, int, int, 0, 1, 40, 32, 64, backward)
        compile_(rope._rope_tiled, q, q, q, q, c, c, int, int, 0, 1, 16, 8, backward)


# -- H200 parity (-m gpu) ------------------------------------------------------------------------
#
# cuTile compiles one kernel per signature: dtypes, constants, and the layout facts of each array
# (unit strides, divisibility of shapes, strides and base address). Each op's full case list is
# a compile per case, which made this file take minutes; the GPU tests take a few of the op's own
# cases instead: one per dtype that takes the main path (fp32, fp16), and in bf16 one per kernel
# path and special layout (FULL below). Run with --durations=10 to see where the time goes.

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# op -> the case labels (of the op's own cases()) run in every dtype: the main kernel path
MAIN = {
    "swiglu": ["5x1000-wide-range"],
    "geglu": ["5x1000-wide-range"],
    "rms_norm": ["2x5x33"],
    "rope": ["2x2x6x16-strided-cos"],
    "softmax": ["6x2048-masked"],
}
# op -> the labels added in bf16: every kernel (flat / rows, tile / chunked, tiled / gathered), odd
# tails, mixed layouts, options that are kernel constants (llama, offset, erf), empty inputs
FULL = {
    "swiglu": ["2x5x33", "7x48-mixed-layouts", "0x16"],
    "geglu": ["6x300-fused-halves", "erf-2x5x33"],
    "rms_norm": ["6x128-llama", "5x96-gemma", "3x70001-long", "9x20000-long-llama", "2x3x0"],
    "rope": ["2x8x33x64-hf-transposed", "2x4x11x20-randtables", "2x3x4x8-no-k-heads", "2x2x0x16-empty-T"],
    "softmax": ["4x1000-logits-1e4", "3x40000-long", "2x40000-long-masked", "0x16"],
}
# op -> the one full-size bf16 case (issue 9's benchmark shapes)
LARGE = {
    "swiglu": "16384x14336",
    "geglu": "16384x14336",
    "rms_norm": "16384x4096",
    "rope": "4x32x4096x128-k8",
    "softmax": "8192x32768",
}


def _labels(op: str, dtype: torch.dtype) -> list[str]:
    return MAIN[op] + (FULL[op] if dtype == torch.bfloat16 else [])


def _pick(cases: list[Case], labels: list[str]) -> list[Case]:
    """The cases named by ``labels``, in that order; a missing label is an error (a renamed case
    must not silently drop out of the GPU run)."""
    by_label = {c.label: c for c in cases}
    missing = [label for label in labels if label not in by_label]
    assert not missing, f"no such cases: {missing} (have {sorted(by_label)})"
    return [by_label[label] for label in labels]


def _detached(cases: list[Case]) -> list[Case]:
    return [Case(c.label, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in c.args), c.kwargs) for c in cases]


@pytest.mark.parametrize("op", OPS)
def test_gpu_case_labels_exist(op):
    """The GPU tests' case labels name cases the op still has (checked here on the CPU, in fp32: the
    CPU's bf16 list leaves out cases the Triton interpreter cannot round like a GPU)."""
    cases = registry.get_op(op).cases("cpu", torch.float32)
    for dtype in DTYPES:
        assert [c.label for c in _pick(cases, _labels(op, dtype))] == _labels(op, dtype)


def _assert_parity(op: str, dtype: torch.dtype, labels: list[str], large: bool = False) -> None:
    the_op = registry.get_op(op)
    backward = op != "softmax"  # softmax's cuTile impl is forward-only
    cases = _pick(the_op.cases("cuda", dtype, large), labels)
    if not backward:
        cases = _detached(cases)
    refused = {c.label: refusal(op, "cutile", c) for c in cases}
    assert not any(refused.values()), refused  # every case must run in cuTile
    results = check_parity(op, ["cutile"], device="cuda", dtypes=[dtype], cases=cases, backward=backward)
    assert len(results) == len(cases)
    bad = [str(r) for r in results if not r.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op", OPS)
def test_parity_gpu(op, dtype):
    _assert_parity(op, dtype, _labels(op, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_parity_large_bf16_gpu(op):
    _assert_parity(op, torch.bfloat16, [LARGE[op]], large=True)


@pytest.mark.gpu
def test_preference_runs_cutile_gpu(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_IMPL", "cutile")
    polykernel.clear_caches()
    try:
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, 4, 16, 64, device="cuda", dtype=torch.bfloat16)
        cs = torch.randn(1, 16, 64, device="cuda", dtype=torch.bfloat16)
        calls = {
            "rms_norm": (x, w),
            "swiglu": (x, x),
            "geglu": (x, x),
            "softmax": (x,),
            "rope": (q, q, cs, cs),
        }
        for op, args in calls.items():
            rec = polykernel.explain(op, *args)
            assert rec.chosen == "cutile", str(rec)
            getattr(polykernel, op)(*args)
    finally:
        polykernel.clear_caches()
