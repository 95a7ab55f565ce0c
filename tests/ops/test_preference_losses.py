"""What the fused preference and RL losses (``fused_linear_{dpo,orpo,cpo,simpo,kto,grpo}_loss``) share:
the chunked driver (memory, one- and two-pass walks, layouts, autograd), checks across the losses,
and the public functions' signatures (each loss's own checks: tests/ops/test_fused_linear_<loss>_loss.py).
Against float64 formulas (tests/_preference_helpers.py), on every impl runnable on the CPU (Triton
through the interpreter), with chunks forced small."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import polykernel
from _matmul_helpers import Matmuls, assert_padded, assert_same, padded_then_plain
from _preference_helpers import (
    IMPLS,
    assert_grads,
    cpo_formula,
    dpo_formula,
    grpo_formula,
    head,
    kto_formula,
    orpo_formula,
    simpo_formula,
    small_chunks,  # noqa: F401  (autouse: small chunks in this module too)
    targets,
    token_logps,
)
from polykernel.backends import _linear_logps
from polykernel.core import registry
from polykernel.errors import ImplNotAvailableError


class _Made(TorchDispatchMode):
    """Records ``(storage bytes, dtype, shape)`` of every tensor made while active (``.made``)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[int, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, tuple | list) else (out,):
            if isinstance(x, torch.Tensor):
                self.made.append((x.untyped_storage().nbytes(), x.dtype, tuple(x.shape)))
        return out


def test_backward_twice_is_a_clear_error():
    hid, w, b = head(2, 3, 8, 20)
    out = polykernel.fused_linear_dpo_loss(hid, w, targets(2, 3, 20), b)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.loss.backward()


def test_chunk_size_comes_from_the_problem():
    assert _linear_logps.units_per_chunk(4, 2, 1024, 128256, 2, 1 << 30) == 1  # one pair of 1024-token rows
    assert _linear_logps.units_per_chunk(64, 1, 16, 1000, 2, 1 << 30) == 64  # all of a small batch
    assert _linear_logps.units_per_chunk(8, 1, 1024, 32000, 4, 1 << 30) == 4
    assert _linear_logps.units_per_chunk(8192, 1, 1, 128256, 2, 1 << 30) == 1280  # GRPO tokens: 1395 -> a multiple of 128


def test_no_chunk_holds_more_than_its_budget_of_logits(monkeypatch):
    """Never the [N, V] logits: every logits chunk the driver makes stays within the budget
    (whole pairs when one fits, else token chunks in two passes, or a pair's tokens in
    sub-chunks), and the result does not depend on the chunking."""
    seen = []
    real = _linear_logps._logits

    def spy(proj, hc, *args):
        seen.append(hc.shape[0])
        return real(proj, hc, *args)

    monkeypatch.setattr(_linear_logps, "_logits", spy)
    monkeypatch.setattr(_linear_logps, "SUB_BYTES", 4 * 300 * 4)  # fp32 logits of 4 tokens
    hid, w, b = head(8, 5, 8, 300)
    t = targets(8, 5, 300)
    results = []
    for budget, chunks in [
        (2 * 5 * 300 * 8, [10] * 4),  # one pair (2 rows x 5 tokens, fp32 logits + dlogits) per chunk
        (5 * 300 * 8, [5] * 8 * 2),  # one row's worth: token chunks of 5, both passes
        (1 << 30, [40]),  # everything at once
        ("unit", [4, 4, 2] * 4),  # a budget below one pair, the pair within UNIT_BYTES: one pass, its tokens 4 at a time
    ]:
        seen.clear()
        if budget == "unit":
            budget = 1
            monkeypatch.setattr(_linear_logps, "UNIT_BYTES", 1 << 20)
        monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", budget)
        out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl="torch")
        assert seen == chunks
        results.append((out.loss, *torch.autograd.grad(out.loss, (hid, w, b))))
    for other in results[1:]:
        for a, c in zip(results[0], other):
            torch.testing.assert_close(a, c)


