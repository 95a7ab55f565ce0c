"""A toy backend for an existing op, added with this one file and no edit elsewhere (issue 36).

The file is the whole backend, as a plugin outside the package writes one: its declaration
(:class:`~polykernel.backends.declare.Backend`), its impl rows by op (``IMPLS``, the form of a
built-in backend's ``manifest.py``), a gate and the adapter. It registers its rows through the
public ``polykernel.register_impl`` (a built-in backend's manifest is read by the registry instead),
inside ``polykernel.testing.isolated()``, so that nothing of it is left for other tests. It borrows
the ``cuda_jit`` name (an impl's name is a ``KernelBackend`` value; ``relu_squared`` has no
``cuda_jit`` impl) and runs on the CPU.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch

import polykernel
from polykernel.backends.declare import Backend
from polykernel.core import registry
from polykernel.spec import CapabilityRequirement
from polykernel.testing import isolated

OP_ID = "activation.relu_squared"
TOY = Backend("cuda_jit", capabilities=CapabilityRequirement.CPU, dtypes=("float32",), rank=90, description="a toy backend")
CALLS: list[tuple[int, ...]] = []


def toy_gate(a) -> str | None:  # the backend's _gates.py: reads the argument class by field name
    return None if not a.needs_grad else "the toy backend has no backward"


def relu_squared_toy(x: torch.Tensor) -> torch.Tensor:  # the adapter: the op's positional arguments
    CALLS.append(tuple(x.shape))
    return torch.relu(x.float()).square().to(x.dtype)


IMPLS = {OP_ID: TOY.impl(description="relu(x)² in torch, counted", predicate=toy_gate, target=f"{__name__}:relu_squared_toy")}


@pytest.fixture
def toy() -> Iterator[None]:
    with isolated():
        for op_id, row in IMPLS.items():
            polykernel.register_impl(row.spec(op_id))
        polykernel.clear_caches()
        CALLS.clear()
        yield
    polykernel.clear_caches()


def test_the_toy_impl_dispatches_by_name_and_by_rank(toy):
    x = torch.randn(3, 5)
    torch.testing.assert_close(polykernel.relu_squared(x, impl="cuda_jit"), torch.relu(x).square())
    assert CALLS == [(3, 5)]
    # rank 90: ahead of the torch impl (100), behind triton (10) where Triton runs
    assert polykernel.available_impls("relu_squared", device="cpu", dtype=torch.float32)[-2:] == ["cuda_jit", "torch"]


def test_the_toy_impl_shows_in_explain_with_its_gate(toy):
    rows = {r["name"]: r for r in polykernel.explain("relu_squared", torch.randn(4)).impls}
    assert rows["cuda_jit"]["runnable"] and rows["cuda_jit"]["rank"] == 90
    refused = {r["name"]: r for r in polykernel.explain("relu_squared", torch.randn(4, requires_grad=True)).impls}
    assert not refused["cuda_jit"]["runnable"] and "no backward" in refused["cuda_jit"]["reason"]
    assert "cuda_jit" not in polykernel.available_impls("relu_squared", device="cpu", dtype=torch.bfloat16)  # its dtypes


def test_the_toy_impl_is_a_bench_row(toy, monkeypatch):
    from polykernel.tools import bench, bench_shapes
    from polykernel.tools.console import make_console

    def fake_measure(fn, grad_inputs, backward, graph=False, warmup=25, rep=100):  # timing needs CUDA
        with torch.set_grad_enabled(backward):
            fn()
        return 0.5, 1.0

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4000.0)
    monkeypatch.setattr(bench_shapes, "SHAPES", {"relu_squared": [("64x256", (64, 256))]})
    rows, _ = bench.run(["relu_squared"], False, torch.float32, device="cpu", console=make_console(io.StringIO(), force_terminal=False))
    forward = [r for r in rows if r["mode"] == "fwd"]
    toy_row = next(r for r in forward if r["impl"] == "polykernel:cuda_jit")
    assert not toy_row.get("error") and (64, 256) in CALLS


def test_nothing_of_the_toy_is_left_after_it():
    assert "cuda_jit" not in registry.specs_for(OP_ID)
    assert "cuda_jit" not in polykernel.available_impls("relu_squared", device="cpu", dtype=torch.float32)
