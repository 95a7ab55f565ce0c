"""Recompiles under ``torch.compile``: what polykernel adds must not make Dynamo trace again.

A compiled call with the same shapes must reuse its graph (exactly one compile), and
``dynamic=True`` must hold one graph for every size. Counted with Dynamo's own counters, which
are deterministic: no timing here. Each test is one we failed once:

- ``patch(model, mode="inference")``'s attention table wrapped transformers' SDPA on a forward's
  first lookup, so the dict it filled changed between the first trace and the second call: the
  whole patched model compiled twice (the unpatched one, once).
- gpt-oss's experts validated ``limit`` with ``math.isinf``, which Dynamo cannot call on the
  symbolic float that ``dynamic=True`` makes of it: ``fullgraph=True`` failed, and without it the
  op was a graph break.
- The causal-LM loss of ``patch`` checked Gemma 2's final logit softcap with ``math.isfinite``:
  under ``dynamic=True`` the config's float is symbolic, and that check was a graph break in
  every training step (``fullgraph=True`` failed), where the unpatched model has none.
- An op that decomposes under compile (swiglu...) runs no impl there, so a ``set_impl(op=)``,
  ``use_impl(op=)`` or ``POLYKERNEL_IMPL_<OP>`` naming one was silently ignored, where the docs
  said those settings apply to compiled code: now logged while tracing.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from torch._dynamo.utils import counters

import polykernel
from polykernel import _compat
from polykernel.core import registry

transformers = pytest.importorskip("transformers")
from _tiny_llama import VOCAB, tiny_llama  # noqa: E402
from polykernel.integrations.transformers import patch  # noqa: E402


@pytest.fixture(autouse=True)
def _dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graphs_per_call(model: torch.nn.Module, lengths: tuple[int, ...], **compile_kwargs) -> list[int]:
    """Dynamo's count of distinct graphs after each no-grad call of the compiled ``model``, one
    call per sequence length."""
    counters.clear()
    compiled = torch.compile(model, backend="eager", **compile_kwargs)
    seen = []
    with torch.no_grad():
        for t in lengths:
            compiled(torch.randint(1, VOCAB, (2, t), generator=torch.Generator().manual_seed(t)))
            seen.append(counters["stats"]["unique_graphs"])
    return seen


@pytest.mark.parametrize("dynamic", [None, True])
def test_patched_inference_model_compiles_as_often_as_the_plain_one(dynamic):
    ref = tiny_llama(1)
    model = copy.deepcopy(ref)
    patch(model, mode="inference")
    lengths = (8, 8, 8, 11, 13)  # the same shape three times, then new lengths
    want = _graphs_per_call(ref, lengths, dynamic=dynamic)
    torch._dynamo.reset()
    got = _graphs_per_call(model, lengths, dynamic=dynamic, fullgraph=True)
    assert got[:3] == [1, 1, 1]  # a repeated shape never compiles again
    assert got == want


def _gpt_oss_experts_args(rows: int) -> tuple:
    case = registry.get_op("moe.moe_experts_gpt_oss").example((rows, 16), torch.float32, "cpu")
    return case.args


def test_gpt_oss_experts_under_dynamic_fullgraph_take_symbolic_floats():
    # alpha and limit as arguments: dynamic=True traces them as symbolic floats, as it traces a
    # module's float attributes (transformers' GptOssExperts.alpha, .limit). The custom op then
    # specializes them (as torch's own ops do their float options): one graph for every row count.
    def fn(*args, alpha, limit):
        return polykernel.moe_experts_gpt_oss(*args, alpha=alpha, limit=limit)

    counters.clear()
    compiled = torch.compile(fn, backend="eager", dynamic=True, fullgraph=True)
    for rows, alpha, limit in ((6, 1.5, 5.0), (9, 1.5, 5.0)):
        args = _gpt_oss_experts_args(rows)
        want = polykernel.moe_experts_gpt_oss(*args, alpha=alpha, limit=limit)
        torch.testing.assert_close(compiled(*args, alpha=alpha, limit=limit), want)
    assert counters["stats"]["unique_graphs"] == 1
    with pytest.raises(polykernel.OpArgumentError, match="finite limit"):  # still refused, named
        compiled(*_gpt_oss_experts_args(6), alpha=1.5, limit=float("inf"))


def test_patched_softcapped_model_trains_under_dynamic_fullgraph():
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    assert config.final_logit_softcapping  # the fused loss takes it as its softcap
    torch.manual_seed(0)
    model = patch(transformers.Gemma2ForCausalLM(config).train())
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    want = model(ids, labels=ids).loss
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True, fullgraph=True)  # a graph break raises
    got = compiled(ids, labels=ids).loss
    got.backward()
    torch.testing.assert_close(got, want)
    assert sum(counters["graph_break"].values()) == 0


# -- a choice naming an impl of an op that decomposes under compile ----------------------------


@pytest.fixture
def _unset():
    yield
    polykernel.set_impl(None)
    polykernel.clear_caches()  # the once-only log records


@pytest.mark.parametrize("how", ["set_impl", "use_impl", "env"])
def test_a_forced_impl_of_a_decomposed_op_is_reported_not_silently_ignored(how, monkeypatch, caplog, _unset):
    # swiglu decomposes under compile: the graph holds the reference's torch ops and no impl runs,
    # whatever names one. Such a choice is logged while tracing (named, as a patch fallback is).
    if _compat.comptime() is None:
        pytest.skip("the notice runs through comptime, which this torch (or POLYKERNEL_COMPAT_FALLBACKS) lacks")
    polykernel.clear_caches()
    scope = polykernel.use_impl("torch", op="swiglu") if how == "use_impl" else contextlib.nullcontext()
    if how == "set_impl":
        polykernel.set_impl("torch", op="swiglu")
    elif how == "env":
        monkeypatch.setenv("POLYKERNEL_IMPL_SWIGLU", "torch")
    x = torch.randn(4, 8)
    compiled = torch.compile(lambda a, b: polykernel.swiglu(a, b), backend="eager", fullgraph=True)
    with scope, caplog.at_level(logging.WARNING, logger="polykernel"):
        torch.testing.assert_close(compiled(x, x), polykernel.swiglu(x, x))
    assert any("swiglu" in r.getMessage() and "decomposes" in r.getMessage() for r in caplog.records), caplog.text


def test_a_decomposed_op_without_a_forced_impl_logs_nothing(caplog, _unset):
    polykernel.clear_caches()
    polykernel.set_impl("torch", op="rms_norm")  # another op's choice: not swiglu's
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="polykernel"):
        torch.compile(lambda a, b: polykernel.swiglu(a, b), backend="eager", fullgraph=True)(x, x)
        torch.compile(lambda a, b: polykernel.swiglu(a, b, impl="torch"), backend="eager", fullgraph=True)(x, x)
    assert not [r for r in caplog.records if "decomposes" in r.getMessage()]
