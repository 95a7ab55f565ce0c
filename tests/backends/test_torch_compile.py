"""torch_compile impls (issue 25): registration, gating and its reasons with the toolchain absent,
lazy imports; parity (forward and backward) through the compiled reference on the CPU.

Most parity checks compile with ``aot_eager`` (Dynamo and AOTAutograd, as with Inductor, but no
C++ build per case); one runs Inductor itself. ``-m gpu``: Inductor's Triton code on the H200.
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
from polykernel.backends.torch_compile import _compiled
from polykernel.backends.torch_compile import _gates as gates
from polykernel.core import registry
from polykernel.testing import assert_parity, check_parity

_needs_torch_compile = gpu_tests_need("torch_compile", "rms_norm")  # its GPU tests skip where torch_compile cannot run (no toolchain)

OPS = ("rms_norm", "fused_add_rms_norm", "layer_norm", "swiglu", "geglu", "rope", "silu_and_mul")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, request):
    if not request.node.get_closest_marker("gpu"):
        monkeypatch.setattr(_compiled, "BACKEND", "aot_eager")
    gates.reset()
    _compiled.reset()
    polykernel.clear_caches()
    yield
    gates.reset()
    _compiled.reset()
    polykernel.clear_caches()


def _row(op, *args, **kwargs):
    rows = {r["name"]: r for r in polykernel.explain(op, *args, **kwargs).impls}
    return rows["torch_compile"]


@pytest.mark.parametrize("op", OPS)
def test_registered_behind_torch(op):
    specs = registry.specs_for(op)
    spec = specs["torch_compile"]
    assert spec.rank > specs["torch"].rank  # auto never pays a compile
    assert spec.requires_modules == ("torch._inductor",)
    assert _row(op, device="cpu", dtype=torch.float32)["runnable"]
    assert polykernel.explain(op, device="cpu", dtype=torch.float32).chosen != "torch_compile"


# -- gating ------------------------------------------------------------------------------------


def test_no_inductor_is_a_reason(monkeypatch):
    real = gates._findable
    monkeypatch.setattr(gates, "_findable", lambda name: False if name == "torch._inductor" else real(name))
    row = _row("rms_norm", torch.randn(2, 8), torch.ones(8))
    assert not row["runnable"] and row["reason"] == "module 'torch._inductor' not installed"


def test_no_cxx_compiler_is_a_reason_on_the_cpu(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(gates.shutil, "which", lambda name: None)
    row = _row("swiglu", torch.randn(2, 8), torch.randn(2, 8))
    assert not row["runnable"] and "no C++ compiler" in row["reason"]
    with pytest.raises(polykernel.ImplNotAvailableError, match=r"no C\+\+ compiler"):
        polykernel.swiglu(torch.randn(2, 8), torch.randn(2, 8), impl="torch_compile")


def test_cxx_names_the_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert "no C++ compiler" in gates.compiler_reason("cpu")


def test_no_triton_is_a_reason_on_cuda(monkeypatch):
    real = gates._findable
    monkeypatch.setattr(gates, "_findable", lambda name: False if name == "triton" else real(name))
    assert gates.compiler_reason("cuda") == "Inductor's CUDA code needs triton (not installed)"
    assert "CPU and CUDA only" in gates.compiler_reason("mps")


def _cuda_class(op_id="norm.rms_norm"):
    values = (torch.device("cuda", 0), torch.bfloat16, False, 64)
    return types.SimpleNamespace(device=values[0], as_dict=lambda: dict(zip(("device", "dtype", "needs_grad", "n"), values))), values


def test_outer_compile_trace_is_a_reason(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    a, _ = _cuda_class()
    assert "inside a torch.compile trace" in gates.usable("norm.rms_norm", a)


def test_capture_needs_a_class_compiled_before(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    a, values = _cuda_class()
    assert "CUDA-graph capture" in gates.usable("norm.rms_norm", a)
    c = _compiled.compiled("norm.rms_norm", lambda *args: None)
    c._classes.add(values)  # as the first call of this class records it
    assert gates.usable("norm.rms_norm", a) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert gates.usable("norm.fused_add_rms_norm", a) is None  # no capture: compiling is fine


def test_never_compiles_inside_a_capture(monkeypatch):
    """A class first met during a capture runs the eager reference, not a compile."""
    ran = []

    def fn(x):
        ran.append(torch.compiler.is_compiling())
        return x * 2

    c = _compiled.Compiled("norm.rms_norm", fn)
    monkeypatch.setattr(registry.get_op("rms_norm"), "key", lambda x: (x.device, x.dtype))
    x = torch.randn(3)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    torch.testing.assert_close(c(x), x * 2)
    assert ran == [False] and not c._seen  # eager, and nothing recorded as compiled


def test_nothing_imported_eagerly():
    """``import polykernel``, explaining and running the ops on the CPU import neither
    torch._inductor nor torch.utils.cpp_extension, nor a torch_compile or cuda_jit op module."""
    code = """
