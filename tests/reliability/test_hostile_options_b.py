"""Bad options are named errors, never silently wrong results (issue 32).

- ``ignore_index`` must fit the labels' integer dtype: torch compares an integer tensor with a
  Python int in the tensor's dtype, wrapping (int32 labels equal ``2**32 + 5`` where they hold 5),
  so such a value used to drop rows (jsd, tvd, the preference losses) or double the Triton cross
  entropy; beyond int64 the Triton kernels raised a raw ``OverflowError`` and were marked broken.
- A bool option takes exactly True or False (``compute_nll_loss="False"`` used to add the NLL);
  KTO's integer preference labels are 0 or 1.
- A repeat of an argument class must not let ``mrope_section=[2.0, 1, 1]`` through after
  ``[2, 1, 1]`` (equal as lists).
- ``POLYKERNEL_NATIVE`` fails the first op call; rotary_embedding_ names ``positions``; a
  normalisation's ``eps`` is finite.

The hypothesis tests draw labels of every integer dtype each op accepts with extreme
``ignore_index`` values, and non-bool values for every bool option of every op.
"""

from __future__ import annotations

import inspect
import math
import typing
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests._property import property_settings

import polykernel as pk
from polykernel.core import registry
from polykernel.errors import OpArgumentError
from polykernel.testing import runnable_impls

V = 16  # a vocabulary every label dtype holds (int8's and uint8's too)


def _impls(op: str) -> list[str]:
    return [i for i in ("torch", "triton") if i in runnable_impls(op, "cpu", torch.float32)]


def _rows_op(name: str):
    """``call(labels, ignore_index, impl)`` of an op whose labels are ``[4]`` rows."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(4, V, generator=g).log_softmax(-1)
    t = torch.randn(4, V, generator=g).log_softmax(-1)
    h, w = torch.randn(4, 8, generator=g), torch.randn(V, 8, generator=g)
    calls = {
        "jsd": lambda lab, ii, impl: pk.jsd(s, t, lab, ignore_index=ii, impl=impl),
        "tvd": lambda lab, ii, impl: pk.tvd(s.exp(), t.exp(), lab, ignore_index=ii, impl=impl),
        "fused_linear_jsd": lambda lab, ii, impl: pk.fused_linear_jsd(h, w, h.flip(0), w, lab, ignore_index=ii, impl=impl),
        "cross_entropy": lambda lab, ii, impl: pk.cross_entropy(s, lab, ignore_index=ii, impl=impl),
        "fused_linear_cross_entropy": lambda lab, ii, impl: pk.fused_linear_cross_entropy(h, w, lab, ignore_index=ii, impl=impl),
    }
    return calls[name]


def _pref_op(name: str):
    """``call(target, ignore_index, impl)`` of a preference loss over ``[4, 3]`` token ids (the loss)."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 3, 8, generator=g), torch.randn(V, 8, generator=g)
    fn = getattr(pk, name)
    if name == "fused_linear_kto_loss":
        return lambda tgt, ii, impl: fn(h, w, tgt, torch.tensor([True, False, True, False]), ignore_index=ii, impl=impl).loss
    return lambda tgt, ii, impl: fn(h, w, tgt, ignore_index=ii, impl=impl).loss


ROWS_OPS = ["jsd", "tvd", "fused_linear_jsd", "cross_entropy", "fused_linear_cross_entropy"]
PREF_OPS = [
    "fused_linear_dpo_loss",
    "fused_linear_cpo_loss",
    "fused_linear_orpo_loss",
    "fused_linear_simpo_loss",
    "fused_linear_kto_loss",
]
# The label dtypes each op accepts: the row losses int32 and int64, the preference losses any integer.
ROWS_DTYPES = [torch.int32, torch.int64]
PREF_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


def _labels(op: str, dtype: torch.dtype) -> torch.Tensor:
    shape = (4,) if op in ROWS_OPS else (4, 3)
    return (torch.arange(math.prod(shape)) % 6).reshape(shape).to(dtype)  # ids 0..5: 5 is the wrapped value below


def _call(op: str):
    return _rows_op(op) if op in ROWS_OPS else _pref_op(op)


