"""Hugging Face integration: what users do to a model after ``patch(model)`` (hooks added and
removed, unpatching, copying) keeps transformers' results. Tiny random Llamas in fp32 on the
torch impls; the parity and mechanics of the patch itself are in test_transformers.py."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import polykernel  # noqa: E402
from polykernel.integrations import transformers as pkt  # noqa: E402

VOCAB = 128
FP32 = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(autouse=True)
def torch_impls():
    with polykernel.use_impl("torch"):
        yield


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def ids():
    return torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def logits(model):
    with torch.no_grad():
        return model(ids()).logits


def test_unpatch_keeps_an_accelerate_hook_added_after_the_patch():
    # add_hook_to_module moves the patched forward into `_old_forward` and wraps it in `forward`:
    # unpatch restores the original under the hook, and the hook keeps running
    hooks = pytest.importorskip("accelerate.hooks")

    class Scale(hooks.ModelHook):
        def post_forward(self, module, output):
            return output * 2

    ref = tiny_llama()
    model = copy.deepcopy(ref)
    pkt.patch(model)
    for m in (ref, model):
        hooks.add_hook_to_module(m.model.norm, Scale())
    assert "model.norm" in pkt.patched(model)["rms_norm"]  # still patched, under the hook
    pkt.unpatch(model)
    assert pkt.patched(model) == {}
    torch.testing.assert_close(logits(model), logits(ref), **FP32)
    hooks.remove_hook_from_module(model.model.norm)
    assert model.model.norm.forward.__func__ is type(model.model.norm).forward


def test_unpatch_after_an_accelerate_hook_was_removed():
    # a hook added before the patch and removed after it: remove_hook_from_module moves the
    # patched forward from `_old_forward` back into `forward`, which unpatch must then restore
    hooks = pytest.importorskip("accelerate.hooks")
    model = tiny_llama()
    hooks.add_hook_to_module(model.model.norm, hooks.ModelHook())
    pkt.patch(model)
    hooks.remove_hook_from_module(model.model.norm)
    assert "model.norm" in pkt.patched(model)["rms_norm"]
    pkt.unpatch(model)
    assert pkt.patched(model) == {}
    assert "_old_forward" not in model.model.norm.__dict__
    polykernel.clear_caches()
    logits(model)
    assert not polykernel.decisions("rms_norm")  # transformers' own norm ran
