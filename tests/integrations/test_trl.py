"""TRL integration: ``PolykernelDPOTrainer``/``PolykernelGRPOTrainer`` give TRL's own loss,
metrics and gradients on the same batch, train a few steps, and refuse what they do not compute.

Real TRL on a tiny random Llama in fp32 with a word-level tokenizer built in memory: nothing is
downloaded (GRPO's reference model is loaded from a directory the test saves). GRPO's generation
runs on the CPU with ``transformers``' ``generate`` and a reward function in Python. The losses
run their torch impl (the Triton interpreter is slow on the CPU); one test runs the default
selection.
"""

import copy
import random

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import _trl_fields as fields  # noqa: E402
from polykernel.integrations import trl as pktrl  # noqa: E402

VOCAB, WORDS = 64, 61
IMPL = "torch"


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(WORDS)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def tiny_llama(**overrides):
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=None, **overrides,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def tiny_mixtral():
    """An MoE model: TRL adds its router load-balancing loss (router_aux_loss_coef) to the loss."""
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.05,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def words(rng, lo, hi):
    return " ".join(f"w{rng.randrange(WORDS)}" for _ in range(rng.randint(lo, hi)))


def preference_data(n=8):
    rng = random.Random(0)
    rows = [{"prompt": words(rng, 2, 5), "chosen": " " + words(rng, 1, 4), "rejected": " " + words(rng, 1, 4)} for _ in range(n)]
    return datasets.Dataset.from_list(rows)


def prompt_data(n=8):
    rng = random.Random(1)
    return datasets.Dataset.from_list([{"prompt": words(rng, 2, 4)} for _ in range(n)])


def reward_len(completions, **kwargs):
    return [len(c) / 10.0 for c in completions]


def common_args(tmp_path):
    # fp32 (TRL's configs default to bf16 autocast), CPU, nothing written but the output dir
    return dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, save_strategy="no", logging_steps=1, seed=0)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(ours, theirs):
    assert ours.keys() == theirs.keys() and ours
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)


def last_metrics(trainer, mode="train"):
    return {k: v[-1] for k, v in trainer._metrics[mode].items()}


# -- DPO ---------------------------------------------------------------------------------------
def dpo_pair(tmp_path, tokenizer, *, moe=False, peft=None, **config):
    """TRL's trainer and ours on copies of one model (and reference; with ``peft``, a LoRA config,
    the adapter-disabled model is the reference)."""
    model = tiny_mixtral() if moe else tiny_llama()
    ref = None if peft else copy.deepcopy(model).eval()
    args = trl.DPOConfig(per_device_train_batch_size=4, **{**common_args(tmp_path), **config})
    data = preference_data()
    kwargs = dict(train_dataset=data, processing_class=tokenizer)
    if peft:
        kwargs["peft_config"] = pytest.importorskip("peft").LoraConfig(r=4, **peft)
    theirs = trl.DPOTrainer(model=copy.deepcopy(model), ref_model=copy.deepcopy(ref), args=copy.deepcopy(args), **kwargs)
    ours = pktrl.PolykernelDPOTrainer(model=model, ref_model=ref, args=args, impl=IMPL, **kwargs)
    if peft:  # the same adapters (their initialisation is random)
        ours.model.load_state_dict(theirs.model.state_dict())
    return theirs, ours


def perturb(*trainers):
    """The same change to each policy: it then differs from its reference, so rewards are not 0
    (with PEFT, to the trained parameters: the frozen base is the reference)."""
    with torch.no_grad():
        for trainer in trainers:
            for p in filter(lambda p: p.requires_grad, trainer.model.parameters()):
                p.add_(0.05 * torch.sin(torch.arange(p.numel(), dtype=p.dtype)).view_as(p))


