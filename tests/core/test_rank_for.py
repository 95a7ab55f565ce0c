"""``KernelSpec.rank_for``: a measured rank per argument class, honoured by auto (step 6) only.

Throwaway rms_norm impls are registered per test (the autouse reset removes them again); each
records its calls, so a test sees which impl actually ran.
"""

from __future__ import annotations

import pytest
import torch

import polykernel
from _tuning_helpers import only
from polykernel import tuning
from polykernel.core import registry
from polykernel.ops.rms_norm import reference
from polykernel.spec import CapabilityRequirement, KernelSpec
from polykernel.tuning import key as tuning_key

CALLS: list[str] = []
RULE_CALLS: list[object] = []
WHY = "N >= 16 forward, measured 1.4x over cuda_jit (test)"


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # keep the built-in Triton impl out of the way
    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("POLYKERNEL_TUNE", raising=False)
    polykernel.clear_caches()
    CALLS.clear()
    RULE_CALLS.clear()
    yield
    polykernel.clear_caches()


def long_forward(c):
    """Rank 5 for forward-only rows of N >= 16, else the static rank."""
    RULE_CALLS.append(c)
    return (5, WHY) if c.n is not None and c.n >= 16 and not c.needs_grad else None


def fake(backend, rank, **fields):
    def impl(x, weight, eps, offset, casting):
        CALLS.append(backend)
        return reference(x, weight, eps, offset, casting)

    caps = frozenset({CapabilityRequirement.CPU})
    polykernel.register_impl(op="rms_norm", backend=backend, rank=rank, capabilities=caps, **fields)(impl)


def call(n, grad=False):
    x = torch.randn(3, n, requires_grad=grad)
    w = torch.randn(n, requires_grad=grad)
    out = polykernel.rms_norm(x, w)
    torch.testing.assert_close(out, reference(x, w))
    return CALLS[-1]


def test_rank_for_moves_an_impl_ahead_for_its_argument_class_only():
    fake("cuda_jit", 10)
    fake("quack", 50, rank_for=long_forward)
    assert call(8) == "cuda_jit"  # N < 16: static ranks
    assert call(32) == "quack"  # N >= 16 forward: rank 5
    assert call(32, grad=True) == "cuda_jit"  # needs grad: static ranks
    assert polykernel.decisions("rms_norm")[-2]["source"] == "auto"


def test_explain_shows_the_measured_reason_and_the_rank_used():
    fake("cuda_jit", 10)
    fake("quack", 50, rank_for=long_forward)
    x, w = torch.randn(2, 64), torch.randn(64)
    e = polykernel.explain("rms_norm", x, w)
    rows = {r["name"]: r for r in e.impls}
    assert e.chosen == "quack" and e.source == "auto"
    assert rows["quack"]["rank"] == 5 and rows["quack"]["rank_reason"] == WHY
    assert rows["cuda_jit"]["rank_reason"] is None
    assert f"rank 5 for these arguments: {WHY}" in str(e)
    assert e.as_dict()["impls"][0]["name"] == "quack"  # listed in the order auto uses
    short = polykernel.explain("rms_norm", torch.randn(2, 8), torch.randn(8))
    assert {r["name"]: r["rank"] for r in short.impls}["quack"] == 50
    assert "for these arguments" not in str(short)


def test_rule_runs_on_the_memo_miss_only():
    fake("cuda_jit", 10)
    fake("quack", 50, rank_for=long_forward)
    call(32)
    seen = len(RULE_CALLS)
    assert seen >= 1
    for _ in range(5):
        call(32)
    assert len(RULE_CALLS) == seen  # memo hits never ask the rule again
    call(48)  # a new argument class: asked once more
    assert len(RULE_CALLS) > seen


def test_a_rule_cannot_make_an_excluded_impl_run():
    fake("cuda_jit", 10)
    fake("quack", 50, rank_for=long_forward, predicate=lambda c: "refuses everything (test)")
    assert call(32) == "cuda_jit"
    e = polykernel.explain("rms_norm", torch.randn(2, 32), torch.randn(32))
    assert {r["name"]: r["reason"] for r in e.impls}["quack"] == "refuses everything (test)"