LOSS_CALLS = {
    "dpo": lambda h, w, b, t, impl: polykernel.fused_linear_dpo_loss(h, w, t, b, compute_nll_loss=True, impl=impl),
    "orpo": lambda h, w, b, t, impl: polykernel.fused_linear_orpo_loss(h, w, t, b, impl=impl),
    "cpo": lambda h, w, b, t, impl: polykernel.fused_linear_cpo_loss(h, w, t, b, impl=impl),
    "simpo": lambda h, w, b, t, impl: polykernel.fused_linear_simpo_loss(h, w, t, b, impl=impl),
    "kto": lambda h, w, b, t, impl: polykernel.fused_linear_kto_loss(h, w, t, torch.tensor([True, False, True, False]), b, kl=0.2, impl=impl),
    "grpo-token": lambda h, w, b, t, impl: polykernel.fused_linear_grpo_loss(
        h, w, t.clamp(min=0), (t >= 0).long(), torch.tensor([1.0, -0.5, 0.3, 2.0]), b, ref_per_token_logps=-torch.ones(t.shape),
        old_per_token_logps=-torch.ones(t.shape), impl=impl,
    ),
    "grpo-seq": lambda h, w, b, t, impl: polykernel.fused_linear_grpo_loss(
        h, w, t.clamp(min=0), (t >= 0).long(), torch.tensor([1.0, -0.5, 0.3, 2.0]), b, beta=0.0,
        old_per_token_logps=-torch.ones(t.shape), importance_sampling_level="sequence", impl=impl,
    ),
}  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss", list(LOSS_CALLS))
def test_one_pass_and_two_pass_walks_agree(monkeypatch, impl, loss):
    """Whole units per chunk and token chunks (two passes) give the same loss and gradients."""
    hid, w, b = head(4, 6, 8, 50)
    t = targets(4, 6, 50)
    got = []
    for budget in (2 * 6 * 50 * 8, 5 * 50 * 8):  # a pair (two sequences) per chunk; 5 tokens per chunk
        monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", budget)
        out = LOSS_CALLS[loss](hid, w, b, t, impl)
        got.append((out.loss, *torch.autograd.grad(out.loss, (hid, w, b))))
    for a, c in zip(*got):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_inputs_and_partial_requires_grad(impl):
    hid = torch.randn(4, 5, 16)[:, :, ::2].requires_grad_()  # non-contiguous hidden
    w = torch.randn(20, 8)
    t = targets(4, 5, 20).t().contiguous().t()  # [4, 5] view of a transposed buffer
    wt = torch.randn(8, 20).t().requires_grad_(False)
    out = polykernel.fused_linear_dpo_loss(hid, wt, t, impl=impl)
    want = dpo_formula(hid, wt, None, t)
    torch.testing.assert_close(out.loss.double(), want[0].detach(), rtol=2e-5, atol=2e-5)
    (g,) = torch.autograd.grad(out.loss, hid)
    (gw,) = torch.autograd.grad(want[0], hid)
    torch.testing.assert_close(g.double(), gw.double(), rtol=1e-4, atol=1e-6)
    t_strided = targets(4, 10, 20)[:, ::2]  # flattens to a stride-2 view
    labels = torch.tensor([True, False, True, False])
    for ids in (t_strided, t_strided.to(torch.int32)):  # KTO: one slice of rows per chunk, so a view of target
        out = polykernel.fused_linear_kto_loss(hid, wt, ids, labels, impl=impl)
        torch.testing.assert_close(out.loss.double(), kto_formula(hid, wt, None, t_strided, labels)[0].detach(), rtol=2e-5, atol=2e-5)
    w.requires_grad_()  # weight only
    out = polykernel.fused_linear_dpo_loss(hid.detach(), w, t, impl=impl)
    out.loss.backward()
    assert w.grad is not None and w.grad.shape == w.shape