DPO_CASES = {
    "sigmoid": dict(beta=0.1),
    "sigmoid-weighted": dict(beta=0.2, loss_weights=[2.0]),
    "sigmoid+sft": dict(beta=0.5, loss_type=["sigmoid", "sft"], loss_weights=[0.5, 0.5]),
    "precomputed-ref": dict(beta=0.1, precompute_ref_log_probs=True),
    "moe-aux-loss": dict(beta=0.1, moe=True),
    "moe-aux-loss-coef": dict(beta=0.1, moe=True, router_aux_loss_coef=0.2),
    # read by TRL's loss only for the loss types and f-divergences we refuse: TRL's sigmoid loss ignores them too
    "inert": dict(beta=0.1, label_smoothing=0.2, discopop_tau=0.5, f_alpha_divergence_coef=0.3),
    # the collated batch: truncated from the end, padded to a multiple (padding_free: TRL 1.16 turns it off)
    # PEFT: the reference is the adapter-disabled model, its head the original one, not modules_to_save's trained copy
    "peft-lora": dict(beta=0.1, peft=dict(target_modules=["q_proj", "v_proj"])),
    "peft-lm-head-saved": dict(beta=0.1, peft=dict(target_modules=["q_proj"], modules_to_save=["lm_head"])),
    # keep_start truncation (TRL drops the examples it truncates to no completion token)
    "truncated-away": dict(beta=0.1, max_length=4, truncation_mode="keep_start"),
    "truncated-padded": dict(beta=0.1, max_length=6, truncation_mode="keep_end", pad_to_multiple_of=8, padding_free=True),
}


@pytest.mark.parametrize("config", DPO_CASES.values(), ids=DPO_CASES.keys())
def test_dpo_loss_metrics_and_grads_match_trl(tmp_path, tokenizer, config):
    theirs, ours = dpo_pair(tmp_path, tokenizer, **config)
    perturb(theirs, ours)
    batch = next(iter(theirs.get_train_dataloader()))
    results = []
    for trainer in (theirs, ours):
        inputs = trainer._prepare_inputs(copy.deepcopy(batch))
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        results.append((loss.detach(), last_metrics(trainer), grads(trainer.model)))
    (loss_t, metrics_t, grads_t), (loss_o, metrics_o, grads_o) = results
    torch.testing.assert_close(loss_o, loss_t, rtol=1e-5, atol=1e-6)
    assert_same_grads(grads_o, grads_t)
    logged = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "num_tokens"]
    logged += ["aux_loss"] if config.get("moe") else []
    assert set(logged) <= metrics_o.keys() <= metrics_t.keys()
    for key in logged:
        assert metrics_o[key] == pytest.approx(metrics_t[key], rel=1e-5, abs=1e-6), key
    assert metrics_t["rewards/margins"] != 0.0  # the comparison saw real rewards


def test_dpo_trains_two_steps(tmp_path, tokenizer):
    _, ours = dpo_pair(tmp_path, tokenizer, beta=0.1, max_steps=2, learning_rate=1e-3)
    before = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    ours.train()
    steps = [log for log in ours.state.log_history if "loss" in log]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(log["loss"])) for log in steps)
    assert all("rewards/margins" in log and "logps/chosen" in log for log in steps)
    assert any(not torch.equal(before[n], p) for n, p in ours.model.named_parameters())


def test_dpo_evaluate_matches_trl(tmp_path, tokenizer):
    """Evaluation: TRL's prediction_step asks compute_loss for outputs (the logits, from one more
    forward); the eval loss and metrics are TRL's."""
    theirs, ours = dpo_pair(tmp_path, tokenizer, beta=0.1, per_device_eval_batch_size=4)
    perturb(theirs, ours)
    data = preference_data(4)
    results = [trainer.evaluate(eval_dataset=data) for trainer in (theirs, ours)]
    assert results[0]["eval_rewards/margins"] != 0.0 and "eval_rewards/margins" in results[1]
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected"):
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-5, abs=1e-6), key


