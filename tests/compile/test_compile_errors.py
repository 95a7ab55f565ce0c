"""Under torch.compile(fullgraph=True), a bad argument raises the same OpArgumentError as in eager
(issue 27: eps=-1.0 and eps=nan gave Dynamo `Unsupported` errors). Dynamo cannot raise out of a
fullgraph trace, so such a call is traced as the plain custom op, whose real impl validates when
the graph runs; ops that decompose under compile (fused_add_rms_norm) included."""

from __future__ import annotations

import pytest
import torch

import polykernel
from polykernel.errors import OpArgumentError

BAD = [
    ("rms_norm", lambda: (torch.randn(4, 8), torch.ones(8)), {"eps": -1.0}, "eps"),
    ("rms_norm", lambda: (torch.randn(4, 8), torch.ones(8)), {"eps": float("nan")}, "eps"),
    ("layer_norm", lambda: (torch.randn(4, 8), torch.ones(8), torch.zeros(8)), {"eps": -1.0}, "eps"),
    ("fused_add_rms_norm", lambda: (torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)), {"eps": float("nan")}, "eps"),
    ("cross_entropy", lambda: (torch.randn(4, 8), torch.randint(0, 8, (4,))), {"label_smoothing": 2.0}, "label_smoothing"),
]


@pytest.mark.parametrize(("op", "make", "bad", "arg"), BAD, ids=[f"{b[0]}-{next(iter(b[2].values()))}" for b in BAD])
@pytest.mark.parametrize("grad", [False, True])
def test_bad_option_under_fullgraph_compile_is_the_eager_error(op, make, bad, arg, grad):
    fn = getattr(polykernel, op)
    args = make()
    if grad:
        args = (args[0].requires_grad_(), *args[1:])
    with pytest.raises(OpArgumentError) as eager:
        fn(*args, **bad)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fn(*a, **bad), fullgraph=True, backend="eager")
    with pytest.raises(OpArgumentError) as got:
        compiled(*args)
    assert (got.value.op, got.value.arg) == (eager.value.op, eager.value.arg) == (eager.value.op, arg)


def test_valid_call_under_fullgraph_compile_still_runs():
    x, w = torch.randn(4, 8), torch.ones(8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: polykernel.rms_norm(x, w, eps=1e-5), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w), polykernel.rms_norm(x, w, eps=1e-5))
