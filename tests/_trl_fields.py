"""Every field of TRL 1.16's ``DPOConfig`` and ``GRPOConfig`` (TrainingArguments' included), by what
polykernel's TRL trainers do with it. ``tests/integrations/test_trl.py`` fails when TRL (or
transformers) grows a field that is not here, so that an upgrade forces a decision.

The trainers replace only TRL's ``_compute_loss``; a field can change the loss or its gradients
differently from TRL's trainer only where that method (or the fused LM head it calls) reads it.

- ``"a"``: no effect on the loss or its gradients, or an effect through code TRL's trainer and
  ours share: the batch (collation, truncation, generation, rewards, advantages), the model's
  weights and modules (dropout, kernels, checkpointing, the reference model's sync), the training
  step (gradient accumulation's scaling outside ``_compute_loss``), logging, saving, the optimiser.
- ``"inert"``: read by TRL's loss only for an option polykernel refuses (a loss type, an
  f-divergence, vLLM's correction, the adaptive entropy bonus): a comparison case sets it and gets
  TRL's loss, so a TRL that starts reading it elsewhere fails there.
- ``"b"``: read by TRL's loss and computed by ours: a comparison case with TRL sets it.
- ``"c"``: refused (``UnsupportedTRLConfig`` naming it, when the trainer is built): ``REFUSED``
  gives a value that raises. A ``"b"`` field may have refused values too (``loss_type``).
"""

# TrainingArguments' fields that act outside ``_compute_loss``, for both trainers
_SHARED = """
    output_dir per_device_train_batch_size num_train_epochs max_steps learning_rate lr_scheduler_type
    lr_scheduler_kwargs warmup_steps optim optim_args weight_decay adam_beta1 adam_beta2 adam_epsilon
    optim_target_modules average_tokens_across_devices max_grad_norm bf16_full_eval fp16_full_eval tf32
    activation_checkpointing activation_checkpointing_kwargs gradient_checkpointing gradient_checkpointing_kwargs
    torch_compile torch_compile_backend torch_compile_mode use_liger_kernel liger_kernel_config use_cache
    neftune_noise_alpha torch_empty_cache_steps auto_find_batch_size logging_strategy logging_steps
    logging_first_step log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen log_level
    log_level_replica disable_tqdm report_to run_name project trackio_space_id trackio_bucket_id
    trackio_static_space_id eval_strategy eval_steps eval_delay per_device_eval_batch_size prediction_loss_only
    eval_on_start eval_do_concat_batches eval_use_gather_object eval_accumulation_steps include_for_metrics
    batch_eval_metrics save_only_model save_strategy save_steps save_on_each_node save_total_limit
    enable_jit_checkpoint push_to_hub hub_token hub_private_repo hub_model_id hub_strategy hub_always_push
    hub_revision load_best_model_at_end metric_for_best_model greater_is_better ignore_data_skip
    restore_callback_states_from_checkpoint full_determinism seed data_seed use_cpu accelerator_config
    parallelism_config dataloader_drop_last dataloader_num_workers dataloader_pin_memory
    dataloader_persistent_workers dataloader_prefetch_factor dataloader_multiprocessing_context
    dataloader_in_order remove_unused_columns label_names train_sampling_strategy length_column_name
    ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph ddp_backend ddp_timeout
    fsdp fsdp_config debug skip_memory_metrics do_train do_eval do_predict resume_from_checkpoint local_rank
    model_init_kwargs trust_remote_code disable_dropout pad_to_multiple_of sync_ref_model ref_model_mixup_alpha
    ref_model_sync_steps
"""
# label_smoothing_factor: Trainer's label smoother runs in Trainer.compute_loss, which both TRL trainers override
# fsdp: FSDP2's sharded head is gathered (DTensor.full_tensor) as TRL's head does; needs several processes
_COMMON = {name: "a" for name in _SHARED.split()} | {
    "label_smoothing_factor": "a",
    "bf16": "b",  # the head projects in the autocast dtype, as TRL's does
    "fp16": "b",
    "deepspeed": "c",  # ZeRO-3: TRL gathers the partitioned head, ours reads lm_head.weight directly
}