def test_double_backward_is_refused():
    hid, w, b = head(2, 3, 8, 20)
    out = polykernel.fused_linear_dpo_loss(hid, w, targets(2, 3, 20), b)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(out.loss, hid, create_graph=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t_len", [0, 1])
def test_empty_and_single_token_sequences(impl, t_len):
    hid, w, b = head(4, t_len, 8, 20)
    t = targets(4, t_len, 20, ignored=0.0)
    out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl=impl)
    want = dpo_formula(hid, w, b, t)
    torch.testing.assert_close(out.loss.double(), want[0].detach(), rtol=2e-5, atol=2e-5)
    out.loss.backward()
    assert hid.grad.shape == hid.shape and torch.isfinite(w.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "torch", "liger"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_dpo_and_grpo_match_the_float64_formulas(impl, dtype, monkeypatch):
    monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", 256 << 20)  # several chunks at this size
    r, t, h, v = 8, 256, 512, 32000
    hid = torch.randn(r, t, h, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(v, h, device="cuda") * 2 / h**0.5).to(dtype).requires_grad_()
    tg = torch.randint(0, v, (r, t), device="cuda").masked_fill(torch.rand(r, t, device="cuda") < 0.1, -100)
    rtol = 1e-4
    if impl == "liger" and dtype != torch.float32:
        # liger rounds its logits to bf16 before the log-softmax (ours are fp32 GEMM outputs): its
        # 16-bit statistics missed the error model (on the CPU, 2026-12-05): refused
        with pytest.raises(ImplNotAvailableError, match="float32 only"):
            polykernel.fused_linear_dpo_loss(hid, w, tg, impl=impl, compute_nll_loss=True)
    else:
        out = polykernel.fused_linear_dpo_loss(hid, w, tg, impl=impl, compute_nll_loss=True)
        want = dpo_formula(hid, w, None, tg, nll=True)
        torch.testing.assert_close(out.loss.double(), want[0].detach(), rtol=rtol, atol=rtol)
        assert_grads(out.loss, want[0], (hid, w), torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    ids, mask, adv = (
        torch.randint(0, v, (r, t), device="cuda"),
        (torch.rand(r, t, device="cuda") > 0.1).long(),
        torch.randn(r, device="cuda"),
    )
    with torch.no_grad():
        lp, _ = token_logps(hid, w, None, ids, ignore=-(10**9))
    old, ref = (lp + 0.1 * torch.randn_like(lp)).float(), (lp + 0.1 * torch.randn_like(lp)).float()
    if impl == "liger" and dtype != torch.float32:  # its 16-bit gradients missed the error model here
        with pytest.raises(ImplNotAvailableError, match="float32 only"):
            polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old, impl=impl)
        return
    out = polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old, impl=impl)
    want = grpo_formula(hid, w, None, ids, mask, adv, ref=ref, old=old)
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=rtol, atol=rtol)
    assert_grads(out.loss, want, (hid, w), torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)


@settings(max_examples=10, deadline=None)
@given(
    b=st.integers(1, 3), t=st.integers(1, 8), v=st.integers(2, 60), impl=st.sampled_from(IMPLS),  # (V = 1: ORPO log1p(-1))
    name=st.sampled_from(["orpo", "cpo", "simpo", "kto"]), ignored=st.sampled_from([0.0, 0.3]),
)  # fmt: skip
def test_pairwise_and_kto_hypothesis_shapes(b, t, v, impl, name, ignored):
    hid, w, bias = head(2 * b, t, 8, v)
    tg = targets(2 * b, t, v, ignored=ignored)
    tg[:, 0] = torch.randint(0, v, (2 * b,))  # every row scores a token: the average log-probs stay finite
    if name == "kto":
        labels = torch.rand(2 * b) > 0.5
        out = polykernel.fused_linear_kto_loss(hid, w, tg, labels, bias, kl=0.1, impl=impl)
        want = kto_formula(hid, w, bias, tg, labels, kl=0.1)[0]
    else:
        fn, formula = {"orpo": ("fused_linear_orpo_loss", orpo_formula), "cpo": ("fused_linear_cpo_loss", cpo_formula),
                       "simpo": ("fused_linear_simpo_loss", simpo_formula)}[name]  # fmt: skip
        out = getattr(polykernel, fn)(hid, w, tg, bias, impl=impl)
        want = formula(hid, w, bias, tg)[0]
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=2e-5, atol=2e-5)
    assert_grads(out.loss, want, (hid, w, bias), torch.float32)


@pytest.mark.parametrize("name", ["dpo", "orpo", "cpo", "simpo", "kto", "grpo"])
def test_public_function_states_the_references_arguments(name):
    # the public function (options keyword-only) and the reference (all positional, the Op's
    # order) each state the arguments and their defaults: they must agree, or a default call
    # would run other options than the reference, explain and the argument class assume
    import inspect

    op = registry.get_op(f"fused_linear_{name}_loss")
    public = inspect.signature(getattr(polykernel, f"fused_linear_{name}_loss")).parameters
    ref = inspect.signature(op.reference).parameters
    assert [n for n in public if n != "impl"] == list(ref)
    assert {n: p.default for n, p in public.items() if n != "impl"} == {n: p.default for n, p in ref.items()}
    assert op.fields == ("device", "dtype", "needs_grad", *ref)  # pref.op_fields: the class names every argument


