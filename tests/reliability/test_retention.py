"""polykernel keeps no user tensor or module alive after the user drops it: what a long training or
serving run would otherwise lose (on a GPU, memory that ``torch.cuda.empty_cache()`` cannot give
back). Each test drops every reference of its own, collects, and checks a weak reference."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tiny_llama import VOCAB, tiny_llama  # noqa: E402
from polykernel.integrations.transformers import patch, unpatch  # noqa: E402


def ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def padded_mask() -> torch.Tensor:
    # a padded prompt: transformers builds a 4-d mask, which the shared-KV decode path converts
    return torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1] * 7])


def _dead(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


@pytest.mark.parametrize("move", [lambda m: m.to(torch.float64), lambda m: m.to("meta")], ids=["dtype", "device"])
def test_inference_merged_weights_are_not_kept_after_to(move):
    # mode="inference" concatenates gate/up and q/k/v into one weight that the projections view;
    # .to() gives the projections new tensors: the old merged copy (a GPU's gate/up and QKV
    # weights, GiB at LLM sizes, after model.to("cpu")) must not stay in the module
    model = tiny_llama()
    patch(model, mode="inference")
    with torch.no_grad():
        model(ids())
    layer = model.model.layers[0]
    old = [weakref.ref(layer.mlp.__dict__["_polykernel_gate_up_weight"]), weakref.ref(layer.self_attn.__dict__["_polykernel_qkv_weight"])]
    move(model)
    assert [_dead(r) for r in old] == [True, True]


def test_inference_after_to_merges_again_and_matches():
    # the merged weights dropped by .to() are merged again on the next forward, on the new tensors
    ref, model = tiny_llama(), tiny_llama()
    patch(model, mode="inference")
    with torch.no_grad():
        model(ids())
        model.to(torch.float64)
        ref.to(torch.float64)
        got, want = model(ids()).logits, ref(ids()).logits
    mlp = model.model.layers[0].mlp
    merged = mlp.__dict__["_polykernel_gate_up_weight"]
    assert merged.dtype == torch.float64 and mlp.gate_proj.weight.data_ptr() == merged.data_ptr()
    torch.testing.assert_close(got, want)


def test_unpatch_drops_what_the_inference_patch_added():
    model = tiny_llama()
    patch(model, mode="inference")
    unpatch(model)
    left = [(name, key) for name, m in model.named_modules() for key in m.__dict__ if key.startswith("_polykernel") or key == "_apply"]
    assert left == []


def test_decode_mask_is_not_kept_after_the_forward():
    # the shared-KV decode path converts the boolean mask once per forward: neither mask may
    # outlive that forward (they were kept at module level, past the model's own deletion)
    model = tiny_llama()
    patch(model, mode="inference")
    seen = []
    additive = torch.Tensor.masked_fill_

    def spy(t, *args):  # the additive mask the conversion makes
        seen.append(weakref.ref(t))
        return additive(t, *args)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "masked_fill_", spy)
        out = model.generate(ids(), attention_mask=padded_mask(), max_new_tokens=2, do_sample=False)
    del out, model
    assert seen, "the decode path did not convert a mask: the test no longer covers it"
    assert all(_dead(r) for r in seen)


def test_decode_mask_conversion_is_shared_within_a_forward():
    # behaviour kept: one conversion per decode forward, which every layer reuses
    model = tiny_llama(layers=3)
    patch(model, mode="inference")
    made = []
    additive = torch.Tensor.masked_fill_

    def spy(t, *args):
        made.append(t.shape)
        return additive(t, *args)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "masked_fill_", spy)
        model.generate(ids(), attention_mask=padded_mask(), max_new_tokens=3, do_sample=False)
    assert made == [torch.Size([2, 1, 1, 8]), torch.Size([2, 1, 1, 9])]  # two decode steps, three layers each


def test_a_copy_converts_its_own_merged_weights():
    # the copy's .to() drops the copy's stale merged weights, never the original's
    import copy

    model = tiny_llama()
    patch(model, mode="inference")
    twin = copy.deepcopy(model)
    twin.to(torch.float64)
    assert "_polykernel_gate_up_weight" in model.model.layers[0].mlp.__dict__
    assert "_polykernel_gate_up_weight" not in twin.model.layers[0].mlp.__dict__
    with torch.no_grad():
        torch.testing.assert_close(twin(ids()).logits.float(), model(ids()).logits, atol=1e-5, rtol=1e-5)
