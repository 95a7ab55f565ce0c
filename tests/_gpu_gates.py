"""A GPU test of an optional backend skips, never fails, where that backend cannot run (its module
not staged, another arch): the H200 runs the suite with whatever providers were carried that day."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import polykernel


def gpu_tests_need(impl: str, op: str) -> Callable[..., None]:
    """An autouse fixture for a test module: its ``gpu``-marked tests skip unless ``impl`` of ``op``
    is runnable on this CUDA device (``explain``'s reason in the skip message)."""

    @pytest.fixture(autouse=True)
    def _needs_impl(request: pytest.FixtureRequest) -> None:
        if request.node.get_closest_marker("gpu") is None:
            return
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        rows = {r["name"]: r for r in polykernel.explain(op, device="cuda", dtype=torch.bfloat16).impls}
        if not rows[impl]["runnable"]:
            pytest.skip(f"{impl} cannot run here: {rows[impl]['reason']}")

    return _needs_impl


# The float64 reference of a GPU parity case holds several [N, V] tensors (its input, the
# log-softmax, the gradient, their temporaries): at 8192 x 128256 that was tens of GB per impl
# and dtype. Rows are independent in these losses, so the large cases keep their row length V
# (the kernels' vocabulary tiling) and lose rows down to 2^27 elements per [N, V] tensor (1 GiB
# in float64): V = 128256 keeps 1046 rows, still two row chunks of the fused linear CE (1024 at
# bf16, 512 at fp32).
REF_ELEMENTS = 1 << 27


def fewer_rows(cases: list, vocab: Callable[[Any], int] = lambda c: c.args[0].shape[-1], elements: int = REF_ELEMENTS) -> list:
    """``cases`` with every case of N rows of ``vocab(case)`` over ``elements`` cut to its first
    rows: each tensor argument whose first dim is N, as a fresh leaf (same requires_grad)."""
    from polykernel.core.op import Case

    out = []
    for c in cases:
        n, v = c.args[0].shape[0] if c.args[0].dim() else 0, vocab(c)
        keep = max(1, elements // max(v, 1))
        if n * v <= elements:
            out.append(c)
            continue
        out.append(Case(f"{c.label}-rows{keep}", tuple(_first_rows(a, n, keep) for a in c.args), c.kwargs))
    return out


def _first_rows(a: Any, n: int, keep: int) -> Any:
    if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] != n:
        return a
    return a.detach()[:keep].clone().requires_grad_(a.requires_grad)