def test_a_rule_that_raises_keeps_the_static_rank_and_says_so():
    def broken(c):
        raise KeyError("no such field")

    fake("cuda_jit", 10)
    fake("quack", 5, rank_for=broken)
    assert call(32) == "quack"  # static rank 5 still applies
    e = polykernel.explain("rms_norm", torch.randn(2, 32), torch.randn(32))
    row = {r["name"]: r for r in e.impls}["quack"]
    assert row["rank"] == 5 and row["runnable"]
    assert "rank_for raised KeyError" in row["rank_reason"]


def test_explicit_choices_come_before_the_rule():
    fake("cuda_jit", 10)
    fake("quack", 50, rank_for=long_forward)
    x, w = torch.randn(3, 32), torch.randn(32)
    polykernel.rms_norm(x, w, impl="cuda_jit")
    with polykernel.use_impl("cuda_jit"):
        polykernel.rms_norm(x, w)
    polykernel.set_impl("cuda_jit", op="rms_norm")
    try:
        polykernel.rms_norm(x, w)
    finally:
        polykernel.set_impl(None)
    assert CALLS == ["cuda_jit"] * 3


def test_a_tuned_decision_overrides_the_rule():
    fake("cuda_jit", 10)
    fake("quack", 50, rank_for=long_forward)
    only("cuda_jit", "quack")
    x, w = torch.randn(4, 32), torch.randn(32)
    op = registry.get_op("rms_norm")
    key = tuning_key.key(op, op.key(x, w), [x, w])
    tuning.store().put({key: {"eager": "cuda_jit", "graph": "cuda_jit", "times": {}}})
    polykernel.clear_caches()
    polykernel.rms_norm(x, w)
    assert CALLS == ["cuda_jit"]
    assert polykernel.decisions("rms_norm")[-1]["source"] == "tuned"


def test_available_impls_without_arguments_keeps_static_ranks():
    fake("cuda_jit", 10)
    fake("quack", 50, rank_for=long_forward)  # n is None here: the rule returns None
    names = polykernel.available_impls("rms_norm", device="cpu")
    assert names.index("cuda_jit") < names.index("quack")


def test_rank_here_and_spec_equality():
    spec = KernelSpec("norm.rms_norm", "quack", "m:f", rank=50, rank_for=lambda c: (3, "measured"))
    assert spec.rank_here(None) == (3, "measured")
    assert spec.rank == 50
    assert spec == KernelSpec("norm.rms_norm", "quack", "m:f", rank=50)  # rules are not identity


# -- the measured rules registered on the norms (H200, bf16, 2026-11-30) --------------------------


def rank_of(op_name, impl, n, dtype=torch.bfloat16, grad=False):
    """The rank ``impl`` gets for an (M, n) call, from the op's own argument class."""
    op = registry.get_op(op_name)
    x = torch.empty(2, n, dtype=dtype, device="meta", requires_grad=grad)
    w = torch.empty(n, dtype=dtype, device="meta", requires_grad=grad)
    return registry.specs_for(op)[impl].rank_here(op.arg_class(op.key(x, w)))


@pytest.mark.parametrize(
    ("n", "dtype", "grad", "rank"),
    [
        (32768, torch.bfloat16, False, 5),  # measured: 3.71 vs triton 2.84
        (262144, torch.float16, False, 5),  # 256K: 3.75 vs 2.61 (fp16: same bytes)
        (16384, torch.bfloat16, False, 50),  # a tie at <= 16K: Triton stays first
        (65536, torch.bfloat16, True, 50),  # with a backward Triton wins
        (65536, torch.float32, False, 50),  # fp32 unmeasured: static
    ],
)
def test_rms_norm_prefers_quack_for_long_forward_rows_only(n, dtype, grad, rank):
    got, why = rank_of("rms_norm", "quack", n, dtype, grad)
    assert got == rank
    assert (why is not None) == (rank == 5)
    triton = registry.specs_for("rms_norm")["triton"].rank
    assert (got < triton) == (rank == 5)
    assert rank_of("rms_norm", "cute_dsl", n, dtype, grad) == (40, None)  # by name only