# -- the float64 reference and the error model hold row blocks, never the [N, V] logits ---------------


def test_reference_logps_in_row_blocks_equal_the_whole_logits(monkeypatch):
    """The float64 reference computed over blocks of 3 rows (the backward recomputing each block's
    softmax) equals log_softmax of the whole logits, values and gradients, with a temperature,
    ignored tokens and a bias."""
    from polykernel.ops import _preference_reference as pref

    torch.manual_seed(0)
    hid, w, b = (t.double().detach().requires_grad_() for t in head(2, 5, 8, 23))
    tg = targets(2, 5, 23)
    monkeypatch.setattr(pref, "REFERENCE_VOCAB_BLOCK", 7)  # 4 blocks, the last of 2
    monkeypatch.setattr(pref, "REFERENCE_ROWS_ELEMENTS", 3 * 7)  # 3 rows a block
    got = pref.reference_token_logps(hid, w, b, tg, -100, 0.7)
    cot = torch.randn_like(got)
    g_got = torch.autograd.grad(got, [hid, w, b], cot)
    z = torch.nn.functional.linear(hid, w, b) / 0.7
    valid = tg != -100
    want = torch.where(valid, z.log_softmax(-1).gather(-1, torch.where(valid, tg, 0)[..., None]).squeeze(-1), 0.0)
    g_want = torch.autograd.grad(want, [hid, w, b], cot)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, e in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["fused_linear_dpo_loss", "fused_linear_grpo_loss"])