DPO = _COMMON | {
    **dict.fromkeys("dataset_num_proc max_length truncation_mode padding_free pad_token".split(), "a"),  # the batch
    "precompute_ref_batch_size": "a",  # batches the precompute only
    "activation_offloading": "a",  # TRL's training_step context
    "gradient_accumulation_steps": "a",  # Trainer.training_step scales DPO's loss
    **dict.fromkeys("label_smoothing discopop_tau f_alpha_divergence_coef".split(), "inert"),
    **dict.fromkeys("beta loss_type loss_weights precompute_ref_log_probs router_aux_loss_coef".split(), "b"),
    **dict.fromkeys("ld_alpha f_divergence_type use_weighting".split(), "c"),
}

GRPO = _COMMON | {
    # generation, rewards and advantages: the batch TRL builds
    **dict.fromkeys(
        """num_generations num_generations_eval ds3_gather_for_generation shuffle_dataset top_p top_k min_p
        generation_kwargs chat_template_kwargs repetition_penalty cache_implementation use_vllm vllm_mode
        vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url vllm_server_host
        vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length
        vllm_tensor_parallel_size reward_weights multi_objective_aggregation scale_rewards
        mask_truncated_completions max_tool_calling_iterations use_transformers_continuous_batching
        transformers_continuous_batching_config use_transformers_paged""".split(),
        "a",
    ),
    **dict.fromkeys("log_completions log_multimodal num_completions_to_print log_unique_prompts log_completions_hub_repo".split(), "a"),
    # read by the refused sapo/vespo losses, vLLM's correction, the adaptive entropy bonus
    **dict.fromkeys(
        """sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg
        vllm_importance_sampling_mode vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min
        vllm_importance_sampling_cap entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target""".split(),
        "inert",
    ),
    # num_iterations: old_per_token_logps in the batch; steps_per_generation (generation_batch_size): dapo's normaliser
    **dict.fromkeys(
        """beta epsilon epsilon_high temperature loss_type importance_sampling_level use_bias_correction_kl
        max_completion_length cast_lm_head_to_fp32 steps_per_generation generation_batch_size num_iterations
        gradient_accumulation_steps router_aux_loss_coef""".split(),
        "b",
    ),
    **dict.fromkeys(
        "delta top_entropy_quantile entropy_coef use_adaptive_entropy off_policy_mask_threshold vllm_importance_sampling_correction".split(),
        "c",
    ),
}

# (option, config) that raises naming option, for each refused field and each refused value of a "b" field. ZeRO-3
# needs DeepSpeed installed to be configured: the test fakes is_deepspeed_zero3_enabled instead.
DPO_REFUSED = [
    *(
        ("loss_type", dict(loss_type=[t]))
        for t in "hinge ipo nca_pair robust bco_pair sppo_hard aot aot_unpaired apo_zero apo_down discopop sft sigmoid_norm".split()
    ),
    ("loss_type", dict(loss_type=["exo_pair"], label_smoothing=1e-3)),
    ("loss_type", dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])),
    ("loss_type", dict(loss_type=["sft", "sigmoid"])),
    ("f_divergence_type", dict(f_divergence_type="js_divergence")),
    ("f_divergence_type", dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5)),
    ("ld_alpha", dict(ld_alpha=0.5)),
    ("use_weighting", dict(use_weighting=True)),
    ("deepspeed", {}),
]
GRPO_REFUSED = [
    *(("loss_type", dict(loss_type=t)) for t in ("cispo", "sapo", "vespo")),
    ("loss_type", dict(loss_type="luspo", importance_sampling_level="sequence")),
    ("delta", dict(delta=1.5)),
    ("top_entropy_quantile", dict(top_entropy_quantile=0.5)),
    ("entropy_coef", dict(entropy_coef=0.01)),
    ("use_adaptive_entropy", dict(use_adaptive_entropy=True)),
    ("off_policy_mask_threshold", dict(off_policy_mask_threshold=0.5)),
    ("vllm_importance_sampling_correction", dict(use_vllm=True, vllm_importance_sampling_correction=True)),
    ("deepspeed", {}),
]
