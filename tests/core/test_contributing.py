"""docs/contributing.md, followed literally: its marked code blocks define a toy op (``toy.scale``,
with a torch and a Triton impl) and a toy backend with one impl, and check them. This test runs
those blocks as they are written (so the walk-through cannot drift from what works), then checks
what the walk-through promises: dispatch, the guard, validation, ``explain``, ``impl=`` and the
parity harness; and that the toy is gone from the registry afterwards.
"""

from __future__ import annotations

import contextlib
import re
import sys
import types
from pathlib import Path

import pytest
import torch

import polykernel
from polykernel import _compat
from polykernel.core import registry
from polykernel.core import selection as dispatch
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.spec import PlatformInfo, triton_interpret_allows

DOC = Path(__file__).resolve().parents[2] / "docs" / "contributing.md"
MARK = "<!-- test_contributing -->"
OP_ID = "toy.scale"


def _blocks() -> list[tuple[int, str]]:
    """(line, code) of each marked python block of the doc, in order."""
    text = DOC.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(re.escape(MARK) + r"\s*```python\n(.*?)```", text, re.S):
        out.append((text.count("\n", 0, m.start(1)), m.group(1)))
    return out


@contextlib.contextmanager
def _toy():
    """The doc's blocks run in one fresh module; the toy op, its impls and its public name are
    removed again on exit (the parity harness calls ``polykernel.<name>``: for an op file in
    ``polykernel/ops/`` the name is derived from the catalog, for this module outside it the name
    is this attribute here)."""
    module = types.ModuleType("polykernel_contributing_toy")
    module.__file__ = str(DOC)
    sys.modules[module.__name__] = module
    polykernel.scale = lambda *a, **k: module.scale(*a, **k)
    saved = registry.snapshot()
    try:
        for line, code in _blocks():
            # padded to the doc's line numbers: a traceback points into docs/contributing.md
            exec(compile("\n" * line + code, str(DOC), "exec"), module.__dict__)
        yield module
    finally:
        del polykernel.scale
        sys.modules.pop(module.__name__, None)
        registry.restore(saved)  # removes the toy op (defined outside the catalog) and its impls
        dispatch.routed.discard(OP_ID)
        polykernel.clear_caches()


def test_the_doc_has_the_blocks_this_test_runs():
    assert len(_blocks()) == 6  # the op, its torch impl, its Triton impl, IMPLS and Op, the checks, the toy backend


def test_the_walkthrough_runs_as_written_and_leaves_nothing_behind():
    with _toy():
        assert OP_ID in registry.all_op_ids()
        assert set(registry.specs_for(OP_ID)) == {"torch", "triton", "cuda_jit"}
    assert OP_ID not in registry.all_op_ids() and not hasattr(polykernel, "scale")


def test_dispatch_guard_and_validation():
    with _toy() as toy:
        op = registry.get_op(OP_ID)
        x = torch.randn(3, 5)
        polykernel.clear_caches()
        for _ in range(3):
            torch.testing.assert_close(toy.scale(x, 0.5), x * 0.5)
        # one decision, recognised by its guard (where torch has one: polykernel._compat)
        assert len(op._memo) == 1 and (op._fast or _compat.tensor_guards() is None)
        y = torch.randn(7, 2, 3)
        torch.testing.assert_close(toy.scale(y, 0.5), y * 0.5)
        assert len(op._memo) == 1  # dims(): another shape is the same class
        for _ in range(2):  # a bad call after good ones is rejected every time
            with pytest.raises(OpArgumentError, match=r"toy\.scale.*'alpha'"):
                toy.scale(x, float("inf"))
            with pytest.raises(OpTypeError, match=r"toy\.scale.*'x'"):
                toy.scale(x.int(), 0.5)
        x.requires_grad_()
        (g,) = torch.autograd.grad(toy.scale(x, 3.0).sum(), x)
        torch.testing.assert_close(g, torch.full_like(x, 3.0))


def test_explain_and_impl():
    with _toy() as toy:
        x = torch.randn(4, 8)
        here = "triton" if triton_interpret_allows(PlatformInfo.detect(x)) else "cuda_jit"  # Triton on the CPU: interpreted
        e = polykernel.explain("scale", x, 2.0)
        assert e.chosen == here
        rows = {r["name"]: r for r in e.impls}
        assert {n: r["rank"] for n, r in rows.items()} == {"triton": 10, "cuda_jit": 20, "torch": 100}
        assert e.arg_class == {"device": x.device, "dtype": torch.float32, "needs_grad": False, "alpha": 2.0}
        rows = {r["name"]: r for r in polykernel.explain("scale", x, -2.0).impls}
        assert not rows["cuda_jit"]["runnable"] and rows["cuda_jit"]["reason"] == "the toy backend takes alpha >= 0, got -2.0"
        bf16 = {r["name"]: r for r in polykernel.explain("scale", x.bfloat16(), 2.0).impls}
        assert not bf16["cuda_jit"]["runnable"] and "bfloat16" in bf16["cuda_jit"]["reason"]  # the backend's dtypes
        for impl in ("torch", "cuda_jit"):
            torch.testing.assert_close(toy.scale(x, 2.0, impl=impl), x * 2)
        with pytest.raises(polykernel.ImplNotAvailableError):
            toy.scale(x.bfloat16(), 2.0, impl="cuda_jit")  # strict