def test_error_model_never_holds_the_whole_logits(monkeypatch, name):
    """The first-call check's error model at a batch whose float64 logits are 40x a block: no
    tensor it makes is near the [N, V] logits' size nor a float64 copy of the weight (on the
    H200, a TRL DPO step's check made the logits, and peaked at 2.5x the step's memory), and its
    bounds are those of one whole block."""
    from polykernel.ops import _preference_reference as pref

    op = registry.get_op(name)
    case = op.example((4, 40, 16, 512), torch.float32, "cpu", True)
    n_logits = 4 * 40 * 512

    whole = op.error_model(*case.args, **case.kwargs)
    monkeypatch.setattr(pref, "REFERENCE_VOCAB_BLOCK", 128)
    monkeypatch.setattr(pref, "REFERENCE_ROWS_ELEMENTS", n_logits // 40)
    with _Made() as rec:
        blocks = op.error_model(*case.args, **case.kwargs)
    weight = case.args[1]
    most = max((math.prod(shape) for _, dtype, shape in rec.made if dtype == torch.float64), default=0)
    assert most < weight.numel(), f"{name}'s error model made a float64 tensor of {most} elements ({n_logits} logits)"
    for a, e in zip(whole.grads.values(), blocks.grads.values(), strict=True):
        assert a.scale == pytest.approx(e.scale, rel=1e-9) and a.cancel == pytest.approx(e.cancel, rel=1e-9)
    for a, e in zip(whole.outputs, blocks.outputs, strict=True):
        assert a.cancel == pytest.approx(e.cancel, rel=1e-9)


# -- one unit over the chunk budget: its logits in sub-chunks, G = softmax − onehot kept ----------------

KEPT_V = 40


def _kept(monkeypatch, on: bool) -> None:
    """``on``: a chunk budget below one unit (the driver's and the error model's), units within
    UNIT_BYTES, sub-chunks of 3 tokens: every unit takes the kept-G walk. Off: everything in one
    chunk, the walk without sub-chunks."""
    from polykernel.ops import _preference

    budget = 1 if on else 1 << 30
    monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", budget)
    monkeypatch.setattr(_preference, "CHUNK_BYTES", budget)
    monkeypatch.setattr(_linear_logps, "UNIT_BYTES", 1 << 30)
    monkeypatch.setattr(_linear_logps, "SUB_BYTES", 3 * KEPT_V * 4)


def _kept_case(loss: str, dtype: torch.dtype):
    """``(op name, args, kwargs)``: a call whose units are several sub-chunks long, with a bias and
    ignored tokens (DPO with a reference head and the NLL term, KTO) or a temperature (GRPO's
    sequence-level ratios: its units are sequences)."""
    torch.manual_seed(3)
    hid, w, b = head(4, 7, 16, KEPT_V, dtype=dtype)
    t = targets(4, 7, KEPT_V, ignored=0.25)
    t[:, 0] = torch.randint(0, KEPT_V, (4,))
    if loss == "dpo":
        rh, rw, rb = (x.detach() for x in head(4, 7, 16, KEPT_V, dtype=dtype))
        kw = {"ref_hidden": rh, "ref_weight": rw, "ref_bias": rb, "beta": 0.5, "compute_nll_loss": True}
        return "fused_linear_dpo_loss", (hid, w, t, b), kw
    if loss == "kto":
        return "fused_linear_kto_loss", (hid, w, t, torch.tensor([True, False, False, True]), b), {"kl": 0.1, "beta": 0.5}
    mask = (t >= 0).long()
    ref, old = -3 + torch.randn(4, 7), -3 + 0.1 * torch.randn(4, 7)
    kw = {"ref_per_token_logps": ref, "old_per_token_logps": old, "importance_sampling_level": "sequence", "temperature": 0.7}
    return "fused_linear_grpo_loss", (hid, w, t.clamp(min=0), mask, torch.tensor([1.0, -0.5, 0.3, 2.0]), b), kw


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("loss", ["dpo", "kto", "grpo"])
def test_kept_walk_matches_the_one_chunk_walk_and_the_float64_reference(monkeypatch, impl, dtype, loss):
    """A unit over the chunk budget (sub-chunks of its logits, G kept in the inputs' dtype, the
    slope applied to the [rows, H] operands): the same loss, statistics and gradients (hidden,
    weight, bias) as the whole batch in one chunk, and within the op's error model of the
    float64 reference (which counts the path's extra rounding). fp16: the reference only (KTO's
    saturated gradients here are ~3e-7, in fp16's subnormals on either walk)."""
    from polykernel.core.op import Case
    from polykernel.testing import check_parity

    name, args, kw = _kept_case(loss, dtype)
    fn = getattr(polykernel, name)
    params = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    got = []
    for on in (False, True):
        _kept(monkeypatch, on)
        out = fn(*args, **kw, impl=impl)
        got.append([*(o for o in out if isinstance(o, torch.Tensor)), *torch.autograd.grad(out.loss, params)])
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2e-2, 1e-2)
    for a, c in zip(*got, strict=True):
        scale = c.double().abs().max().clamp(min=1e-30)
        if dtype != torch.float16:
            torch.testing.assert_close(a.double() / scale, c.double() / scale, rtol=rtol, atol=atol, equal_nan=True)
    (result,) = check_parity(name, [impl], dtypes=[dtype], cases=[Case(loss, args, kw)])
    assert result.ok, str(result)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kept_walk_with_ignored_tokens_a_bias_and_a_temperature(monkeypatch, impl, dtype):
    """The driver itself (the op files pass a temperature without ignored tokens, or the reverse):
    pairs with ignored tokens, a bias and temperature 0.6, the kept walk against one chunk and the
    float64 log-probs; an ignored token's slope is NaN here and its gradient still 0."""
    prim = _linear_logps_prim(impl)
    torch.manual_seed(5)
    hid, w, b = head(4, 7, 16, KEPT_V, dtype=dtype)
    t = targets(4, 7, KEPT_V, ignored=0.3)
    t[:, 0] = 1
    wts = torch.randn(4, 7, dtype=torch.float64)

    def contrib(lp, m, c):  # a smooth per-pair term, NaN slope on ignored tokens
        x = lp / m.double() * c  # an ignored token: 0/0, its slope 0/0
        y = torch.where(m, x, 0.0).sum(-1)
        k = y.shape[0] // 2  # the chunk's rows: its chosen, then its rejected
        return torch.nn.functional.softplus(y[:k] - y[k:])

    got = []
    for on in (False, True):
        _kept(monkeypatch, on)
        loss, lp = _linear_logps.run(prim, hid, w, b, t, -100, 0.6, True, contrib, (t != -100, wts))
        got.append([loss, lp, *torch.autograd.grad(loss, (hid, w, b))])
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2e-2, 1e-2)
    for a, c in zip(*got, strict=True):
        assert torch.isfinite(a).all()
        scale = c.double().abs().max().clamp(min=1e-30)
        torch.testing.assert_close(a.double() / scale, c.double() / scale, rtol=rtol, atol=atol)
    want, _ = token_logps(hid, w, b, t, temperature=0.6)
    torch.testing.assert_close(got[1][1].double(), want, rtol=1e-4 if dtype == torch.float32 else 1e-3, atol=1e-4)
    exact = [x.detach().double().requires_grad_() for x in (hid, w, b)]
    lp64, _ = token_logps(*exact, t, temperature=0.6)
    g64 = torch.autograd.grad(contrib(lp64, t != -100, wts).sum(), exact)
    for a, c in zip(got[1][2:], g64, strict=True):
        scale = c.abs().max()
        torch.testing.assert_close(a.double() / scale, c / scale, rtol=rtol, atol=1e-4 if dtype == torch.float32 else 2e-2)