@pytest.mark.parametrize(
    ("n", "grad", "preferred"),
    [
        (4096, False, True),  # fwd 3.79 vs 3.71 (small)
        (8192, False, True),
        (4096, True, False),  # fwd+bwd 2.87 vs 3.09: Triton
        (16384, True, True),  # fwd+bwd 2.16 vs 1.77
        (16384, False, False),  # fwd 2.44 vs 3.47: Triton
        (65536, False, False),  # fwd 1.50 vs 2.20
        (32768, True, False),  # unmeasured beyond 16K: static
    ],
)
def test_layer_norm_prefers_cute_dsl_where_measured(n, grad, preferred):
    got, why = rank_of("layer_norm", "cute_dsl", n, torch.bfloat16, grad)
    assert (got < registry.specs_for("layer_norm")["triton"].rank) == preferred
    assert (why is not None) == preferred
    if preferred:
        assert "H200" in why and "triton" in why
    assert rank_of("layer_norm", "cute_dsl", n, torch.float32, grad) == (40, None)


def test_explain_names_the_rule_even_where_the_impl_cannot_run_here():
    x, w = torch.randn(2, 32768, dtype=torch.bfloat16), torch.randn(32768, dtype=torch.bfloat16)
    text = str(polykernel.explain("rms_norm", x, w))
    assert "rank 5 for these arguments: forward only, N >= 32768" in text


def test_graph_rank_for_applies_to_calls_captured_in_a_cuda_graph_only():
    """A rank that rests on GPU time alone (``graph_rank_for``): asked before ``rank_for`` for a
    call made while a CUDA graph is captured, never for an eager one (which pays the launch)."""
    graph_why = "GPU time 3% lower (test)"
    spec = KernelSpec("norm.rms_norm", "quack", "m:f", rank=50, rank_for=long_forward, graph_rank_for=lambda c: (3, graph_why))
    the_op = registry.get_op("rms_norm")
    info = the_op.arg_class(the_op.key(torch.randn(2, 32), torch.randn(32)))
    assert spec.rank_here(info) == (5, WHY)  # eager: rank_for
    assert spec.rank_here(info, capturing=True) == (3, f"{graph_why} (in CUDA graphs)")
    plain = KernelSpec("norm.rms_norm", "quack", "m:f", rank=50, graph_rank_for=lambda c: None)
    assert plain.rank_here(info, capturing=True) == (50, None)  # no rule moved it
    broken = KernelSpec("norm.rms_norm", "quack", "m:f", rank=50, graph_rank_for=lambda c: 1 / 0)
    rank, why = broken.rank_here(info, capturing=True)
    assert rank == 50 and why.startswith("graph_rank_for raised ZeroDivisionError")


def test_explain_answers_for_a_captured_call_when_asked():
    polykernel.register_impl(
        op="rms_norm", backend="quack", rank=50, capabilities=frozenset({CapabilityRequirement.CUDA}),
        graph_rank_for=lambda c: (3, "GPU time (test)"),
    )(lambda x, weight, eps, offset, casting: x)  # fmt: skip
    ranks = {
        capturing: {r["name"]: r["rank"] for r in polykernel.explain("rms_norm", device="cuda", dtype="bf16", capturing=capturing).impls}
        for capturing in (False, True)
    }
    assert ranks[False]["quack"] == 50 and ranks[True]["quack"] == 3
    cpu = polykernel.explain("rms_norm", device="cpu", dtype="bf16", capturing=True).impls  # a CPU call is never captured
    assert {r["name"]: r["rank"] for r in cpu}["quack"] == 50
