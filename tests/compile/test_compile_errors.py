"""Under torch.compile(fullgraph=True), a bad argument raises the same OpArgumentError as in eager
(issue 27: eps=-1.0 and eps=nan gave Dynamo `Unsupported` errors). Dynamo cannot raise out of a
fullgraph trace, so such a call is traced as a node that raises the trace's error when the graph
runs (the custom op's own check saw eps=True as 1.0 and passed it); ops that decompose under
compile (fused_add_rms_norm) and ops that write in place included."""

from __future__ import annotations

import logging

import pytest
import torch

import polykernel
from polykernel.errors import OpArgumentError, UnknownImplError


def _moe_args():
    index = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2], [1, 3]])
    return torch.randn(6, 16), index, torch.full((6, 2), 0.5), torch.randn(4, 64, 16) / 4, torch.randn(4, 16, 32) / 6


def _gpt_oss_args():
    x, index, weights, _, _ = _moe_args()
    return x, index, weights, torch.randn(4, 16, 64) / 4, torch.zeros(4, 64), torch.randn(4, 32, 16) / 6, torch.zeros(4, 16)


BAD = [
    ("rms_norm", lambda: (torch.randn(4, 8), torch.ones(8)), {"eps": -1.0}, "eps"),
    ("rms_norm", lambda: (torch.randn(4, 8), torch.ones(8)), {"eps": float("nan")}, "eps"),
    ("layer_norm", lambda: (torch.randn(4, 8), torch.ones(8), torch.zeros(8)), {"eps": -1.0}, "eps"),
    ("fused_add_rms_norm", lambda: (torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)), {"eps": float("nan")}, "eps"),
    ("cross_entropy", lambda: (torch.randn(4, 8), torch.randint(0, 8, (4,))), {"label_smoothing": 2.0}, "label_smoothing"),
    # A bool where a number goes: the schema's float or int took it as 1.0 or 1, so the run-time
    # check passed and the call ran with that value, silently.
    ("rms_norm", lambda: (torch.randn(4, 8), torch.ones(8)), {"eps": True}, "eps"),
    ("rms_norm", lambda: (torch.randn(4, 8), torch.ones(8)), {"offset": False}, "offset"),
    ("layer_norm", lambda: (torch.randn(4, 8), torch.ones(8), torch.zeros(8)), {"eps": True}, "eps"),
    ("cross_entropy", lambda: (torch.randn(4, 8), torch.randint(0, 8, (4,))), {"ignore_index": True}, "ignore_index"),
    ("cross_entropy", lambda: (torch.randn(4, 8), torch.randint(0, 8, (4,))), {"label_smoothing": True}, "label_smoothing"),
    # a tensor where a number goes: the message's repr of it was a Dynamo `Unsupported` (no values to print)
    ("rms_norm", lambda: (torch.randn(4, 8), torch.ones(8)), {"eps": torch.tensor(1e-6)}, "eps"),
    ("cross_entropy", lambda: (torch.randn(4, 8), torch.randint(0, 8, (4,))), {"label_smoothing": torch.tensor(0.1)}, "label_smoothing"),
    # a float where an int goes: the schema refused it while tracing (TorchRuntimeError)
    ("cross_entropy", lambda: (torch.randn(4, 8), torch.randint(0, 8, (4,))), {"ignore_index": 1.5}, "ignore_index"),
    # the MoE ops validate CPU calls in the public function (the index values): there, in the
    # traced code, the error was raised, which fullgraph reported as "Observed exception" only
    ("moe_experts", _moe_args, {"activation": "bogus"}, "activation"),
    ("moe_experts_gpt_oss", _gpt_oss_args, {"alpha": float("nan")}, "alpha"),
    ("moe_experts_gpt_oss", _gpt_oss_args, {"limit": -1.0}, "limit"),
]


@pytest.mark.parametrize(("op", "make", "bad", "arg"), BAD, ids=[f"{b[0]}-{k}={v}" for b in BAD for k, v in b[2].items()])
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
    assert type(got.value) is type(eager.value)
    assert (got.value.op, got.value.arg) == (eager.value.op, eager.value.arg) == (eager.value.op, arg)


# A non-tensor where a tensor goes: the custom op's schema refused it while tracing (torch's
# TorchRuntimeError "Expected a value of type 'Tensor'"), not the op's own OpTypeError.
NOT_TENSORS = [
    ("rms_norm", lambda: (torch.randn(4, 8),), {"weight": [1.0] * 8}, "weight"),
    ("rms_norm", lambda: (torch.randn(4, 8),), {"weight": 1.0}, "weight"),
    ("layer_norm", lambda: (torch.randn(4, 8), torch.ones(8)), {"bias": "zeros"}, "bias"),
    ("cross_entropy", lambda: (torch.randn(4, 8),), {"target": [1, 2, 3, 0]}, "target"),
    ("fused_add_rms_norm_", lambda: (torch.randn(4, 8), torch.randn(4, 8)), {"weight": [1.0] * 8}, "weight"),
]


