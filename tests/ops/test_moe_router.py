"""moe.moe_router: softmax then top-k (ties to the lower expert, optional renormalisation),
parity of every runnable impl with the reference, its gradient, argument errors (with moe_experts
under torch.compile: test_moe_experts.py)."""

import pytest
import torch

import polykernel
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops import moe_router as router_op
from polykernel.testing import assert_parity

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_router_parity(dtype):
    assert_parity("moe_router", device="cpu", dtypes=[dtype])


def test_router_is_softmax_then_top_k():
    logits = torch.randn(50, 16, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    top, idx = torch.topk(probs, 4, dim=-1)  # no ties in random fp64 logits
    w, i = polykernel.moe_router(logits, 4, renormalize=False)
    assert torch.equal(i, idx)
    torch.testing.assert_close(w, top)
    w, i = polykernel.moe_router(logits, 4)
    assert torch.equal(i, idx)
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(w.sum(-1), torch.ones(50, dtype=torch.float64))


def test_router_ties_go_to_the_lower_expert_and_weights_keep_the_dtype():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]], dtype=torch.bfloat16)
    w, i = polykernel.moe_router(logits, 2)
    assert i.tolist() == [[1, 2]] and i.dtype == torch.int64 and w.dtype == torch.bfloat16
    assert w.float().tolist() == [[0.5, 0.5]]


def test_router_gradient_flows_to_the_logits():
    logits = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    w, _ = polykernel.moe_router(logits, 3)
    (g,) = torch.autograd.grad(w.pow(2).sum(), logits)
    assert torch.autograd.gradcheck(lambda x: polykernel.moe_router(x, 3)[0], (logits,))
    assert g.count_nonzero() > 0


@pytest.mark.parametrize(
    "args, kw, exc, words",
    [
        ((torch.randn(4, 8), 9), {}, OpArgumentError, "'top_k'"),
        ((torch.randn(4, 8), 0), {}, OpArgumentError, "'top_k'"),
        ((torch.randn(4, 8), True), {}, OpTypeError, "'top_k'"),
        ((torch.randn(4, 8), 2.0), {}, OpTypeError, "'top_k'"),
        ((torch.randn(4, 8), 2), {"renormalize": 1}, OpTypeError, "'renormalize'"),
        ((torch.randint(0, 3, (4, 8)), 2), {}, OpTypeError, "'logits'"),
        ((torch.randn(()), 1), {}, OpArgumentError, "'logits'"),
    ],
)
def test_router_bad_input_names_op_and_argument(args, kw, exc, words):
    with pytest.raises(exc) as info:
        polykernel.moe_router(*args, **kw)
    assert "moe.moe_router" in str(info.value) and words in str(info.value)


def test_router_bytes_moved():
    assert router_op.bytes_moved(torch.randn(4, 8), 2) == 4 * (8 * 4 + 2 * (4 + 8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_router_parity_gpu_large(dtype):
    assert_parity("moe_router", device="cuda", dtypes=[dtype], large=True)