def _assert_named(call, arg: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="polykernel")
        with pytest.raises(OpArgumentError, match=rf"argument '{arg}'"):
            call()


def _no_fallback_rows(op_id: str) -> None:
    rows = [d for d in pk.decisions() if d["op"] == op_id]
    assert all(d["source"] != "fallback" for d in rows), rows


# -- item 2: an ignore_index outside the labels' dtype never wraps onto a label ---------------------


@pytest.mark.parametrize("op", ROWS_OPS + PREF_OPS)
def test_ignore_index_outside_int32_labels_is_a_named_error(op, polykernel_reset):
    call = _call(op)
    lab = _labels(op, torch.int32)
    for impl in _impls(op):
        _assert_named(lambda impl=impl: call(lab, 2**32 + 5, impl), "ignore_index")  # used to equal the labels' 5
        _assert_named(lambda impl=impl: call(lab, -(2**31) - 1, impl), "ignore_index")
    _assert_named(lambda: call(lab, 2**32 + 5, None), "ignore_index")


@pytest.mark.parametrize("op", ROWS_OPS + PREF_OPS)
def test_int64_labels_take_any_int64_ignore_index(op):
    # torch's F.cross_entropy takes any int64 ignore_index: one no label holds ignores nothing
    call = _call(op)
    lab = _labels(op, torch.int64)
    for impl in _impls(op):
        torch.testing.assert_close(call(lab, 2**32 + 5, impl), call(lab, -100, impl))


@pytest.mark.parametrize("op", PREF_OPS)
def test_uint8_targets_reject_a_negative_ignore_index(op):
    # uint8 ids compare with -100 as 156: rejected, not a silently ignored token
    call = _call(op)
    _assert_named(lambda: call(_labels(op, torch.uint8), -100, "torch"), "ignore_index")
    torch.testing.assert_close(call(_labels(op, torch.uint8), 255, "torch"), call(_labels(op, torch.int64), -100, "torch"))


# -- item 4: beyond int64, named before any kernel; nothing marked broken --------------------------


@pytest.mark.parametrize("op", ["jsd", "tvd", "fused_linear_jsd"])
def test_ignore_index_beyond_int64_is_named_and_marks_nothing(op, polykernel_reset):
    call = _call(op)
    lab = _labels(op, torch.int64)
    for impl in [*_impls(op), None]:
        _assert_named(lambda impl=impl: call(lab, 2**70, impl), "ignore_index")
    call(lab, -100, None)  # auto selection afterwards: its first choice, no fallback
    _no_fallback_rows(registry.get_op(op).id)


# -- item 3: bool options take exactly a bool ----------------------------------------------------