def test_the_toy_passes_the_parity_harness_on_every_runnable_impl():
    from polykernel.testing import check_parity

    with _toy():
        results = check_parity(OP_ID, dtypes=[torch.float32, torch.bfloat16, torch.float16])
        assert {r.impl for r in results} >= {"torch", "cuda_jit"}
        assert all(r.ok for r in results), "\n".join(map(str, results))


def _fake_measure(fn, grad_inputs, backward, graph=False, warmup=25, rep=100):  # timing needs CUDA
    from polykernel.tools import bench

    bench._step(fn, grad_inputs, backward)()  # one step as measure times it (the backward's gradients too)
    return 0.5, 1.0


def test_a_toy_op_file_among_the_op_files_needs_no_list_edited(tmp_path, monkeypatch):
    """The walk-through's op file (its first four blocks, as they are) put among polykernel's op
    files (a second directory of ``polykernel.ops``): nothing else is edited, and the catalog, the
    public name, dispatch, ``explain`` and ``polykernel bench`` (at the file's ``bench_shapes``) all
    find it."""
    import polykernel.ops as ops
    from polykernel.tools import bench
    from polykernel.tools.console import make_console

    (tmp_path / "toy_scale.py").write_text("\n".join(code for _, code in _blocks()[:4]), encoding="utf-8")
    monkeypatch.setattr(ops, "__path__", [*ops.__path__, str(tmp_path)])
    monkeypatch.setattr(ops, "OP_MODULES", ops._op_modules())  # the catalog as importing the package reads it
    monkeypatch.setattr(bench, "measure", _fake_measure)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4000.0)
    saved = registry.snapshot()
    try:
        assert ops.OP_MODULES[OP_ID] == "polykernel.ops.toy_scale" and OP_ID in polykernel.list_ops()
        assert "scale" in polykernel._public_names() and "scale" not in polykernel._LAZY
        x = torch.randn(3, 5)
        torch.testing.assert_close(polykernel.scale(x, 0.5), x * 0.5)
        assert polykernel.scale.__module__ == "polykernel.ops.toy_scale"
        assert {r["name"] for r in polykernel.explain("scale", x, 2.0).impls} == {"torch", "triton"}
        assert "scale" not in bench.SHAPES
        assert bench.cases_for("scale", sweep=False) == [("64x1024", (64, 1024), False)]
        console = make_console(__import__("io").StringIO(), force_terminal=False)
        rows, _ = bench.run(["scale"], False, torch.float32, device="cpu", console=console)
        assert {(r["impl"], r["mode"]) for r in rows} == {
            (who, mode) for who in ("polykernel", "polykernel:torch", "polykernel:triton", "eager reference") for mode in ("fwd", "fwd+bwd")
        }
        assert all(r["shape"] == "64x1024" and not r["error"] for r in rows), [r["error"] for r in rows]
        assert all(r["GB/s"] > 0 for r in rows)  # the op file's bytes_moved
    finally:
        monkeypatch.undo()  # the catalog as it was: restore then removes the op as one outside it
        registry.restore(saved)
        polykernel.__dict__.pop("scale", None)  # the derived name, cached on first use
        ops.__dict__.pop("toy_scale", None)
        sys.modules.pop("polykernel.ops.toy_scale", None)
        dispatch.routed.discard(OP_ID)
        polykernel.clear_caches()
    assert OP_ID not in registry.all_op_ids() and not hasattr(polykernel, "scale")


def test_the_catalog_and_public_names_are_read_torch_free():
    """``polykernel.__all__`` lists every op of the catalog, read from the op files' text: no
    op module (and no torch) is imported for it."""
    import subprocess

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import polykernel\n"
        "ops = polykernel.list_ops()\n"
        "assert len(ops) >= 35 and {o.rpartition('.')[2] for o in ops} <= set(polykernel.__all__) == set(dir(polykernel))\n"
        "assert 'rms_norm' in polykernel.__all__ and 'explain' in polykernel.__all__\n"
        "assert not [m for m in sys.modules if m.startswith('polykernel.ops.') and not m.startswith('polykernel.ops._')]\n"
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(DOC.parents[1] / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr


def test_an_op_file_without_one_op_id_is_a_clear_error(tmp_path, monkeypatch):
    import polykernel.ops as ops

    (tmp_path / "toy_no_id.py").write_text("import torch\n", encoding="utf-8")
    monkeypatch.setattr(ops, "__path__", [*ops.__path__, str(tmp_path)])
    with pytest.raises(ImportError, match=r"polykernel\.ops\.toy_no_id: an op file needs exactly one 'OP_ID"):
        ops._op_modules()
