"""The GPU checks of the compiled custom ops besides Inductor (``test_compile.py``'s
``test_inductor_cuda``): ``opcheck`` on CUDA for every op, and a CUDA-graph replay. Apart from
``test_compile.py`` so that each runs in its own part of the GPU suite within its time
(``make test-gpu PART=compile`` and ``PART=models``, docs/testing.md)."""

from __future__ import annotations

import pytest
import torch
from test_compile import OP_IDS, _assert_same, _op, _opcheck_with_destinations, _overloads, _run, _small_cases

import polykernel
from polykernel.core.op import Case


@pytest.fixture(autouse=True)
def _dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("op_id", OP_IDS)
def test_opcheck_cuda(op_id):
    op = _op(op_id)
    _, fwd, _ = _overloads(op)
    for case in _small_cases(op, "cuda"):
        if op.writes:  # (torch 2.11, the H200's, fails an omitted `out`: see _with_destinations)
            _opcheck_with_destinations(fwd, op, case)
        else:
            torch.library.opcheck(fwd, case.args, case.kwargs)


@pytest.mark.gpu
def test_cuda_graphs_rms_norm():
    op = _op("norm.rms_norm")
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    case = Case("64x1024", (x, w))
    compiled = torch.compile(lambda x, w: polykernel.rms_norm(x, w), fullgraph=True, mode="reduce-overhead")
    want = _run(polykernel.rms_norm, case)
    for _ in range(3):  # warm-up, record, replay
        got = _run(compiled, case)
    _assert_same(op, case, got, want, torch.bfloat16, "rms_norm cuda graphs")