import json, sys, torch, polykernel
x = torch.randn(4, 8)
polykernel.rms_norm(x, torch.ones(8)); polykernel.swiglu(x, x); polykernel.layer_norm(x, torch.ones(8), torch.zeros(8))
polykernel.fused_add_rms_norm(x, x, torch.ones(8)); polykernel.fused_add_rms_norm_(x.clone(), x.clone(), torch.ones(8))
polykernel.silu_and_mul(x)
for op in ("rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "swiglu", "geglu", "rope", "silu_and_mul", "layer_norm"):
    polykernel.explain(op, device="cpu", dtype=torch.float32)
bad = ("torch._inductor", "torch.utils.cpp_extension")
mods = sorted(m for m in sys.modules if m in bad or m.startswith(("polykernel.backends.torch_compile.", "polykernel.backends.cuda_jit.")))
print(json.dumps(mods))
"""
    full = {k: v for k, v in os.environ.items() if not k.startswith("POLYKERNEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, check=True, timeout=600)
    mods = json.loads(out.stdout.strip().splitlines()[-1])
    # the torch-free gates and manifests (what the backends declare), never an op module
    want = [f"polykernel.backends.{b}.{m}" for b in ("cuda_jit", "torch_compile") for m in ("_gates", "manifest")]
    assert mods == want, mods


# -- parity: the compiled reference, forward and backward --------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_parity_through_the_compiled_reference(op):
    the_op = registry.get_op(op)
    cases = [c for c in the_op.cases("cpu", torch.float32) if not any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in c.args)]
    results = assert_parity(op, ["torch_compile"], device="cpu", dtypes=[torch.float32], cases=cases[:4])
    assert results and all(r.ok for r in results)
    assert _compiled._ops[the_op.id]._seen  # it did go through torch.compile


def test_autograd_and_compile_time_with_inductor(monkeypatch):
    monkeypatch.setattr(_compiled, "BACKEND", "inductor")
    x = torch.randn(5, 48, requires_grad=True)
    w = (1 + 0.1 * torch.randn(48)).requires_grad_()
    y = polykernel.rms_norm(x, w, offset=1.0, impl="torch_compile")
    assert y.grad_fn is not None and "Compiled" in type(y.grad_fn).__name__
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    ry = polykernel.rms_norm(xr, wr, offset=1.0, impl="torch")
    rgx, rgw = torch.autograd.grad(ry.sum(), (xr, wr))
    torch.testing.assert_close(y, ry)
    torch.testing.assert_close(gx, rgx)
    torch.testing.assert_close(gw, rgw)
    fn = registry.load_impl(registry.specs_for("rms_norm")["torch_compile"])
    assert fn.compile_ms(x, w) > 0  # the first call's compile, which measured selection charges
    assert fn.compile_ms(torch.randn(2, 2, device="meta")) is None  # never compiled there


def test_serving_out_is_the_callers_tensor():
    x, out = torch.randn(3, 16), torch.empty(3, 8)
    assert polykernel.silu_and_mul(x, out=out, impl="torch_compile") is out
    torch.testing.assert_close(out, polykernel.silu_and_mul(x, impl="torch"))


# -- on the H200 --------------------------------------------------------------------------------


def _full_size_cases(op: str, dtype: torch.dtype, most: int = 3) -> list:
    """The op's first ``most`` full-size GPU cases (``cases(large=True)`` less the small ones)."""
    the_op = registry.get_op(op)
    small = {c.label for c in the_op.cases("cuda", dtype)}
    return [c for c in the_op.cases("cuda", dtype, large=True) if c.label not in small][:most]


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_parity(op):
    """The compiled impl on the GPU at three of the op's full sizes, bf16 (and fp32 for rms_norm).
    Each case compiles afresh with Inductor (over every case and two dtypes, the 14 tests of this
    file did not finish in two minutes on the H200, 2026-12-04: about 20 s each); the awkward
    layouts go through the same compiled reference on the CPU above."""
    dtypes = [torch.bfloat16, torch.float32] if op == "rms_norm" else [torch.bfloat16]
    for dtype in dtypes:
        cases = _full_size_cases(op, dtype)
        assert cases, f"{op} has no full-size case"
        results = check_parity(op, ["torch_compile"], device="cuda", dtypes=[dtype], cases=cases)
        assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)


def test_a_failing_torch_impl_never_falls_back_to_a_compile(monkeypatch):
    """torch_compile ranks behind the fallback of last resort: a torch impl's error surfaces
    instead of a compile running the same reference (selection step 6 stops at torch)."""
    import polykernel.backends.torch.rms_norm as torch_impl

    def broken(*args):
        raise ValueError("bad data in this batch")

    monkeypatch.setattr(torch_impl, "rms_norm", broken)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the interpreted Triton impl out of the way
    polykernel.clear_caches()
    with pytest.raises(ValueError, match="bad data"):
        polykernel.rms_norm(torch.randn(2, 8), torch.ones(8))
    assert not _compiled._ops  # nothing was compiled


def test_check_parity_compiles_every_case_past_dynamos_recompile_limit():
    # rms_norm's cases in three dtypes are more argument classes than Dynamo's limit (8): past it
    # Dynamo warns and runs the reference eagerly, so the compiled code would go unchecked
    import logging

    warnings = []

    class Catch(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    handler = Catch(logging.WARNING)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        results = check_parity("rms_norm", ["torch_compile"])
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert results and all(r.ok for r in results)
    assert not [w for w in warnings if "recompile" in w]
