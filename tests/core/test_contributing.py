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
    removed again on exit (the parity harness calls ``polykernel.<name>``: the doc's step that
    adds the name to ``polykernel/__init__.py`` is this attribute here)."""
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
