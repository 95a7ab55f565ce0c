"""``patch(model)`` and ``patch(model, mode="inference")`` under Hugging Face ``generate()``'s
strategies, against the same model unpatched: beam search (the cache reordered between steps),
seeded sampling, assisted and prompt-lookup decoding (several new tokens at once, then the cache
cropped), left-padded batches, per-layer outputs, chained calls on a returned cache, a cropped
cache reused, and an ``inputs_embeds`` prefix. fp32 on the CPU: the tokens are the same and the
logits agree to fp32 roundoff (the serving norms round once).

(Greedy decoding on static and dynamic caches, sliding windows, padding and compile are in
test_inference.py and test_inference_compile.py.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import polykernel  # noqa: E402
from _spies import count_calls  # noqa: E402
from polykernel import env  # noqa: E402
from polykernel.integrations.transformers import patch, patched  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

VOCAB, HIDDEN = 96, 64
TOL = dict(rtol=1e-5, atol=1e-5)

# (patch mode, family): inference mode takes Llama; the default mode, these three
CASES = [("inference", "llama"), ("default", "llama"), ("default", "qwen3"), ("default", "gemma2")]
CACHES = ["dynamic", "static"]


def tiny(family: str, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4)
    kw.update(num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    if family == "llama":
        config, cls = transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
    elif family == "qwen3":
        config, cls = transformers.Qwen3Config(**kw, head_dim=16), transformers.Qwen3ForCausalLM
    else:  # a sliding window shorter than prompt + generation
        config, cls = transformers.Gemma2Config(**kw, head_dim=16, sliding_window=8), transformers.Gemma2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # norms off their init of ones, weights large enough for spread-out logits
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p)) if p.dim() == 1 else p.mul_(2.0)
    return model


def pair(mode: str, family: str, **kw: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    ref = tiny(family, **kw)
    model = patch(copy.deepcopy(ref), **({"mode": "inference"} if mode == "inference" else {}))
    assert patched(model)
    return ref, model


def prompt(batch: int = 2, tokens: int = 5, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _torch_impls():
    """The dispatched ops on their torch impls: what is checked is the patched forwards' wiring
    through generate (the ops' impls have their own parity tests; the interpreter is slow)."""
    with polykernel.use_impl("torch"):
        yield


# these CPU models take the fused path (a Triton kernel) only in Triton's interpreter, which conftest
# turns on where no GPU is: on a GPU machine they run transformers' attention, as they should there
FUSED_ON_CPU = env.triton_interpret()


@pytest.fixture
def fused(monkeypatch) -> list[int]:
    """Counts the inference mode's fused RoPE + static-cache writes (so a static-cache case is
    known to have run them)."""
    from polykernel.integrations.transformers import _fused_attention

    return count_calls(monkeypatch, _fused_attention, "_rope_kv_write")


def generated(model: torch.nn.Module, ids: torch.Tensor | None = None, **kw: Any) -> dict[str, Any]:
    """One ``generate`` call (the global RNG seeded, for sampling), its outputs as a dict."""
    torch.manual_seed(1234)
    with torch.no_grad():
        out = model.generate(ids, return_dict_in_generate=True, output_logits=True, output_scores=True, pad_token_id=0, **kw)
    got = {"sequences": out.sequences, "logits": torch.stack(out.logits), "scores": torch.stack(out.scores)}
    for key in ("sequences_scores", "beam_indices", "hidden_states", "attentions", "past_key_values"):
        if getattr(out, key, None) is not None:
            got[key] = getattr(out, key)
    return got


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Token ids (and beam indices) equal; floats close; tuples, dicts and caches item by item."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, transformers.Cache):
        assert_same(_cache_contents(got), _cache_contents(want), where)
    elif want.dtype.is_floating_point:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{where}: {m}")
    else:
        assert torch.equal(got, want), where


def _cache_contents(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values up to its length (a static layer's stale tail is no state)."""
    out = []
    for layer in cache.layers:
        n = int(layer.get_seq_length())
        if not layer.is_sliding:  # (a sliding layer's keys are a window, in its own order)
            out.append((layer.keys[..., :n, :], layer.values[..., :n, :]))
    return out


def compare(mode: str, family: str, run: Callable[[torch.nn.Module], Any], fused: list[int], cache: str) -> None:
    ref, model = pair(mode, family)
    want = run(ref)
    assert fused == []
    assert_same(run(model), want)
    if mode == "inference":  # the fused RoPE + cache write on a static cache, transformers' attention on a dynamic one
        assert bool(fused) == (cache == "static" and FUSED_ON_CPU)


def static(cache: str) -> dict[str, str]:
    return {"cache_implementation": "static"} if cache == "static" else {}


# -- beam search: the cache reordered between steps ---------------------------------------------
BEAMS = {
    "early_stopping": dict(num_beams=3, early_stopping=True, num_return_sequences=2),
    "never": dict(num_beams=3, early_stopping="never", num_return_sequences=3, length_penalty=-0.5),
    "sampled": dict(num_beams=3, do_sample=True, top_k=20, num_return_sequences=2),
}


@pytest.mark.parametrize("beams", list(BEAMS))
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(("mode", "family"), CASES)
def test_beam_search(mode, family, cache, beams, fused):
    kw = {"max_new_tokens": 5, "do_sample": False, **BEAMS[beams], **static(cache)}
    compare(mode, family, lambda m: generated(m, prompt(), **kw), fused, cache)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(("mode", "family"), CASES)
def test_beam_search_on_left_padded_prompts(mode, family, cache, fused):
    ids = prompt(2, 6)
    mask = torch.ones_like(ids)
    for row, pad in ((0, 3),):
        ids[row, :pad], mask[row, :pad] = 0, 0
    kw = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False, **static(cache))
    compare(mode, family, lambda m: generated(m, ids, attention_mask=mask, **kw), fused, cache)


# -- sampling with a fixed seed -------------------------------------------------------------------
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(("mode", "family"), CASES)
def test_seeded_sampling_with_repetition_penalty(mode, family, cache, fused):
    kw = dict(max_new_tokens=5, do_sample=True, top_k=10, top_p=0.9, temperature=0.7, repetition_penalty=1.3)
    kw.update(num_return_sequences=2, **static(cache))
    compare(mode, family, lambda m: generated(m, prompt(), **kw), fused, cache)


# -- assisted and prompt-lookup decoding: several tokens a forward, then the cache cropped ----------
def _speculative(cache: str, **kw: Any) -> Callable[[torch.nn.Module], Any]:
    ids = prompt(1, 10)
    ids[0, 5:8] = ids[0, 1:4]  # an n-gram for prompt lookup to find

    def run(model: torch.nn.Module) -> Any:
        out = generated(model, ids, max_new_tokens=8, **kw, **static(cache))
        del out["scores"]  # (the candidates' scores are the logits here)
        return out

    return run


def _speculative_cases() -> list[Any]:
    # a Gemma2 static cache holds sliding layers, which transformers cannot crop (it refuses assisted decoding)
    skip = pytest.mark.skip(reason="transformers: a static cache with sliding layers cannot be cropped")
    return [pytest.param(m, f, c, marks=[skip] if (f, c) == ("gemma2", "static") else []) for m, f in CASES for c in CACHES]


@pytest.mark.parametrize(("mode", "family", "cache"), _speculative_cases())
def test_assisted_decoding(mode, family, cache, fused):
    """The assistant patched as the main model is (each model its own stream and caches)."""
    assistant = tiny(family, layers=1, seed=5)
    patched_assistant = patch(copy.deepcopy(assistant), **({"mode": "inference"} if mode == "inference" else {}))
    ref, model = pair(mode, family)
    want = _speculative(cache, do_sample=False, assistant_model=assistant)(ref)
    got = _speculative(cache, do_sample=False, assistant_model=patched_assistant)(model)
    assert_same(got, want)
    if mode == "inference":
        assert bool(fused) == (cache == "static" and FUSED_ON_CPU)


@pytest.mark.parametrize(("mode", "family", "cache"), _speculative_cases())
def test_prompt_lookup_decoding(mode, family, cache, fused):
    compare(mode, family, _speculative(cache, do_sample=False, prompt_lookup_num_tokens=3), fused, cache)


# -- what the caller asks generate to return ------------------------------------------------------
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(("mode", "family"), CASES)
def test_hidden_states_and_attentions_in_generate(mode, family, cache, fused):
    """Every layer's hidden states and (eager) attention weights: inference mode runs the model's
    own forwards for per-layer outputs, with the same values."""

    def run(model: torch.nn.Module) -> Any:
        model.config._attn_implementation = "eager"  # (SDPA returns no weights, patched or not)
        return generated(model, prompt(), max_new_tokens=4, num_beams=2, output_hidden_states=True, output_attentions=True, **static(cache))

    ref, model = pair(mode, family)
    want, got = run(ref), run(model)
    assert len(want["hidden_states"]) == len(want["attentions"]) == 4
    assert_same(got, want)


@pytest.mark.parametrize(("mode", "family"), CASES)
def test_logits_to_keep(mode, family, fused):
    """A forward's ``logits_to_keep`` (0: all), and generate's default: it still sees the patched
    forward take ``logits_to_keep`` and asks for the last position only."""

    def run(model: torch.nn.Module) -> Any:
        seen: list[tuple[Any, tuple[int, ...]]] = []
        hook = model.register_forward_hook(
            lambda m, a, kw, out: seen.append((kw.get("logits_to_keep"), out.logits.shape)), with_kwargs=True
        )
        out = generated(model, prompt(), max_new_tokens=2, do_sample=False)
        hook.remove()
        assert seen == [(1, (2, 1, VOCAB))] * 2
        with torch.no_grad():
            return out, [model(prompt(), logits_to_keep=k).logits for k in (0, 1, 3, torch.tensor([0, 2, 4]))]

    compare(mode, family, run, fused, "none")


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize(("mode", "family"), CASES)
def test_generation_in_training_mode(mode, family, checkpointing, fused):
    """generate() on a model in training mode, as an online-RL trainer samples completions
    between steps (gradient checkpointing on: transformers turns the cache off)."""

    def run(model: torch.nn.Module) -> Any:
        model.train()
        if checkpointing:  # (renamed activation_checkpointing_enable in later transformers)
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        return generated(model, prompt(), max_new_tokens=4, do_sample=True, top_k=20, num_return_sequences=2)

    compare(mode, family, run, fused, "none")


# -- a returned cache used again ----------------------------------------------------------------
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(("mode", "family"), CASES)
def test_generation_continued_on_the_returned_cache(mode, family, cache, fused):
    """A chat's next turn: the first call's returned cache (a static one the caller made, sized
    for both turns) passed to the second, which prefills only the new tokens."""

    def run(model: torch.nn.Module) -> Any:
        c = transformers.StaticCache(config=model.config, max_cache_len=32) if cache == "static" else None
        first = generated(model, prompt(2, 6), past_key_values=c, max_new_tokens=4, do_sample=False)
        ids = torch.cat([first["sequences"], prompt(2, 3, seed=9)], 1)  # the new turn
        second = generated(model, ids, past_key_values=first.pop("past_key_values"), max_new_tokens=4, do_sample=False)
        return first, second

    compare(mode, family, run, fused, cache)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(("mode", "family"), [c for c in CASES if c[1] != "gemma2"])  # (sliding layers cannot be cropped)
def test_a_cropped_cache_reused(mode, family, cache, fused):
    def run(model: torch.nn.Module) -> Any:
        ids = prompt(2, 8)
        c = (
            transformers.StaticCache(config=model.config, max_cache_len=32)
            if cache == "static"
            else transformers.DynamicCache(config=model.config)
        )
        with torch.no_grad():
            first = model(ids, past_key_values=c, use_cache=True).logits
            c.crop(-3)  # the last 3 positions dropped, then written again
            again = model(ids[:, 5:], past_key_values=c, use_cache=True).logits
            c.crop(-2)
            out = generated(model, ids, past_key_values=c, max_new_tokens=4, do_sample=False)
        return first, again, out

    compare(mode, family, run, fused, cache)


# -- inputs_embeds: a VLM-style prefix ------------------------------------------------------------
def _prefixed_embeds(model: torch.nn.Module, batch: int = 2) -> torch.Tensor:
    """An image-like prefix of 3 vectors, then a prompt's token embeddings."""
    with torch.no_grad():
        prefix = torch.randn(batch, 3, HIDDEN, generator=torch.Generator().manual_seed(7))
        return torch.cat([prefix, model.get_input_embeddings()(prompt(batch, 4))], 1)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(("mode", "family"), CASES)
def test_generation_from_inputs_embeds(mode, family, cache, fused):
    def run(model: torch.nn.Module) -> Any:
        embeds = _prefixed_embeds(model)
        greedy = generated(model, inputs_embeds=embeds, max_new_tokens=4, do_sample=False, **static(cache))
        mask = torch.ones(embeds.shape[:2], dtype=torch.long)
        beams = generated(model, inputs_embeds=embeds, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, **static(cache))
        return greedy, beams

    compare(mode, family, run, fused, cache)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(("mode", "family"), CASES)
def test_a_decode_loop_on_inputs_embeds_leaves_them_as_they_are(mode, family, cache, fused):
    """A caller's own loop (a VLM's language model, an audio LM) that feeds embeddings at every
    step, prefill and decode: the same logits, and the caller's embeddings not written to (the
    carried stream starts as a copy of them; generate() clones them itself, a direct call does not)."""

    def run(model: torch.nn.Module) -> Any:
        embeds = _prefixed_embeds(model)
        kept = embeds.clone()
        c = (
            transformers.StaticCache(config=model.config, max_cache_len=16)
            if cache == "static"
            else transformers.DynamicCache(config=model.config)
        )
        with torch.no_grad():
            logits = [model(inputs_embeds=embeds, past_key_values=c, use_cache=True).logits]
            for _ in range(3):
                step = model.get_input_embeddings()(logits[-1][:, -1:].argmax(-1))
                step_kept = step.clone()
                logits.append(model(inputs_embeds=step, past_key_values=c, use_cache=True).logits)
                assert torch.equal(step, step_kept)
        assert torch.equal(embeds, kept)
        return logits

    compare(mode, family, run, fused, cache)
