"""A GPU test of an optional backend skips, never fails, where that backend cannot run (its module
not staged, another arch): the H200 runs the suite with whatever providers were carried that day."""

from __future__ import annotations

from collections.abc import Callable

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
