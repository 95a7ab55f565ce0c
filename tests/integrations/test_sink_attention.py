"""Attention with sinks on the fused kernels (``integrations/transformers/_sinks.py``) against the
formula in float64: exact in float64 (the sink folded into the log-sum-exp changes no
arithmetic the fused backward does), within the 16-bit formats' rounding otherwise, under every
mask gpt_oss's layers get (causal, sliding window, left padding with rows that see no key), and
against transformers' own gpt_oss eager attention as the drop-in for it."""

from __future__ import annotations

import math

import pytest
import torch

from _spies import count_calls
from polykernel.integrations.transformers._sinks import sink_attention, sink_attention_forward

MASKS = ("none", "causal", "sliding", "left-padded")


def _mask(kind: str, b: int, lq: int, lk: int, dtype: torch.dtype, device: str) -> torch.Tensor | None:
    """transformers' eager mask of ``kind`` ([B, 1, Lq, Lk], 0 where a key is seen, the dtype's
    most negative value elsewhere), or None for the kernels' own causal mask."""
    if kind == "none":
        return None
    i, j = torch.arange(lq, device=device)[:, None], torch.arange(lk, device=device)[None, :]
    seen = (j <= i)[None, None].expand(b, 1, lq, lk).clone()
    if kind == "sliding":
        seen &= j > i - 5
    if kind == "left-padded":  # the second sequence starts at 7: its first 7 rows see no key at all
        seen[1, :, :, :7] = False
    return torch.zeros(b, 1, lq, lk, dtype=dtype, device=device).masked_fill(~seen, torch.finfo(dtype).min)


def _formula(q, k, v, sinks, mask, scale):
    """The definition, in float64: softmax over [scores, sink] per row, the sink's column dropped."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if mask is None:
        causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~causal, -math.inf)
    else:
        s = s + mask.double()
    sink = sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    return p @ v.double()


def _errors(dtype, kind, device, b=2, h=4, lq=37, d=16):
    """Each of out, dq, dk, dv, dsinks: the fused path's largest error against the formula on the
    same (rounded) inputs, relative to the formula's largest magnitude."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, lq, d, dtype=dtype, device=device, generator=gen).requires_grad_() for _ in range(3))
    sinks = torch.randn(h, dtype=dtype, device=device, generator=gen).requires_grad_()
    mask = _mask(kind, b, lq, lq, dtype, device)
    ours, ref = sink_attention(q, k, v, sinks, mask, d**-0.5), _formula(q, k, v, sinks, mask, d**-0.5)
    assert ours.dtype == dtype and ours.shape == ref.shape
    cot = torch.randn(ref.shape, dtype=torch.float64, device=device, generator=gen)
    got = (ours, *torch.autograd.grad(ours, (q, k, v, sinks), cot.to(dtype)))
    want = (ref, *torch.autograd.grad(ref, (q, k, v, sinks), cot))
    return [((a.double() - w).abs().max() / w.abs().max()).item() for a, w in zip(got, want)]


# relative to the largest value: float64 to its rounding; the 16-bit formats to a few units of their
# rounding (inputs exact in the format, fp32 arithmetic, the output and gradients rounded once, the
# fused backward's products of two rounded values), fp32 likewise
BOUND = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 4 * 2.0**-8, torch.float16: 4 * 2.0**-11}


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_matches_the_formula_cpu(dtype, kind):
    errors = _errors(dtype, kind, "cpu")
    assert max(errors) <= BOUND[dtype], dict(zip(("out", "dq", "dk", "dv", "dsinks"), errors))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ("causal", "sliding", "left-padded"))  # (CUDA: a mask always; None runs transformers')
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_formula_gpu(dtype, kind):
    # 300 rows: neither the bias's 16-element alignment nor the log-sum-exp's 32-row padding
    errors = _errors(dtype, kind, "cuda", b=2, h=8, lq=300, d=64)
    assert max(errors) <= BOUND[dtype], dict(zip(("out", "dq", "dk", "dv", "dsinks"), errors))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_mask_of_one_sequence_serves_the_batch(device):
    gen = torch.Generator(device=device).manual_seed(2)
    q, k, v = (torch.randn(3, 2, 21, 8, device=device, generator=gen) for _ in range(3))
    sinks = torch.randn(2, device=device, generator=gen)
    one = _mask("sliding", 1, 21, 21, torch.float32, device)
    torch.testing.assert_close(sink_attention(q, k, v, sinks, one, 0.3), sink_attention(q, k, v, sinks, one.expand(3, 1, 21, 21), 0.3))
    ref = _formula(q, k, v, sinks, one, 0.3)
    torch.testing.assert_close(
        sink_attention(q, k, v, sinks, one, 0.3).double(), ref, rtol=0, atol=BOUND[torch.float32] * ref.abs().max().item()
    )