def test_untested_trl_version_warns(monkeypatch, caplog):
    monkeypatch.setattr(pktrl.importlib.metadata, "version", lambda name: "1.99.0")
    with caplog.at_level("WARNING", logger=pktrl.__name__):
        pktrl._warn_untested_trl.__wrapped__()
    assert "TRL 1.99.0 is installed" in caplog.text


def test_dpo_default_selection_runs(tmp_path, tokenizer):
    """No impl=: polykernel's own selection picks the loss's impl."""
    _, ours = dpo_pair(tmp_path, tokenizer)
    ours._polykernel_impl = None
    inputs = ours._prepare_inputs(next(iter(ours.get_train_dataloader())))
    loss = ours.compute_loss(ours.model, inputs)
    loss.backward()
    assert torch.isfinite(loss) and ours.model.lm_head.weight.grad is not None


DPO_PRECISION_CASES = {"bf16": (dict(bf16=True), torch.bfloat16), "fp16": (dict(fp16=True), torch.float16)}


@pytest.mark.parametrize(("config", "dtype"), DPO_PRECISION_CASES.values(), ids=DPO_PRECISION_CASES.keys())
def test_dpo_mixed_precision_projects_in_the_autocast_dtype(tmp_path, tokenizer, monkeypatch, config, dtype):
    """With bf16 (TRL's default) or fp16 and fp32 weights, TRL's head projects in that dtype under
    autocast; so does ours (the policy's head and the reference's), and the loss stays within
    bf16 of TRL's."""
    theirs, ours = dpo_pair(tmp_path, tokenizer, **{"bf16": False, **config})
    seen = []
    real = pktrl._pk.fused_linear_dpo_loss

    def spy(hidden, weight, target, bias=None, **kwargs):
        seen.append((hidden.dtype, weight.dtype, kwargs["ref_hidden"].dtype, kwargs["ref_weight"].dtype))
        return real(hidden, weight, target, bias, **kwargs)

    monkeypatch.setattr(pktrl._pk, "fused_linear_dpo_loss", spy)
    batch = next(iter(theirs.get_train_dataloader()))
    losses = []
    for trainer in (theirs, ours):
        with trainer.compute_loss_context_manager():
            losses.append(trainer.compute_loss(trainer.model, trainer._prepare_inputs(copy.deepcopy(batch))).detach())
    assert seen == [(dtype,) * 4]
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=2e-3)


def fake_zero3(monkeypatch, option):
    """ZeRO-3 needs DeepSpeed installed to configure: fake what TRL's head asks (is ZeRO-3 on?)."""
    if option == "deepspeed":
        monkeypatch.setattr(transformers.integrations.deepspeed, "is_deepspeed_zero3_enabled", lambda: True)


@pytest.mark.parametrize(("option", "config"), fields.DPO_REFUSED, ids=lambda x: str(x) if isinstance(x, str) else "")
def test_dpo_unsupported_config_raises_before_data(tmp_path, tokenizer, monkeypatch, config, option):
    args = trl.DPOConfig(**config, **common_args(tmp_path))
    fake_zero3(monkeypatch, option)
    never_read = datasets.Dataset.from_list([{"unexpected": 1}])  # TRL would fail on it: the check comes first
    with pytest.raises(pktrl.UnsupportedTRLConfig, match=option) as info:
        pktrl.PolykernelDPOTrainer(model=tiny_llama(), ref_model=tiny_llama(), args=args, train_dataset=never_read,
                                   processing_class=tokenizer)  # fmt: skip
    assert info.value.option == option


@pytest.mark.parametrize("which", ["policy", "reference"])
def test_dpo_softcapped_model_raises(tmp_path, tokenizer, which):
    """TRL's fused head softcaps by each model's own config (the reference's too)."""
    model, ref = tiny_llama(), tiny_llama()
    (model if which == "policy" else ref).config.final_logit_softcapping = 30.0
    args = trl.DPOConfig(**common_args(tmp_path))
    with pytest.raises(pktrl.UnsupportedTRLConfig, match="final_logit_softcapping"):
        pktrl.PolykernelDPOTrainer(model=model, ref_model=ref, args=args, train_dataset=preference_data(), processing_class=tokenizer)


