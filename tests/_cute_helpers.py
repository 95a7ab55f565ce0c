"""Helpers shared by the cute_dsl test files (test_cute_dsl.py, test_cute_dsl_softmax_ce.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import polykernel
from polykernel.core import registry
from polykernel.core.op import Case
from polykernel.testing import check_parity, refusal

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The tail of a CPU script: the cutlass / tvm_ffi modules and our kernel modules it imported.
IMPORTED_KERNEL_MODULES = r"""
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "tvm_ffi")
                        or m.startswith("polykernel.backends.cute_dsl.") and m.rsplit(".", 1)[1] not in ("_predicates", "_gates", "manifest"))))
"""


def assert_registered_and_gated(op: str):
    """The cute_dsl spec's target, module and arch gate, and its CPU reason; returns the spec."""
    spec = registry.specs_for(op)["cute_dsl"]
    assert spec.backend.value == "cute_dsl"
    assert spec.target == f"polykernel.backends.cute_dsl.{op}:{op}"
    assert spec.requires_modules[0] == "cutlass"
    assert {str(c) for c in spec.capabilities} == {"cuda[sm_90..]"}
    rows = {r["name"]: r for r in polykernel.explain(op, device="cpu", dtype=torch.bfloat16).impls}
    assert not rows["cute_dsl"]["runnable"]
    assert rows["cute_dsl"]["reason"] in ("needs a CUDA device", "module 'cutlass' not installed")
    return spec


def assert_imports_no_cutlass(script: str, env: dict[str, str]) -> None:
    """``script`` (ending in IMPORTED_KERNEL_MODULES) imports neither cutlass nor a kernel module."""
    full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def cute() -> None:
    """Skip unless cutlass and tvm_ffi are installed; compile for sm_90a (no GPU needed)."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def runnable(op: str, cases: list[Case]) -> list[Case]:
    return [c for c in cases if refusal(op, "cute_dsl", c) is None]


def assert_parity(op: str, cases: list[Case], dtype: torch.dtype) -> None:
    """cute_dsl's parity on ``cases``; a skip when cute_dsl cannot run on this GPU at all (CuTeDSL
    not installed, another arch), as the peers' tests skip. Cases it runs but none given: fail."""
    rows = {r["name"]: r for r in polykernel.explain(op, device="cuda", dtype=dtype).impls}
    if not rows["cute_dsl"]["runnable"]:
        pytest.skip(f"cute_dsl cannot run here: {rows['cute_dsl']['reason']}")
    results = check_parity(op, ["cute_dsl"], device="cuda", dtypes=[dtype], cases=cases)
    assert results, "no case ran"
    bad = [str(r) for r in results if not r.ok]
    assert not bad, "\n".join(bad)
