"""The GPU suite's parts (``make test-gpu PART=...``) cover every GPU test file once, and the GPU
parity tests' large cases keep their float64 references small (``_gpu_gates.fewer_rows``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from _gpu_gates import fewer_rows
from polykernel.ops.cross_entropy import cases as ce_cases
from polykernel.ops.fused_linear_cross_entropy import cases as flce_cases

ROOT = Path(__file__).resolve().parents[2]


def _gpu_files() -> set[str]:
    marked = re.compile(r"mark\.gpu2?\b|^gpu = pytest\.mark\.gpu", re.M)
    return {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if marked.search(p.read_text())}


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_gpu_parts_hold_every_gpu_test_file_once():
    out = subprocess.run(["make", "-s", "test-gpu-parts"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    parts = dict(line.split(": ", 1) for line in out.splitlines())
    assert {"norms", "losses", "moe", "serving", "peers", "models", "rest"} <= set(parts)
    # the peers alone in their process: a peer kernel's fault poisons the CUDA context for the rest
    assert parts["peers"].split() == ["tests/backends/test_serving_peers.py"]
    owner: dict[str, list[str]] = {}
    for part, paths in parts.items():
        for path in paths.split():
            if path == "(none)":
                continue
            files = [str(p.relative_to(ROOT)) for p in (ROOT / path).rglob("test_*.py")] if (ROOT / path).is_dir() else [path]
            for f in files:
                owner.setdefault(f, []).append(part)
    gpu = _gpu_files()
    assert len(gpu) > 30
    assert {f: owner.get(f) for f in gpu if len(owner.get(f, [])) != 1} == {}


def test_fewer_rows_cuts_rows_and_keeps_the_row_length():
    small = ce_cases("cpu", torch.float32)
    cut = fewer_rows(small, elements=64)
    assert len(cut) == len(small)
    for before, after in zip(small, cut):
        x, x2 = before.args[0], after.args[0]
        if x.dim() < 2 or x.shape[0] * x.shape[-1] <= 64:
            assert after is before
            continue
        keep = max(1, 64 // x.shape[-1])
        assert after.label == f"{before.label}-rows{keep}" and after.kwargs == before.kwargs
        assert x2.shape == (keep, *x.shape[1:]) and torch.equal(x2, x[:keep].detach())
        assert x2.is_leaf and x2.requires_grad == x.requires_grad
        assert torch.equal(after.args[1], before.args[1][:keep])  # the targets: same rows
    # the fused linear CE: the row length is the weight's V; the weight and bias keep all of it
    (flce,) = [c for c in flce_cases("cpu", torch.float32) if len(c.args) == 4 and c.args[0].shape[0] > 4][:1] or [None]
    if flce is not None:
        v = flce.args[1].shape[0]
        (got,) = fewer_rows([flce], lambda c: c.args[1].shape[0], elements=2 * v)
        assert got.args[0].shape[0] == 2 and got.args[1] is flce.args[1] and got.args[3] is flce.args[3]
