"""``explain`` reports what the real call would do: dtype names parsed, the op's validation run
(an int dtype, a missing argument), and global preferences that name only impls ops have."""

from __future__ import annotations

import pytest
import torch

import polykernel
from polykernel.core import explain_args, registry
from polykernel.errors import OpArgumentError, OpTypeError


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("half", torch.float16),
        ("fp32", torch.float32),
        ("float32", torch.float32),
        (" FP64 ", torch.float64),
    ],
)
def test_a_dtype_name_is_parsed(name, dtype):
    e = polykernel.explain("rms_norm", device="cpu", dtype=name)
    assert e.arg_class["dtype"] is dtype and e.arg_class["weight_dtype"] is dtype
    assert e.chosen is not None and e.error is None
    assert polykernel.available_impls("rms_norm", device="cpu", dtype=name) == polykernel.available_impls(
        "rms_norm", device="cpu", dtype=dtype
    )


@pytest.mark.parametrize("bad", ["bf17", "", "nn", "float32x"])
def test_an_unknown_dtype_name_is_an_error_listing_the_accepted_names(bad):
    with pytest.raises(OpArgumentError, match="argument 'dtype'") as info:
        polykernel.explain("rms_norm", dtype=bad)
    assert "'bf16'" in str(info.value) and "'float32'" in str(info.value)


def test_a_dtype_that_is_no_name_is_a_type_error():
    with pytest.raises(OpTypeError, match=r"argument 'dtype'.*expected a torch\.dtype"):
        polykernel.explain("rms_norm", dtype=3)


def test_an_unknown_device_names_the_argument():
    with pytest.raises(OpArgumentError, match="argument 'device': 'gpu' is not a device"):
        polykernel.explain("rms_norm", device="gpu")


@pytest.mark.parametrize("op_id", polykernel.list_ops())
def test_an_int_dtype_is_refused_as_the_real_call_refuses_it(op_id):
    op = registry.get_op(op_id)
    cases = op.cases("cpu", torch.float32)
    case = next((c for c in cases if not c.kwargs), cases[0])  # (GRPO has no call without options: beta needs ref log-probs)
    ints = [a.detach().to(torch.int32) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in case.args]
    with pytest.raises(OpTypeError) as real:
        getattr(polykernel, op.name)(*ints, **case.kwargs)
    e = polykernel.explain(op_id, device="cpu", dtype=torch.int32)
    assert e.chosen is None and e.error == str(real.value)
    assert all(not r["runnable"] and r["reason"] == "dtype int32 not supported" for r in e.impls), e.impls
    assert "chosen: none" in str(e)


def test_explain_with_only_a_dtype_leaves_the_random_stream_alone():
    explain_args._stand_ins.clear()  # the stand-in arguments are drawn on the first such explain
    torch.manual_seed(1)
    want = torch.rand(4)
    torch.manual_seed(1)
    polykernel.explain("rms_norm", device="cpu", dtype=torch.int32)
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize(
    "op_name, args",
    [
        ("rms_norm", lambda: (torch.randn(4, 8),)),
        ("fused_linear_cross_entropy", lambda: (torch.randn(4, 8),)),
        ("rope", lambda: (torch.randn(1, 2, 3, 4),)),
    ],
    ids=["weight", "weight-and-target", "k-cos-sin"],
)
def test_a_missing_argument_raises_what_the_real_call_raises(op_name, args):
    with pytest.raises(TypeError) as real:
        getattr(polykernel, op_name)(*args())
    with pytest.raises(TypeError) as got:
        polykernel.explain(op_name, *args())
    assert str(got.value) == str(real.value)  # e.g. "rms_norm() missing 1 required positional argument: 'weight'"
    assert "_key" not in str(got.value)


def test_an_unknown_keyword_names_the_op():
    with pytest.raises(TypeError, match=r"rms_norm\(\).*'casing'"):
        polykernel.explain("rms_norm", torch.randn(4, 8), torch.ones(8), casing="llama")