def _gpt_oss_attention():
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    config = transformers.AutoConfig.for_model(
        "gpt_oss", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
        num_local_experts=2, num_experts_per_tok=1, intermediate_size=32, sliding_window=5, vocab_size=128,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = modeling.GptOssAttention(config, layer_idx=0).double()
    torch.nn.init.normal_(layer.sinks)
    return modeling, layer


@pytest.mark.parametrize("kind", ("causal", "sliding", "left-padded"))
def test_the_drop_in_matches_transformers_gpt_oss_eager_attention(kind):
    modeling, layer = _gpt_oss_attention()
    b, lq, d = 2, 23, layer.head_dim
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, 4, lq, d, dtype=torch.float64, generator=gen).requires_grad_()
    k, v = (torch.randn(b, 2, lq, d, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(2))
    mask = _mask(kind, b, lq, lq, torch.float64, "cpu")
    ours, none = sink_attention_forward(layer, q, k, v, mask, layer.scaling)
    theirs, _ = modeling.eager_attention_forward(layer, q, k, v, mask, layer.scaling)
    assert none is None and ours.shape == theirs.shape == (b, lq, 4, d)  # [B, L, H, D], as transformers' interfaces return
    cot = torch.randn(theirs.shape, dtype=torch.float64, generator=gen)
    inputs = (q, k, v, layer.sinks)
    for a, w in zip((ours, *torch.autograd.grad(ours, inputs, cot)), (theirs, *torch.autograd.grad(theirs, inputs, cot))):
        assert torch.allclose(a, w, rtol=0, atol=1e-12 * w.abs().max().item()), (a - w).abs().max()


def test_the_drop_in_declines_what_the_kernels_do_not_run():
    _, layer = _gpt_oss_attention()
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    layer = layer.float()
    assert sink_attention_forward(layer, q, k, v, None, 0.25, dropout=0.1) is None  # dropout: transformers' own
    del layer.sinks
    assert sink_attention_forward(layer, q, k, v, None, 0.25) is None  # no sinks: not gpt_oss's attention


# -- installed by patch: gpt_oss's attention ------------------------------------------------------
def _gpt_oss_model(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "gpt_oss", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
        num_local_experts=2, num_experts_per_tok=1, intermediate_size=32, sliding_window=5, vocab_size=128,
        layer_types=["sliding_attention", "full_attention"], attn_implementation="eager", experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks)
    return model


def _sink_calls(monkeypatch) -> list[int]:
    """Counts the fused path's calls (the patched attention reaches it through the module's global)."""
    from polykernel.integrations.transformers import _sinks

    return count_calls(monkeypatch, _sinks, "sink_attention")


def _step(model, ids, mask):
    """The logits (no labels: the patched loss returns none), then the loss and every gradient."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits, loss, grads


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "left-padded"])
def test_patch_runs_gpt_oss_attention_on_the_fused_kernels(monkeypatch, padded):
    """A patched gpt_oss model (float64) against the same model patched without its sinks
    attention (transformers' eager attention, the rest polykernel's as before): its loss, logits
    and every gradient (the sinks' included) agree to float64 roundoff, and every layer's
    attention ran the fused path (a sliding and a full layer; left padding with rows that see no
    key)."""
    from polykernel.integrations.transformers import patch, patched, unpatch

    model = _gpt_oss_model()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 19), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0
    patch(model, attention_sinks=False)
    want_logits, want_loss, want_grads = _step(model, ids, mask)
    calls = _sink_calls(monkeypatch)
    patch(model)
    assert patched(model)["attention_sinks"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert "rope" in patched(model)
    got_logits, got_loss, got_grads = _step(model, ids, mask)
    assert len(calls) == 4  # two forwards, both layers each
    keep = mask.bool()  # (the padded rows' logits are the model's business, not the attention's)
    torch.testing.assert_close(got_logits[keep], want_logits[keep], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-10, atol=1e-12)
    assert got_grads.keys() == want_grads.keys() and any("sinks" in n for n in got_grads)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-9, atol=1e-10 * (1 + g.abs().max().item()), msg=name)
    unpatch(model)
    assert "attention_sinks" not in patched(model)
    _step(model, ids, mask)
    assert len(calls) == 4  # unpatched: transformers' eager attention again


def test_the_switch_and_the_attention_weights(monkeypatch):
    """``attention_sinks=False`` leaves the eager attention (and rope still patched); with
    ``rope=False`` the attention is patched for its sinks alone; ``output_attentions=True`` runs
    the eager path, which returns the weights."""
    from polykernel.integrations.transformers import patch, patched

    model = _gpt_oss_model()
    ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(3))
    calls = _sink_calls(monkeypatch)
    patch(model, attention_sinks=False)
    assert "attention_sinks" not in patched(model) and len(patched(model)["rope"]) == 2
    model(input_ids=ids)
    assert not calls
    patch(model, rope=False)
    assert "rope" not in patched(model) and len(patched(model)["attention_sinks"]) == 2
    model(input_ids=ids)
    assert len(calls) == 2
    out = model(input_ids=ids, output_attentions=True)
    assert len(calls) == 2  # the weights asked for: eager
    assert len(out.attentions) == 2 and all(a is not None and a.shape == (1, 4, 11, 11) for a in out.attentions)


def test_patch_by_model_type_swaps_the_eager_attention(monkeypatch):
    from polykernel.integrations.transformers import patch, patched, unpatch

    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    original = modeling.eager_attention_forward
    calls = _sink_calls(monkeypatch)
    try:
        patch("gpt_oss")
        assert modeling.eager_attention_forward is not original
        assert any(n.endswith("eager_attention_forward") for n in patched("gpt_oss")["attention_sinks"])
        model = _gpt_oss_model()
        assert patched(model)["attention_sinks"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        model(input_ids=torch.randint(3, 128, (1, 7)))
        assert len(calls) == 2
        patch(model)  # an instance patch on top: the original eager attention underneath, once
        model(input_ids=torch.randint(3, 128, (1, 7)))
        assert len(calls) == 4
    finally:
        unpatch("gpt_oss")
    assert modeling.eager_attention_forward is original


def test_a_patched_gpt_oss_compiles_whole(monkeypatch):
    """torch.compile of the patched model (AOTAutograd, no Inductor: seconds on a CPU): no graph
    break in the forward, the loss and the sinks' gradients those of the patched model in eager."""
    import torch._dynamo

    from polykernel.integrations.transformers import patch

    model = patch(_gpt_oss_model().float())
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(4))

    def step(fn):
        model.zero_grad()
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [layer.self_attn.sinks.grad.clone() for layer in model.model.layers]

    want_loss, want_grads = step(model)
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(input_ids=ids, labels=ids).graph_break_count == 0
    calls = _sink_calls(monkeypatch)
    torch._dynamo.reset()
    got_loss, got_grads = step(torch.compile(model, backend="aot_eager"))
    assert calls  # traced through the fused path
    torch.testing.assert_close(got_loss, want_loss)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)