@pytest.mark.parametrize(("op", "make", "bad", "arg"), NOT_TENSORS, ids=[f"{b[0]}-{b[3]}" for b in NOT_TENSORS])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_non_tensor_argument_under_fullgraph_compile_is_the_eager_error(op, make, bad, arg, backend):
    fn = getattr(polykernel, op)
    args = make()
    before = [a.clone() for a in args]
    with torch.no_grad(), pytest.raises(OpArgumentError) as eager:
        fn(*args, **bad)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fn(*a, **bad), fullgraph=True, backend=backend)
    with torch.no_grad(), pytest.raises(OpArgumentError) as got:
        compiled(*args)
    assert type(got.value) is type(eager.value)
    assert (got.value.op, got.value.arg) == (eager.value.op, eager.value.arg) and eager.value.arg == arg
    assert all(torch.equal(a, b) for a, b in zip(args, before))  # an in-place op wrote nothing


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_bad_option_of_an_in_place_op_raises_before_writing(backend):
    # eps=True went through the mutating custom op as eps=1.0: x and residual were overwritten
    x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)
    x0, r0 = x.clone(), r.clone()
    with pytest.raises(OpArgumentError) as eager:
        polykernel.fused_add_rms_norm_(x, r, w, eps=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, r, w: polykernel.fused_add_rms_norm_(x, r, w, eps=True), fullgraph=True, backend=backend)
    with torch.no_grad(), pytest.raises(OpArgumentError) as got:
        compiled(x, r, w)
    assert (got.value.op, got.value.arg) == (eager.value.op, eager.value.arg) == ("serving.fused_add_rms_norm_", "eps")
    assert torch.equal(x, x0) and torch.equal(r, r0)


def test_valid_call_under_fullgraph_compile_still_runs():
    x, w = torch.randn(4, 8), torch.ones(8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: polykernel.rms_norm(x, w, eps=1e-5), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w), polykernel.rms_norm(x, w, eps=1e-5))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("op", ["cross_entropy", "fused_linear_cross_entropy"])
def test_compiled_cpu_call_checks_the_target_on_every_call(op, grad):
    # On the CPU the eager public functions check a target's class range on every call.
    # Compiled, the trace sees fake tensors (no values) and the custom op went through the
    # dispatcher, which validates a class once: after a valid call, an out-of-range target gave
    # a NaN loss, silently.
    h, w = torch.randn(4, 8, requires_grad=grad), torch.randn(10, 8)
    if op == "cross_entropy":
        fn = lambda h, t: polykernel.cross_entropy(h @ w.T, t)
    else:
        fn = lambda h, t: polykernel.fused_linear_cross_entropy(h, w, t)
    good, bad = torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 30, 4])
    with pytest.raises(OpArgumentError) as eager:
        fn(h, bad)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    compiled(h, good)  # valid: the dispatcher decides (and validates) the class
    with pytest.raises(OpArgumentError) as got:
        compiled(h, bad)
    assert (got.value.op, got.value.arg) == (eager.value.op, eager.value.arg) == (f"loss.{op}", "target")


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("impl", [5, True])
def test_impl_that_is_no_name_is_the_eager_error_under_compile(impl, fullgraph):
    # the compiled call turned impl= into the schema's string by iterating it: raised in the
    # traced code, fullgraph said "Observed exception" and without fullgraph Dynamo hit a
    # RecursionError; eager names the op and the impl (UnknownImplError)
    x, w = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(UnknownImplError) as eager:
        polykernel.rms_norm(x, w, impl=impl)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: polykernel.rms_norm(x, w, impl=impl), fullgraph=fullgraph, backend="eager")
    with pytest.raises(UnknownImplError) as got:
        compiled(x, w)
    assert got.value.op == eager.value.op == "norm.rms_norm" and got.value.impl == eager.value.impl == str(impl)


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("swiglu", lambda: (torch.randn(4, 8), torch.randn(4, 9))),
        ("jsd", lambda: (torch.randn(3, 4).log_softmax(-1), torch.randn(3, 4).log_softmax(-1), torch.tensor([0, 1, 2, 3]))),
    ],
)
def test_bad_shapes_under_compile_log_no_torch_error(op, args):
    # Such a call is traced to raise when the graph runs; its custom op's fake impl ran the
    # reference on the bad arguments first, and torch logged the meta kernel's refusal as an ERROR
    # with a traceback ("failed while attempting to run meta for aten.where.self") before the op's
    # own error: the op's output shapes stand in for it now
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_log.addHandler(handler)
    try:
        fn = getattr(polykernel, op)
        with pytest.raises(OpArgumentError) as eager:
            fn(*args())
        torch._dynamo.reset()
        with pytest.raises(OpArgumentError) as got:
            torch.compile(fn, fullgraph=True, backend="eager")(*args())
    finally:
        fake_log.removeHandler(handler)
    assert (got.value.op, got.value.arg) == (eager.value.op, eager.value.arg)
    assert not [r.getMessage() for r in records]