# -- GRPO --------------------------------------------------------------------------------------
def grpo_pair(tmp_path, tokenizer, *, moe=False, **config):
    """TRL's trainer and ours on the same saved model (GRPO builds its reference from the path)."""
    path = tmp_path / "model"
    (tiny_mixtral() if moe else tiny_llama()).save_pretrained(path)
    tokenizer.save_pretrained(path)
    config.setdefault("beta", 0.0)
    defaults = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=6, **common_args(tmp_path))
    args = trl.GRPOConfig(**{**defaults, **config})
    kwargs = dict(reward_funcs=reward_len, train_dataset=prompt_data(), processing_class=tokenizer)
    theirs = trl.GRPOTrainer(model=str(path), args=copy.deepcopy(args), **kwargs)
    ours = pktrl.PolykernelGRPOTrainer(model=str(path), args=args, impl=IMPL, **kwargs)
    return theirs, ours


GRPO_CASES = [
    dict(loss_type="grpo"),
    dict(loss_type="bnpo", beta=0.04),
    dict(loss_type="dr_grpo", importance_sampling_level="sequence", max_completion_length=5),
    dict(loss_type="dapo", beta=0.04, temperature=0.7),
    dict(loss_type="dapo", importance_sampling_level="sequence", off_policy=True),
    dict(loss_type="grpo", beta=0.04, epsilon=0.1, epsilon_high=0.3, off_policy=True),  # TRL's default: the weighted KL
    dict(loss_type="bnpo", beta=0.04, use_bias_correction_kl=False),
    dict(loss_type="dapo", beta=0.04, importance_sampling_level="sequence", off_policy=True),
    dict(loss_type="bnpo", moe=True),
    dict(loss_type="bnpo", moe=True, router_aux_loss_coef=0.2),
    # TRL's batch carries an older policy's log-probs (then perturbed, so that ratios clip)
    dict(loss_type="grpo", beta=0.04, num_iterations=2, off_policy=True),
    # dapo's normaliser: the generation batch spans steps_per_generation accumulation steps
    dict(loss_type="dapo", steps_per_generation=2),
    dict(loss_type="dapo", beta=0.04, generation_batch_size=8, gradient_accumulation_steps=4, off_policy=True),
    # the head in fp32 under bf16 autocast: as close to TRL's as fp32 allows
    dict(loss_type="bnpo", beta=0.04, bf16=True, cast_lm_head_to_fp32=True, off_policy=True),
    dict(loss_type="dr_grpo", beta=0.04, bf16=True, off_policy=True),  # the head in bf16: within bf16 of TRL's
    dict(loss_type="bnpo", beta=0.04, fp16=True, off_policy=True),
    dict(loss_type="grpo", tool_mask=True),  # tool-call tokens (TRL's tool_mask) are not scored
    # mask_truncated_completions: the tiny model writes no EOS within max_completion_length, so nothing is
    # scored; TRL logs 0 (and NaN per-sequence extremes at token level), not an empty mean's NaN
    dict(loss_type="bnpo", beta=0.04, mask_truncated_completions=True, all_masked=True),
    dict(loss_type="dr_grpo", importance_sampling_level="sequence", mask_truncated_completions=True, all_masked=True),
    # several processes: TRL's means weigh each process by its token (or sequence) count
    dict(loss_type="grpo", beta=0.04, off_policy=True, other_rank=True),
    dict(loss_type="dapo", beta=0.04, steps_per_generation=2, off_policy=True, eval_mode=True),  # eval: no accumulation scaling
    dict(loss_type="grpo", beta=0.04, off_policy=True, eval_mode=True),
    dict(loss_type="dapo", beta=0.04, importance_sampling_level="sequence", off_policy=True, other_rank=True),
    # read by TRL's loss only for what we refuse (sapo, vespo, vLLM's correction, the adaptive entropy bonus)
    dict(
        loss_type="grpo",
        beta=0.04,
        off_policy=True,
        sapo_temperature_neg=2.0,
        sapo_temperature_pos=0.5,
        vespo_k_pos=1.0,
        vespo_lambda_pos=1.0,
        vespo_k_neg=1.0,
        vespo_lambda_neg=1.0,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_max=1.5,
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_cap=2.0,
        entropy_coef_min=0.1,
        entropy_coef_max=0.5,
        entropy_coef_delta=0.1,
        entropy_target=0.1,
    ),
]