def _bool_calls() -> dict[tuple[str, str], typing.Callable[[object], object]]:
    """Per (op, bool option): a valid call with that option set to the given value."""
    g = torch.Generator().manual_seed(0)
    h, w, tgt = torch.randn(4, 3, 8, generator=g), torch.randn(V, 8, generator=g), torch.randint(0, V, (4, 3), generator=g)
    pl = torch.tensor([True, False, True, False])
    x = torch.randn(4, V, generator=g)
    q, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    cos, sin = torch.randn(1, 3, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    mask, adv = torch.ones(4, 3), torch.randn(4, generator=g)
    pos, cache = torch.tensor([0, 1, 2]), torch.randn(8, 8, generator=g)
    return {
        ("fused_linear_dpo_loss", "average_log_prob"): lambda v: pk.fused_linear_dpo_loss(h, w, tgt, average_log_prob=v),
        ("fused_linear_dpo_loss", "compute_nll_loss"): lambda v: pk.fused_linear_dpo_loss(h, w, tgt, compute_nll_loss=v),
        ("fused_linear_cpo_loss", "average_log_prob"): lambda v: pk.fused_linear_cpo_loss(h, w, tgt, average_log_prob=v),
        ("fused_linear_kto_loss", "average_log_prob"): lambda v: pk.fused_linear_kto_loss(h, w, tgt, pl, average_log_prob=v),
        ("fused_linear_orpo_loss", "compute_nll_loss"): lambda v: pk.fused_linear_orpo_loss(h, w, tgt, compute_nll_loss=v),
        ("fused_linear_grpo_loss", "use_bias_correction_kl"): lambda v: pk.fused_linear_grpo_loss(
            h, w, tgt, mask, adv, ref_per_token_logps=torch.zeros(4, 3), use_bias_correction_kl=v
        ),
        ("fused_linear_cross_entropy", "return_token_accuracy"): lambda v: pk.fused_linear_cross_entropy(
            h[0], w, tgt[0], return_token_accuracy=v
        ),
        ("kl_div", "log_target"): lambda v: pk.kl_div(x.log_softmax(-1), x.softmax(-1), log_target=v),
        ("rope", "interleaved"): lambda v: pk.rope(q, k, cos, sin, interleaved=v),
        ("dynamic_quant_fp8", "per_token"): lambda v: pk.dynamic_quant_fp8(x, per_token=v),
        ("rotary_embedding_", "is_neox"): lambda v: pk.rotary_embedding_(pos, torch.randn(3, 16), None, 8, cache, is_neox=v),
        ("moe_router", "renormalize"): lambda v: pk.moe_router(x, 2, renormalize=v),
    }


def _public_bool_options() -> set[tuple[str, str]]:
    """Every public op's options annotated bool (or defaulting to a bool)."""
    out = set()
    for op_id in registry.all_op_ids():
        name = op_id.rpartition(".")[2]
        fn = getattr(pk, name)
        hints = typing.get_type_hints(fn)
        for p in inspect.signature(fn).parameters.values():
            if hints.get(p.name) is bool or isinstance(p.default, bool):
                out.add((name, p.name))
    return out


def test_every_bool_option_of_every_op_is_covered_here():
    # a new op's bool option must join _bool_calls (and so the checks below)
    assert _public_bool_options() == set(_bool_calls())


@pytest.mark.parametrize("op, option", sorted(_bool_calls()))
def test_a_string_or_int_for_a_bool_option_is_a_named_error(op, option, polykernel_reset):
    call = _bool_calls()[(op, option)]
    call(True)
    call(False)  # valid calls first: a repeat of their class must not let a non-bool through
    for bad in ("False", "True", 0, 1, None, 1.0):
        _assert_named(lambda bad=bad: call(bad), option)


def test_dpo_string_false_no_longer_adds_the_nll():
    call = _bool_calls()[("fused_linear_dpo_loss", "compute_nll_loss")]
    _assert_named(lambda: call("False"), "compute_nll_loss")


def test_kto_integer_preference_labels_are_zero_or_one():
    g = torch.Generator().manual_seed(0)
    h, w, tgt = torch.randn(4, 3, 8, generator=g), torch.randn(V, 8, generator=g), torch.randint(0, V, (4, 3), generator=g)
    ok = pk.fused_linear_kto_loss(h, w, tgt, torch.tensor([1, 0, 1, 0])).loss
    torch.testing.assert_close(ok, pk.fused_linear_kto_loss(h, w, tgt, torch.tensor([True, False, True, False])).loss)
    for bad in ([2, 0, 1, 0], [1, 0, -1, 0]):
        _assert_named(lambda bad=bad: pk.fused_linear_kto_loss(h, w, tgt, torch.tensor(bad)), "preference_labels")


# -- item 5: a sequence option equal as a list but not in its items' types ------------------------


@pytest.mark.parametrize("impl", [None, "torch", "triton"])
def test_mrope_float_section_after_an_int_one_is_named(impl, polykernel_reset):
    if impl is not None and impl not in _impls("mrope"):
        pytest.skip(f"{impl} not runnable here")
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    cos, sin = torch.randn(3, 1, 6, 8), torch.randn(3, 1, 6, 8)
    pk.mrope(q, k, cos, sin, [2, 1, 1], impl=impl)
    for bad in ([2.0, 1, 1], (2, 1.0, 1), [2, 1, True]):
        _assert_named(lambda bad=bad: pk.mrope(q, k, cos, sin, bad, impl=impl), "mrope_section")
    pk.mrope(q, k, cos, sin, [2, 1, 1], impl=impl)
    _no_fallback_rows("embedding.mrope")


# -- item 9 ----------------------------------------------------------------------------------------


def test_a_bad_polykernel_native_fails_the_first_call(monkeypatch, polykernel_reset):
    monkeypatch.setenv("POLYKERNEL_NATIVE", "maybe")
    pk.clear_caches()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="polykernel")
        with pytest.raises(ValueError, match="POLYKERNEL_NATIVE='maybe'"):
            pk.rms_norm(torch.randn(2, 8), torch.ones(8))
    monkeypatch.setenv("POLYKERNEL_NATIVE", " Auto ")
    pk.clear_caches()
    pk.rms_norm(torch.randn(2, 8), torch.ones(8))


