"""TRL ``GRPOTrainer`` on a Llama-1B-shaped model: polykernel's fused GRPO loss vs Liger vs plain TRL.

The GRPO half of issue 22's real-client row, beside ``trl_dpo.py`` (same model, tokenizer and
variants: ``plain``, ``liger`` = ``use_liger_kernel=True``, ``polykernel``, ``polykernel+patch``).
Generation is TRL's own (``transformers.generate``, no vLLM) with a reward function in Python
(a hash of the completion's text: varied rewards), so it runs offline. It is timed apart: it is the
same in every variant and would hide the loss's share of the step. Per variant: the step time,
the generation time, their difference (the training part: forwards, loss, backward, optimizer),
the completion tokens per second of that part, CUDA peak memory (the whole run's, the steps after
the first apart, each step's), per-step losses and metrics.

    PYTHONPATH=src python benchmarks/models/trl_grpo.py --json trl_grpo.json              # H200
    PYTHONPATH=src python benchmarks/models/trl_grpo.py --json /tmp/trl_grpo.json --tiny  # CPU smoke run

``--loss-type`` (default ``dapo``, TRL's), ``--beta`` (default 0.04: a reference model, so
``use_bias_correction_kl=False``), ``--prompts``/``--generations`` (per step), ``--prompt-len``,
``--completion-len``, ``--steps``, ``--layers``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from _child import parse, run_all
from _common import add_llama_args, add_memory_trace_arg, at_peak_text, memory_trace, peak_fields, peak_text, step_timer, tiny_llama
from trl_dpo import VARIANTS, WORDS, _model, _tokenizer, env

from polykernel.tools.rows import RowFile

_PASSED = ("steps", "prompts", "generations", "prompt_len", "completion_len", "layers", "hidden", "intermediate", "heads",
           "kv_heads", "vocab", "seed", "loss_type", "beta")  # fmt: skip


def child(args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    import torch
    import trl

    variant = args.child
    cuda = torch.cuda.is_available() and not args.tiny
    dtype = torch.bfloat16 if cuda else torch.float32
    path = Path(tempfile.mkdtemp(prefix="trl_grpo_")) / "model"  # GRPO builds its reference from a path
    # the trainer loads the policy and the reference from it; the weights are drawn on the GPU
    # (a 1.2B model's init took 30 s on a 2-core CPU) and freed before the peak memory is reset
    model = _model(args, "cuda" if cuda else "cpu", dtype)
    model.save_pretrained(path)
    del model
    if cuda:
        torch.cuda.empty_cache()
    tokenizer = _tokenizer()
    rng = random.Random(args.seed)
    prompts = [
        {"prompt": " ".join(f"w{rng.randrange(WORDS - 3)}" for _ in range(args.prompt_len))} for _ in range(args.prompts * args.steps)
    ]

    def reward_crc(completions: list[str], **kwargs: Any) -> list[float]:
        # a random model rarely ends early or repeats itself: length or diversity would give equal
        # rewards, so zero advantages and a zero loss; a hash of the text varies (nothing to learn)
        return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]

    step_times: list[float] = []
    peaks: list[float] = []  # each step's CUDA peak: the first step's first-call checks apart
    gen_times: list[float] = []
    config = trl.GRPOConfig(
        output_dir=str(path.parent),
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=args.completion_len,
        max_steps=args.steps,
        learning_rate=1e-6,
        loss_type=args.loss_type,
        beta=args.beta,
        use_bias_correction_kl=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=cuda,
        use_cpu=not cuda,
        use_liger_kernel=variant == "liger",
        model_init_kwargs={"dtype": dtype},
        seed=args.seed,
    )
    kwargs = dict(model=str(path), reward_funcs=reward_crc, args=config, train_dataset=datasets.Dataset.from_list(prompts),
                  processing_class=tokenizer, callbacks=[step_timer(cuda, step_times, peaks)])  # fmt: skip
    if variant.startswith("polykernel"):
        from polykernel.integrations.trl import PolykernelGRPOTrainer

        trainer = PolykernelGRPOTrainer(**kwargs)
        if variant == "polykernel+patch":  # our norms, MLPs and RoPE too (the loss is the trainer's)
            from polykernel.integrations.transformers import patch

            for m in (trainer.model, trainer.ref_model):
                if m is not None:
                    patch(trainer.accelerator.unwrap_model(m), cross_entropy=False, fused_linear_cross_entropy=False)
    else:
        trainer = trl.GRPOTrainer(**kwargs)
    generate = trainer._generate_and_score_completions
    completion_tokens: list[int] = []

    def timed_generate(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = generate(*a, **k)
        if cuda:
            torch.cuda.synchronize()
        gen_times.append(time.perf_counter() - t0)
        completion_tokens.append(int(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = timed_generate
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with memory_trace(cuda and args.memory_trace) as at_peak:
        trainer.train()
    train_s = [s - g for s, g in zip(step_times, gen_times)]
    steady = train_s[1:] or train_s
    logs = [log for log in trainer.state.log_history if "loss" in log]
    keep = ("loss", "reward", "kl", "clip_ratio/region_mean", "completions/mean_length")
    return {
        "variant": variant,
        "step_s": step_times,
        "generate_s": gen_times,
        "train_s": train_s,
        "train_s_median": statistics.median(steady),
        "completion_tokens_per_train_s": statistics.median(completion_tokens) / statistics.median(steady),
        **peak_fields(peaks),
        **({"at_peak": at_peak} if at_peak else {}),
        "steps": [{k: log.get(k) for k in keep} for log in logs],
    }


def _sizes(args: argparse.Namespace) -> None:
    args.seq = args.prompt_len + args.completion_len  # for _model's position table
    if args.tiny:
        tiny_llama(args, vocab=4096)
        args.prompt_len, args.completion_len, args.steps = 8, 8, min(args.steps, 2)
        args.seq = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=768)
    add_llama_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model (smoke run)")
    add_memory_trace_arg(parser)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per variant")
    args = parse(parser, child, required="--json PATH", prepare=_sizes)
    if args is None:
        return
    argv = (
        [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in _PASSED] + ["--tiny"] * args.tiny + ["--memory-trace"] * args.memory_trace
    )

    def summary(record: dict[str, Any]) -> str:
        losses = " ".join(f"{s['loss']:.4g}" for s in record["steps"])
        return f"train {record['train_s_median']:.3f} s/step  peak {peak_text(record):>24}  losses {losses}" + at_peak_text(record)

    out = RowFile(args.json, {"env": env()})  # each variant's record kept as it ends
    run_all(__file__, args.only.split(","), argv, args.timeout, summary, width=18, out=out, per_variant_s=20 if args.tiny else 180)
    out.finish()


if __name__ == "__main__":
    main()
