"""Hugging Face integration: what users do to a model after ``patch(model)`` (hooks added and
removed, unpatching, copying) keeps transformers' results. Tiny random Llamas in fp32 on the
torch impls; the parity and mechanics of the patch itself are in test_transformers.py."""

import copy
import io
import logging
import pickle

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


def tiny_llama(layers=1):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
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


def _round_trips():
    def pickled(model):
        return pickle.loads(pickle.dumps(model))

    def saved(model):
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    return {"deepcopy": copy.deepcopy, "pickle": pickled, "torch.save": saved}


def _closure_objects(module):
    """What the module's patched forward holds beyond itself (its closure's cells, all the way in)."""
    found, todo, seen = [], [module.forward.__func__], set()
    while todo:
        fn = todo.pop()
        for cell in getattr(fn, "__closure__", None) or ():
            value = cell.cell_contents
            if id(value) not in seen:
                seen.add(id(value))
                (todo if callable(value) and hasattr(value, "__closure__") else found).append(value)
    return found


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("mode", ["default", "inference"])
def test_a_copy_of_a_patched_model_comes_back_patched_the_same_way(mode, how, caplog):
    # a bound method in a module's __dict__ pickles as getattr(module, "forward"): the copy came
    # back on transformers' forwards while keeping polykernel's bookkeeping; a deepcopy shared the
    # original's closures (mode="inference": its residual stream and its MLPs' activations, so the
    # copy's MLPs fell back to transformers', and the two models' streams were one)
    ref = tiny_llama(layers=2)
    model = pkt.patch(copy.deepcopy(ref), mode=mode)
    logits(model)
    clone = _round_trips()[how](model)
    assert pkt.patched(clone) == pkt.patched(model)
    for name, m in clone.named_modules():
        if "forward" in m.__dict__:
            assert m.forward.__self__ is m, name
            held = _closure_objects(m)
            originals = dict(model.named_modules())[name].modules()
            assert not any(o is x for o in originals for x in held), name  # nothing of the original model
    streams = {id(x) for m in clone.modules() if "forward" in m.__dict__ for x in _closure_objects(m) if type(x).__name__ == "_Stream"}
    assert len(streams) == (1 if mode == "inference" else 0)  # one stream, the copy's own
    polykernel.clear_caches()
    with caplog.at_level(logging.WARNING, logger="polykernel"):
        torch.testing.assert_close(logits(clone), logits(ref), **FP32)
    assert not [r for r in caplog.records if "running transformers' forward" in r.getMessage()]
    assert polykernel.decisions("fused_add_rms_norm_" if mode == "inference" else "rms_norm")  # polykernel ran in the copy
    if mode == "inference":  # the copy's projections view its own merged weights, and saving it writes them whole
        attn = clone.model.layers[0].self_attn
        assert attn.q_proj.weight.data_ptr() == attn.__dict__["_polykernel_qkv_weight"].data_ptr()
        assert attn.q_proj.weight.data_ptr() != model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    want = ref.state_dict()
    got = clone.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    pkt.unpatch(clone)
    assert pkt.patched(clone) == {}
    assert not [(n, k) for n, m in clone.named_modules() for k in m.__dict__ if k.startswith(("_polykernel", "forward", "__"))]
    assert pkt.patched(model) != {}  # the original is still patched
    torch.testing.assert_close(logits(clone), logits(ref), **FP32)


def _frozen_but(model, trainable):
    model.requires_grad_(False)
    for name in trainable:
        model.get_parameter(name).requires_grad_(True)


@pytest.mark.parametrize(
    "trainable",
    [
        ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"],  # frozen embeddings
        ["model.layers.0.mlp.up_proj.weight"],  # the gate frozen, the up projection not
        ["model.layers.1.self_attn.k_proj.bias"],  # a bias alone
        [],  # nothing but the caller's inputs_embeds
    ],
)
def test_inference_patch_with_some_weights_trainable_gives_their_gradients(trainable):
    # mode="inference" runs the serving ops (in-place, merged detached weights) when no gradient is
    # wanted; it judged that from the embeddings' and the gate's requires_grad only: frozen
    # embeddings raised from fused_add_rms_norm_, a trainable up_proj (gate frozen) got no gradient
    ref = tiny_llama(layers=2)
    ref.config.attention_bias = True
    for layer in ref.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = getattr(layer.self_attn, name)
            setattr(layer.self_attn, name, torch.nn.Linear(proj.in_features, proj.out_features, bias=True))
    model = pkt.patch(copy.deepcopy(ref), mode="inference")
    grads = []
    for m in (ref, model):
        _frozen_but(m, trainable)
        embeds = m.model.embed_tokens(ids()).detach().requires_grad_(not trainable)
        m(inputs_embeds=embeds).logits.square().sum().backward()
        grads.append([m.get_parameter(n).grad for n in trainable] + ([embeds.grad] if not trainable else []))
    assert all(g is not None for g in grads[1])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, **FP32)


def _draft_sharing(model, index):
    """Another Llama of two layers whose second layer is ``model``'s layer ``index`` (shared)."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 2
    torch.manual_seed(1)
    other = transformers.LlamaForCausalLM(config).eval()
    other.model.layers[1] = model.model.layers[index]
    return other


@pytest.mark.parametrize(
    "change",
    [
        "another model patched",
        "another model patched by default",
        "another model unpatched",
        "layer copied",
        "layer replaced",
        "layer used twice",
    ],
)
def test_inference_patch_after_its_layers_change_keeps_the_logits(change, caplog):
    # mode="inference" carries the residual stream from layer to layer: each layer returns its MLP
    # output and leaves the residual to the next. A layer in the chain that no longer takes part
    # (re-patched for another model that shares it, unpatched, replaced, a copy on its own stream)
    # got the MLP output alone: silently wrong logits. The model's own forwards run then, logged.
    ref = tiny_llama(layers=3)
    model = pkt.patch(copy.deepcopy(ref), mode="inference")
    layers = model.model.layers
    if change.startswith("another model"):
        other = _draft_sharing(model, 1)
        if change == "another model patched":
            pkt.patch(other, mode="inference")
        elif change == "another model patched by default":
            pkt.patch(other)
        else:
            pkt.unpatch(other)
        with torch.no_grad():
            other(ids())  # the other model runs too
    elif change == "layer copied":
        layers[1] = copy.deepcopy(layers[1])  # its own copy of the stream
    elif change == "layer replaced":
        layers[1] = copy.deepcopy(ref.model.layers[1])
    else:  # the first layer again, last (a layer used twice: it takes its input as the embeddings)
        for m in (model, ref):
            m.model.layers = torch.nn.ModuleList([*m.model.layers[:2], m.model.layers[0]])
            m.config.use_cache = False  # (its attention has one cache slot)
    with caplog.at_level(logging.WARNING, logger="polykernel"):
        torch.testing.assert_close(logits(model), logits(ref), **FP32)
    assert [r for r in caplog.records if "decoder layers" in r.getMessage()]