def test_rotary_embedding_names_a_bad_positions():
    cache, q = torch.randn(16, 8), torch.randn(2, 16)
    _assert_named(lambda: pk.rotary_embedding_(torch.tensor([0, 1, 2]), q, None, 8, cache), "positions")
    _assert_named(lambda: pk.rotary_embedding_(torch.tensor([0]), q, torch.randn(2, 8), 8, cache), "positions")
    _assert_named(lambda: pk.rotary_embedding_(torch.tensor([0, 1]), q, torch.randn(3, 8), 8, cache), "key")


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, -1e-6])
@pytest.mark.parametrize(
    "call",
    [
        lambda e: pk.rms_norm_quant_fp8(torch.randn(3, 8), torch.ones(8), torch.tensor(1.0), eps=e),
        lambda e: pk.rms_norm(torch.randn(3, 8), torch.ones(8), eps=e),
        lambda e: pk.layer_norm(torch.randn(3, 8), torch.ones(8), eps=e),
        lambda e: pk.fused_add_rms_norm(torch.randn(3, 8), torch.randn(3, 8), torch.ones(8), eps=e),
        lambda e: pk.fused_add_rms_norm_(torch.randn(3, 8), torch.randn(3, 8), torch.ones(8), eps=e),
    ],
    ids=["rms_norm_quant_fp8", "rms_norm", "layer_norm", "fused_add_rms_norm", "fused_add_rms_norm_"],
)
def test_a_non_finite_or_negative_eps_is_named(call, bad):
    _assert_named(lambda: call(bad), "eps")


# -- hypothesis: every label dtype, extreme ignore_index; non-bool options ------------------------

_EXTREMES = [-(2**63), 2**63 - 1, -(2**31) - 1, 2**31, 2**32 + 5, -(2**15) - 1, 2**15, 256, 255, 128, 127, -128, -129, -100, -1, 5]


@given(data=st.data())
@property_settings(12)
def test_ignore_index_of_any_label_dtype_matches_the_int64_comparison(data):
    op = data.draw(st.sampled_from(ROWS_OPS + PREF_OPS), label="op")
    dtype = data.draw(st.sampled_from(ROWS_DTYPES if op in ROWS_OPS else PREF_DTYPES), label="dtype")
    impl = data.draw(st.sampled_from(_impls(op)), label="impl")
    ii = data.draw(st.one_of(st.sampled_from(_EXTREMES), st.integers(-(2**63), 2**63 - 1)), label="ignore_index")
    info = torch.iinfo(dtype)
    call, lab = _call(op), _labels(op, dtype)
    if not info.min <= ii <= info.max:
        _assert_named(lambda: call(lab, ii, impl), "ignore_index")
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="polykernel")
        got = call(lab, ii, impl)
    # the semantics: the labels compared with ignore_index as int64 (torch's own comparison there)
    want = call(lab.long(), ii, "torch")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)


_NOT_BOOLS = st.one_of(
    st.sampled_from(["False", "True", "", "0", None, 0, 1, 2, 0.0, 1.0]),
    st.text(max_size=5),
    st.integers(),
    st.just(torch.tensor(True)),
)


@given(data=st.data())
@property_settings(20)
def test_a_non_bool_for_any_bool_option_is_named(data):
    calls = _bool_calls()
    op, option = data.draw(st.sampled_from(sorted(calls)), label="option")
    value = data.draw(_NOT_BOOLS, label="value")
    if data.draw(st.booleans(), label="valid call first"):
        calls[(op, option)](data.draw(st.booleans(), label="valid value"))
    _assert_named(lambda: calls[(op, option)](value), option)