def test_bad_arguments_raise_what_the_real_call_raises():
    x, w = torch.ones(2, 8, dtype=torch.int32), torch.ones(8, dtype=torch.int32)
    with pytest.raises(OpTypeError) as real:
        polykernel.rms_norm(x, w)
    with pytest.raises(OpTypeError) as got:
        polykernel.explain("rms_norm", x, w)
    assert str(got.value) == str(real.value)
    with pytest.raises(OpArgumentError, match="'casting'"):
        polykernel.explain("rms_norm", torch.randn(2, 8), torch.ones(8), casting="gemma")


def _used_impls() -> set[str]:
    registry.load_catalog()
    return {impl for op_id in registry.all_op_ids() for impl in registry.specs_for(op_id)}


def test_an_unknown_global_name_lists_the_impls_the_ops_have():
    with pytest.raises(ValueError) as info:
        with polykernel.use_impl("tritonn"):
            pass
    text = str(info.value)
    listed = text.split("the ops' impls are: ")[1].split(" (")[0].split(";")[0]
    assert set(listed.split(", ")) == _used_impls()
    assert "did you mean 'triton'?" in text
    reserved = sorted(b.value for b in polykernel.KernelBackend if b.value not in _used_impls())
    if reserved:  # the backends no op has yet are named apart, as reserved
        assert f"KernelBackend also reserves {', '.join(reserved)}, which no op has yet" in text


def test_a_backend_no_op_has_is_still_a_preference():
    unused = [b.value for b in polykernel.KernelBackend if b.value not in _used_impls()]
    if not unused:
        pytest.skip("every KernelBackend value has an impl")
    polykernel.set_impl(unused[0])  # skips every op, as a preference does
    assert polykernel.explain("rms_norm", torch.randn(2, 8), torch.ones(8)).source == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks about CUDA on a machine without it")
def test_explain_for_cuda_answers_on_a_machine_without_cuda():
    e = polykernel.explain("rms_norm", device="cuda", dtype="bf16")  # was: a RuntimeError from the capture query
    assert {r["name"]: r["reason"] for r in e.impls}["cute_dsl"] == "needs a CUDA device"


def test_the_public_function_names_its_op():
    # explain(polykernel.rms_norm, ...) reads as the call it explains; the name and the Op agree
    x, w = torch.randn(3, 8), torch.ones(8)
    by_function = polykernel.explain(polykernel.rms_norm, x, w)
    assert by_function.op == "norm.rms_norm"
    assert by_function.chosen == polykernel.explain("rms_norm", x, w).chosen
    assert polykernel.explain(polykernel.fused_linear_dpo_loss, device="cpu").op == registry.get_op("fused_linear_dpo_loss").id
    assert registry.get_op(registry.get_op("swiglu")) is registry.get_op("swiglu")


@pytest.mark.parametrize("not_an_op", [len, torch.nn.functional.rms_norm, 3])
def test_something_that_is_not_an_op_is_an_unknown_op_error(not_an_op):
    with pytest.raises(polykernel.errors.UnknownOpError, match="unknown op"):
        polykernel.explain(not_an_op, device="cpu")


def test_explain_shows_a_skipped_preference_and_leaves_its_log_line_to_the_call(caplog):
    # explain resolved the call, which logged the once-only line: the call itself then logged nothing
    polykernel.clear_caches()
    x, w = torch.randn(4, 8), torch.ones(8)
    with polykernel.use_impl("liger"), caplog.at_level("WARNING", logger="polykernel"):
        e = polykernel.explain("rms_norm", x, w)
        assert e.chosen != "liger" and any("preference liger skipped" in n for n in e.notes)
        assert "note: " in str(e) and e.as_dict()["notes"] == e.notes
        assert "skipped" not in caplog.text
        polykernel.rms_norm(x, w)
    assert caplog.text.count("preference liger skipped") == 1