def _linear_logps_prim(impl: str):
    if impl == "triton":
        from polykernel.backends.triton import _token_logps
    else:
        from polykernel.backends import _token_logps
    return _token_logps


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_16bit_unit_alone_in_its_chunk_keeps_g(monkeypatch, impl, dtype):
    """A unit within the budget but alone in its chunk (KTO's 1024-token sequence at V = 128K:
    0.79 GB of fp32 logits and bf16 dlogits in one pass, 8 MiB above Liger's peak on the H200)
    takes the kept walk in 16 bits once its fp32 logits exceed SUB_BYTES: its logits come
    sub-chunk by sub-chunk, the largest tensor is its G, and the loss and gradients match the
    one-pass walk's and the float64 reference (the error model counts the rounding). fp32: one
    pass (its dlogits overwrite its logits: nothing to save)."""
    from polykernel.core.op import Case
    from polykernel.ops import _preference
    from polykernel.testing import check_parity

    r, t, v = 4, 32, 512
    hid, w, b = head(r, t, 8, v, dtype=dtype)
    tg = targets(r, t, v)
    desirable = torch.tensor([True, False, True, False])
    call = lambda: polykernel.fused_linear_kto_loss(hid, w, tg, desirable, b, impl=impl, beta=0.5)
    grads = lambda out: torch.autograd.grad(out.loss, (hid, w, b))
    call().loss.backward()  # the first call's checks, outside
    budget = _preference.unit_bytes(1, t, v, hid.element_size()) + 1  # one sequence per chunk
    for mod in (_linear_logps, _preference):
        monkeypatch.setattr(mod, "CHUNK_BYTES", budget)
        monkeypatch.setattr(mod, "SUB_BYTES", 1 << 40)  # first: no unit's logits over it, one pass
    one_pass = call()
    want = [one_pass.loss, *grads(one_pass)]
    for mod in (_linear_logps, _preference):
        monkeypatch.setattr(mod, "SUB_BYTES", 8 * v * 4)  # fp32 logits of 8 tokens
    seen: list[int] = []
    real = _linear_logps._logits
    monkeypatch.setattr(_linear_logps, "_logits", lambda proj, hc, *a: (seen.append(hc.shape[0]), real(proj, hc, *a))[1])
    with _Made() as rec:
        out = call()
        got = [out.loss, *grads(out)]
    if dtype == torch.float32:
        assert seen == [t] * r  # one pass per sequence
        return
    assert seen == [8] * (r * t // 8)  # each sequence's logits 8 tokens at a time
    top = max(rec.made, key=lambda m: m[0])
    assert top == (t * v * 2, torch.bfloat16, (t, v)), top  # a sequence's G, bf16
    assert max(n for n, d, _ in rec.made if d == torch.float32) <= max(8 * v * 4, v * 8 * 4)
    for a, c in zip(got, want, strict=True):
        scale = c.double().abs().max().clamp(min=1e-30)
        torch.testing.assert_close(a.double() / scale, c.double() / scale, rtol=2e-2, atol=1e-2)
    (result,) = check_parity(
        "fused_linear_kto_loss", [impl], dtypes=[dtype], cases=[Case("kto", (hid, w, tg, desirable, b), {"beta": 0.5})]
    )
    assert result.ok, str(result)


@pytest.mark.parametrize("impl", IMPLS)
def test_kept_walk_holds_no_fp32_logits_of_a_whole_unit(monkeypatch, impl):
    """The largest tensor the kept walk makes (forward and backward, bf16) is the unit's G in
    bf16: no fp32 [rows, V] logits of the unit nor a second [rows, V] buffer (the one-pass walk
    held the pair's fp32 logits and bf16 dlogits: 1.58 GB for 2 x 1024 tokens at V = 128K)."""
    r, t, v = 4, 32, 512
    hid, w, b = head(r, t, 8, v, dtype=torch.bfloat16)
    tg = targets(r, t, v)
    polykernel.fused_linear_dpo_loss(hid, w, tg, b, impl=impl).loss.backward()  # the first call's checks, outside
    monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", 1)
    monkeypatch.setattr(_linear_logps, "UNIT_BYTES", 1 << 30)
    monkeypatch.setattr(_linear_logps, "SUB_BYTES", 8 * v * 4)  # fp32 logits of 8 tokens
    with _Made() as rec:
        out = polykernel.fused_linear_dpo_loss(hid, w, tg, b, impl=impl)
        out.loss.backward()
    top = max(rec.made, key=lambda m: m[0])
    assert top == (2 * t * v * 2, torch.bfloat16, (2 * t, v)), top  # a pair's G, bf16
    assert max(n for n, d, _ in rec.made if d == torch.float32) <= max(8 * v * 4, v * 8 * 4), "fp32: a sub-chunk or the CPU's fp32 weight"


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_kept_walk_matches_the_formula_within_less_memory(monkeypatch, impl, dtype):
    """On CUDA (the fp32-output GEMM, the Triton kernels themselves): pairs over the chunk budget
    match the float64 DPO formula, and the call's peak is the gradients plus well under a pair's
    fp32 logits and dlogits (what the one-pass walk held: bf16 G plus a sub-chunk now)."""
    from polykernel.ops import _preference

    r, t, h, v = 4, 512, 512, 32000
    monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", 64 << 20)  # below one pair (2 x 512 tokens: 197 MB at bf16)
    monkeypatch.setattr(_preference, "CHUNK_BYTES", 64 << 20)
    monkeypatch.setattr(_linear_logps, "UNIT_BYTES", 4 << 30)
    monkeypatch.setattr(_linear_logps, "SUB_BYTES", 16 << 20)  # 128 tokens of fp32 logits
    hid = torch.randn(r, t, h, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(v, h, device="cuda") * 2 / h**0.5).to(dtype).requires_grad_()
    tg = torch.randint(0, v, (r, t), device="cuda").masked_fill(torch.rand(r, t, device="cuda") < 0.1, -100)
    call = lambda: polykernel.fused_linear_dpo_loss(hid, w, tg, impl=impl, compute_nll_loss=True)
    torch.autograd.grad(call().loss, (hid, w))  # the first call's checks (per argument class), outside
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    grads = torch.autograd.grad(out.loss, (hid, w))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    elt = hid.element_size()
    held = (w.numel() + hid.numel()) * elt  # the gradients
    assert peak < held + 2 * t * v * (4 + elt) * 3 // 4, (peak, held)
    want = dpo_formula(hid, w, None, tg, nll=True)
    torch.testing.assert_close(out.loss.double(), want[0].detach(), rtol=1e-4, atol=1e-4)
    g64 = torch.autograd.grad(want[0], (hid, w))
    rtol, atol = (2e-5, 2e-4) if dtype == torch.float32 else (2e-2, 5e-2)
    for a, c in zip(grads, g64, strict=True):
        c = c.double()  # the formula's gradient comes back in the inputs' dtype
        scale = c.abs().max().clamp(min=1e-30)
        torch.testing.assert_close(a.double() / scale, c / scale, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["fused_linear_grpo_loss", "fused_linear_dpo_loss"])
def test_one_decision_across_batch_and_sequence_lengths(name):
    # GRPO's completions and DPO's pairs change length every step: one argument class (device,
    # dtype, the head's widths, options), not one per (B, T). Was: a decision per shape, so on
    # CUDA every new length ran the first-use check (a whole torch-impl loss on copies) again.
    from polykernel.core import registry

    op_id = registry.get_op(name).id
    polykernel.clear_caches()
    for r, t in [(4, 5), (4, 9), (6, 7), (2, 3)]:
        hid, w, b = head(r, t, 16, 40)
        tg = targets(r, t, 40)
        if name == "fused_linear_grpo_loss":
            out = polykernel.fused_linear_grpo_loss(hid, w, tg.clamp(min=0), (tg != -100).long(), torch.randn(r), b, beta=0.0, impl="torch")
        else:
            out = polykernel.fused_linear_dpo_loss(hid, w, tg, b, impl="torch")
        out.loss.backward()
    made = [d for d in polykernel.decisions() if d["op"] == op_id]
    assert len(made) == 1, made


@pytest.mark.parametrize("name", ["fused_linear_orpo_loss", "fused_linear_cpo_loss", "fused_linear_simpo_loss"])
def test_liger_pairwise_losses_are_refused_in_16_bit(name):
    # The H200 under CUDA autocast (2026-12-05): Liger's ORPO, CPO and SimPO on bf16 heads missed the
    # error model 1.75-4.13x (benchmarks/results/h200-2026-12-05-eleventh/autocast_gpu.log): its
    # predicate refuses 16-bit arguments, as for its GRPO, and takes fp32 ones.
    import types

    from polykernel.backends.liger import _gates
    from polykernel.backends.liger.manifest import IMPLS

    gate = getattr(_gates, name)
    assert IMPLS[f"loss.{name}"].predicate is gate
    cls = lambda dtype: types.SimpleNamespace(dtype=dtype, compute_nll_loss=True, alpha=1.0)  # the options reporting the NLL
    for dtype in (torch.bfloat16, torch.float16):
        assert "float32 only" in gate(cls(dtype))
    assert gate(cls(torch.float32)) is None


# -- the head padded to 16 bytes for the matmuls (core/aligned_head.py) -----------------------------

PAD_V = 43  # a multiple of neither 8 (16-bit) nor 4 (fp32)


def _walk_mode(monkeypatch, mode: str) -> None:
    """``one-pass``: whole units per chunk; ``two-pass``: token chunks; ``kept``: one unit per
    chunk in sub-chunks of 3 tokens, G kept."""
    from polykernel.ops import _preference

    if mode == "kept":
        _kept(monkeypatch, True)
        monkeypatch.setattr(_linear_logps, "SUB_BYTES", 3 * PAD_V * 4)
        return
    budget = 1 << 30 if mode == "one-pass" else 5 * PAD_V * 8
    monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", budget)
    monkeypatch.setattr(_preference, "CHUNK_BYTES", budget)
    monkeypatch.setattr(_linear_logps, "UNIT_BYTES", 1 << 30 if mode == "one-pass" else 0)


def _padded_and_plain(monkeypatch, impl, dtype, loss, inf_row: bool):
    """The loss and its gradients (hidden, weight, bias) with the head padded, then on the head as
    it is, and the padded walk's matmuls."""
    torch.manual_seed(7)
    hid, w, b = (x.detach() for x in head(4, 6, 8, PAD_V, dtype=dtype))
    t = targets(4, 6, PAD_V)
    if inf_row:  # a non-finite hidden state at an ignored token: its logits past V are NaN (inf * 0)
        hid[1, 2, 3] = float("inf")
        t[1, 2] = -100

    calls = []

    def run():
        xs = [x.clone().requires_grad_() for x in (hid, w, b)]
        with Matmuls() as rec:
            out = LOSS_CALLS[loss](*xs, t, impl)
            grads = torch.autograd.grad(out.loss, xs)
        calls.append(rec.calls)
        return (out.loss, *grads)

    padded, plain = padded_then_plain(monkeypatch, _linear_logps, run)
    return padded, plain, calls[0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["one-pass", "two-pass", "kept"])
@pytest.mark.parametrize("dtype, per", [(torch.bfloat16, 8), (torch.float32, 4)], ids=str)
def test_matmuls_run_on_a_head_padded_to_16_bytes(monkeypatch, impl, mode, dtype, per):
    """An odd vocabulary put cuBLAS on its 1-element-aligned kernels (the fused linear
    cross-entropy's, h100-2026-12-06-twentyfirst): in each walk every matmul sees the head's
    classes padded to 16 bytes, and the loss and gradients are the unpadded walk's."""
    _walk_mode(monkeypatch, mode)
    padded, plain, calls = _padded_and_plain(monkeypatch, impl, dtype, "dpo", inf_row=False)
    assert_padded(calls, PAD_V, per)
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2e-2, 1e-2)
    assert_same(padded, plain, rtol=rtol, atol=atol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["one-pass", "two-pass", "kept"])
def test_padding_the_head_changes_nothing_for_a_non_finite_row(monkeypatch, impl, mode):
    """The padded classes add exact zeros, also where a hidden state is infinite (its logits past
    V are NaN, cleared before the gradient matmuls): NaNs in the same places as the unpadded walk."""
    _walk_mode(monkeypatch, mode)
    padded, plain, _ = _padded_and_plain(monkeypatch, impl, torch.float32, "grpo-seq", inf_row=True)
    assert_same(padded, plain, rtol=1e-5, atol=1e-6)
