"""TRL's trainers that polykernel leaves the loss to (KTO, ORPO, CPO/SimPO, SFT) on a model
patched with :func:`polykernel.integrations.transformers.patch`: the patched layers change no
loss, metric or gradient of TRL's own, whatever the trainer's loss options.

KTO and SFT score tokens through TRL's fused LM head (``fused_lm_head=True``, which the patched
forward leaves to TRL's), ORPO and CPO call the model for logits without labels: either way the
loss is TRL's, over polykernel's layer kernels. Tiny random Llama in fp32, torch impls.
"""

import copy
import random

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from test_trl import common_args, grads, preference_data, tiny_llama, word_tokenizer, words  # noqa: E402

import polykernel  # noqa: E402
from polykernel.integrations.transformers import patch, patched  # noqa: E402

FP32 = dict(rtol=2e-5, atol=2e-5)
FP32_GRAD = dict(rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


def last_metrics(trainer):
    stored = trainer._metrics if hasattr(trainer, "_metrics") else trainer._stored_metrics  # ORPO's and CPO's
    return {k: v[-1] for k, v in stored["train"].items()}


def unpaired_data(n=8):
    rng = random.Random(2)
    rows = [{"prompt": words(rng, 2, 5), "completion": " " + words(rng, 1, 4), "label": i % 3 != 0} for i in range(n)]
    return datasets.Dataset.from_list(rows)


def completion_data(n=8):
    rng = random.Random(3)
    return datasets.Dataset.from_list([{"prompt": words(rng, 2, 5), "completion": " " + words(rng, 1, 4)} for _ in range(n)])


def kto(tmp_path, tokenizer, model, **config):
    args = trl.KTOConfig(per_device_train_batch_size=4, **common_args(tmp_path), **config)
    return trl.KTOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=unpaired_data(), processing_class=tokenizer)


def orpo(tmp_path, tokenizer, model, **config):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    args = ORPOConfig(per_device_train_batch_size=4, **common_args(tmp_path), **config)
    return ORPOTrainer(model=model, args=args, train_dataset=preference_data(), processing_class=tokenizer)


def cpo(tmp_path, tokenizer, model, **config):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = CPOConfig(per_device_train_batch_size=4, **common_args(tmp_path), **config)
    return CPOTrainer(model=model, args=args, train_dataset=preference_data(), processing_class=tokenizer)


def sft(tmp_path, tokenizer, model, **config):
    args = trl.SFTConfig(per_device_train_batch_size=4, **common_args(tmp_path), **config)
    return trl.SFTTrainer(model=model, args=args, train_dataset=completion_data(), processing_class=tokenizer)


CASES = {
    "kto": (kto, dict(beta=0.2, desirable_weight=1.5, undesirable_weight=0.7)),
    "kto-apo_zero_unpaired": (kto, dict(loss_type="apo_zero_unpaired", beta=0.1)),
    "orpo": (orpo, dict(beta=0.3)),
    "cpo-sigmoid": (cpo, dict(beta=0.2, label_smoothing=0.1, cpo_alpha=0.5)),
    "cpo-ipo": (cpo, dict(loss_type="ipo", beta=0.2)),
    "simpo": (cpo, dict(loss_type="simpo", beta=2.0, simpo_gamma=0.7, cpo_alpha=0.0)),
    "sft": (sft, dict()),
    "sft-dft": (sft, dict(loss_type="dft", completion_only_loss=True)),
}


@pytest.mark.parametrize(("build", "config"), CASES.values(), ids=CASES.keys())
def test_patched_model_keeps_trls_loss_metrics_and_grads(tmp_path, tokenizer, build, config):
    model = tiny_llama()
    with torch.no_grad():  # a policy off its reference (KTO's copy), so that rewards and KL are not 0
        for p in model.parameters():
            p.add_(0.05 * torch.sin(torch.arange(p.numel(), dtype=p.dtype)).view_as(p))
    theirs = build(tmp_path, tokenizer, copy.deepcopy(model), **config)
    ours = build(tmp_path, tokenizer, model, **config)
    patch(ours.model)  # after the trainer built its own forward (add_fused_lm_head): as a user would
    assert patched(ours.model).get("rms_norm"), patched(ours.model)  # the layers run polykernel's kernels
    if getattr(ours, "ref_model", None) is not None:
        patch(ours.ref_model)
    batch = next(iter(theirs.get_train_dataloader()))
    results = []
    with polykernel.use_impl("torch"):
        for trainer in (theirs, ours):
            trainer.model.train()
            loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(copy.deepcopy(batch)))
            loss.backward()
            results.append((loss.detach(), last_metrics(trainer), grads(trainer.model)))
    (loss_t, metrics_t, grads_t), (loss_o, metrics_o, grads_o) = results
    torch.testing.assert_close(loss_o, loss_t, **FP32)
    assert metrics_o.keys() == metrics_t.keys() and metrics_t
    for key, value in metrics_t.items():
        assert metrics_o[key] == pytest.approx(value, rel=1e-4, abs=2e-5, nan_ok=True), key
    assert grads_o.keys() == grads_t.keys() and grads_t
    for name, grad in grads_t.items():
        torch.testing.assert_close(grads_o[name], grad, msg=name, **FP32_GRAD)