@pytest.mark.parametrize("config", GRPO_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_grpo_loss_metrics_and_grads_match_trl(tmp_path, tokenizer, config):
    config = dict(config)
    off_policy, tool_mask = config.pop("off_policy", False), config.pop("tool_mask", False)
    all_masked, other_rank = config.pop("all_masked", False), config.pop("other_rank", False)
    eval_mode = config.pop("eval_mode", False)
    theirs, ours = grpo_pair(tmp_path, tokenizer, **config)
    batch = next(iter(theirs.get_train_dataloader()))
    inputs = theirs._generate_and_score_completions(batch)  # one generated batch, fed to both
    assert (inputs["completion_mask"].sum() > 0) != all_masked
    generate_every = theirs.args.steps_per_generation * theirs.args.num_iterations  # TRL's test for a stale batch
    assert ("old_per_token_logps" in inputs) == (theirs.args.gradient_accumulation_steps % generate_every != 0)
    stale = off_policy or "old_per_token_logps" in inputs  # TRL's own: the policy's, so no ratio clips
    if tool_mask:
        inputs["tool_mask"] = (torch.arange(inputs["completion_ids"].size(1)) % 2).expand_as(inputs["completion_mask"])
    if off_policy:  # an older policy's log-probs, far enough off for the ratios to clip
        noise = torch.randn(inputs["completion_ids"].shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logps, _, _ = theirs._get_per_token_logps_and_entropies(
                theirs.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1),
            )  # fmt: skip
        inputs["old_per_token_logps"] = logps + noise
    if other_rank:
        fake_other_rank(theirs, ours)
    results = []
    for trainer in (theirs, ours):
        trainer.model.train(not eval_mode)  # as in training (from_pretrained gives an eval-mode model)
        trainer.current_gradient_accumulation_steps = max(2, trainer.args.gradient_accumulation_steps)  # TRL scales the loss for it
        loss = trainer.compute_loss(trainer.model, copy.deepcopy(inputs))
        loss.backward()
        results.append((loss.detach(), last_metrics(trainer, "eval" if eval_mode else "train"), grads(trainer.model)))
    (loss_t, metrics_t, grads_t), (loss_o, metrics_o, grads_o) = results
    if (config.get("bf16") or config.get("fp16")) and not config.get("cast_lm_head_to_fp32"):  # both project in 16 bits, differently
        torch.testing.assert_close(loss_o, loss_t, rtol=2e-2, atol=2e-3)
        for name in grads_t:
            torch.testing.assert_close(grads_o[name], grads_t[name], rtol=5e-2, atol=2e-3, msg=name)
        return
    torch.testing.assert_close(loss_o, loss_t, rtol=1e-5, atol=1e-6)
    assert_same_grads(grads_o, grads_t)
    logged = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    logged += ["kl"] if config.get("beta", 0.0) else []
    logged += [] if stale else ["clip_ratio/low_min", "clip_ratio/high_max"]
    logged += ["aux_loss"] if config.get("moe") else []
    assert set(logged) <= metrics_o.keys() <= metrics_t.keys()
    for key in logged:
        assert metrics_o[key] == pytest.approx(metrics_t[key], rel=1e-5, abs=1e-6, nan_ok=True), key
    if off_policy:
        assert metrics_t["clip_ratio/region_mean"] > 0  # the comparison saw clipped tokens


def fake_other_rank(*trainers):
    """A second process that scored 3 tokens (or sequences) with no clipping and no KL: what its
    reduce (sums, counts) and gather (per-sequence values) would add to this one's."""
    for trainer in trainers:
        trainer.accelerator.reduce = lambda t, reduction: t + torch.tensor([0.0, 3.0], dtype=t.dtype)
        trainer.accelerator.gather = lambda t: torch.cat([t, torch.zeros_like(t)])


def test_grpo_trains_two_steps(tmp_path, tokenizer):
    _, ours = grpo_pair(tmp_path, tokenizer, loss_type="dapo", beta=0.04, max_steps=2, learning_rate=1e-3)
    ours.train()
    steps = [log for log in ours.state.log_history if "loss" in log]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(log["loss"])) for log in steps)
    assert all("kl" in log and "clip_ratio/region_mean" in log and "reward" in log for log in steps)


