"""``torch.compile(dynamic=True)``: float options arrive as symbolic floats.

Dynamo traces a module's float attributes (a norm's eps, Gemma's offset) and a function's float
arguments as symbolic floats under ``dynamic=True``. The ops' validation, which runs in the trace,
called ``math.isfinite`` on them, which Dynamo cannot trace: ``fullgraph=True`` failed (a patched
Llama too) and without it every norm was a graph break.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import polykernel
from polykernel.errors import OpArgumentError
from polykernel.ops.rms_norm import reference as rms_reference


@pytest.fixture(autouse=True)
def _dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Norm(torch.nn.Module):
    def __init__(self, n: int, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(n))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return polykernel.rms_norm(x, self.weight, self.eps, offset=self.offset)


@pytest.mark.parametrize("grad", [False, True])
def test_module_float_attributes_under_dynamic_fullgraph(grad):
    norm = _Norm(8, 1e-5, 0.5)
    counters.clear()
    compiled = torch.compile(norm, backend="aot_eager", dynamic=True, fullgraph=True)
    for rows in (3, 5):
        x = torch.randn(rows, 8, requires_grad=grad)
        torch.testing.assert_close(compiled(x), rms_reference(x, norm.weight, 1e-5, 0.5))
    assert counters["stats"]["unique_graphs"] == 1  # one graph for both row counts


def test_float_argument_under_dynamic_fullgraph():
    x, w = torch.randn(4, 8), torch.randn(8)
    compiled = torch.compile(lambda x, w, eps: polykernel.rms_norm(x, w, eps), backend="aot_eager", dynamic=True, fullgraph=True)
    for eps in (1e-6, 0.5):
        torch.testing.assert_close(compiled(x, w, eps), rms_reference(x, w, eps))
    with pytest.raises(OpArgumentError):  # still checked: a named error, not a silent NaN
        compiled(x, w, float("nan"))