@pytest.mark.parametrize(("option", "config"), fields.GRPO_REFUSED, ids=lambda x: str(x) if isinstance(x, str) else "")
def test_grpo_unsupported_config_raises(tmp_path, tokenizer, monkeypatch, config, option):
    args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4, **config, **common_args(tmp_path))
    fake_zero3(monkeypatch, option)
    with pytest.raises(pktrl.UnsupportedTRLConfig, match=option) as info:
        pktrl.PolykernelGRPOTrainer(model=tiny_llama(), reward_funcs=reward_len, args=args, train_dataset=prompt_data(),
                                    processing_class=tokenizer)  # fmt: skip
    assert info.value.option == option


def test_multimodal_batch_raises_before_the_model_runs(tmp_path, tokenizer):
    _, ours = dpo_pair(tmp_path, tokenizer)
    inputs = ours._prepare_inputs(next(iter(ours.get_train_dataloader())))
    inputs["pixel_values"] = torch.zeros(1, 3, 4, 4)
    with pytest.raises(pktrl.UnsupportedTRLConfig, match="pixel_values"):
        ours.compute_loss(ours.model, inputs)


def test_importing_integrations_does_not_import_trl():
    import subprocess
    import sys

    code = "import polykernel, polykernel.integrations, sys; assert 'trl' not in sys.modules, 'trl imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- every config field classified (tests/_trl_fields.py) ---------------------------------------
CASE_CONFIGS = {
    "DPOConfig": [*DPO_CASES.values(), *(config for config, _ in DPO_PRECISION_CASES.values())],
    "GRPOConfig": GRPO_CASES,
}


@pytest.mark.parametrize(("config_cls", "table"), [("DPOConfig", fields.DPO), ("GRPOConfig", fields.GRPO)])
def test_every_trl_config_field_is_classified(config_cls, table):
    """A field TRL (or transformers) adds fails here until tests/_trl_fields.py says what the
    loss does with it; one it removes, until its entry goes."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(getattr(trl, config_cls))}
    assert not names - table.keys(), f"{config_cls}: unclassified fields {sorted(names - table.keys())}"
    assert not table.keys() - names, f"{config_cls}: gone from TRL {sorted(table.keys() - names)}"


@pytest.mark.parametrize(
    ("config_cls", "table", "refused"), [("DPOConfig", fields.DPO, fields.DPO_REFUSED), ("GRPOConfig", fields.GRPO, fields.GRPO_REFUSED)]
)
def test_each_classified_field_has_its_test(config_cls, table, refused):
    """Honoured and inert fields: a comparison case with TRL's trainer sets each; refused ones: a
    config in the refusal test raises naming each."""
    compared = {key for config in CASE_CONFIGS[config_cls] for key in config}
    untested = {name for name, kind in table.items() if kind in ("b", "inert")} - compared
    assert not untested, f"{config_cls}: no comparison case sets {sorted(untested)}"
    unrefused = {name for name, kind in table.items() if kind == "c"} - {option for option, _ in refused}
    assert not unrefused, f"{config_cls}: no refusal test for {sorted(unrefused)}"
