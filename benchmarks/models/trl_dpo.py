"""TRL ``DPOTrainer`` on a Llama-1B-shaped model: polykernel's fused DPO loss vs Liger vs plain TRL.

Issue 22's real-client row: random weights (hidden 2048, 16 layers, 32/8 heads, vocab 128256,
tied embeddings), bf16, a synthetic preference set (prompt and completions of random words from
an in-memory word-level tokenizer: nothing downloaded), a reference model (a copy), N optimizer
steps. Each variant in its own subprocess (fresh allocator):

- ``plain``: ``trl.DPOTrainer`` as it comes. In TRL 1.16 this already scores the tokens through
  TRL's own chunked LM head (``add_fused_lm_head``): no ``[tokens, vocab]`` logits either.
- ``liger``: ``DPOTrainer`` with ``use_liger_kernel=True``. TRL 1.16 applies Liger's layer kernels
  (RMSNorm, SwiGLU, RoPE) only; the loss stays TRL's chunked head (it no longer calls Liger's
  fused DPO loss).
- ``polykernel``: ``PolykernelDPOTrainer`` (``polykernel.fused_linear_dpo_loss`` for the policy
  and the reference, the model's layers as they are).
- ``polykernel+patch``: the same plus ``polykernel.integrations.transformers.patch`` (our RMSNorm,
  SwiGLU, RoPE: the counterpart of ``liger``).

Per variant: tokens/s (the batch's real tokens over the median step time of steps 2..N), peak
memory (CUDA's max allocated: the whole run's, the steps after the first apart, each step's), the
per-step losses and DPO metrics from TRL's log, errors.

    PYTHONPATH=src python benchmarks/models/trl_dpo.py --json trl_dpo.json             # H200, ~N=10 steps
    PYTHONPATH=src python benchmarks/models/trl_dpo.py --json /tmp/trl_dpo.json --tiny  # CPU smoke run, seconds

``--only`` picks variants (comma-separated), ``--steps``, ``--batch`` (pairs per step),
``--seq`` (tokens per sequence), ``--layers`` change the run; ``--gradient-checkpointing`` turns
on TRL's activation checkpointing (off by default here).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _child import parse, run_all
from _common import (
    add_llama_args,
    add_memory_trace_arg,
    at_peak_text,
    llama_config,
    memory_trace,
    peak_fields,
    peak_text,
    step_timer,
    tiny_llama,
    versions,
)

from polykernel.tools.rows import RowFile

VARIANTS = ("plain", "liger", "polykernel", "polykernel+patch")
_SHAPE = ("steps", "batch", "seq", "layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "seed")  # passed to each child
WORDS = 4096  # the tokenizer's vocabulary (ids below the model's 128256)


def _tokenizer() -> Any:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(WORDS - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def _dataset(n: int, seq: int, seed: int) -> Any:
    """Pairs whose prompt + completion + EOS is exactly ``seq`` tokens: half prompt, half completion."""
    import datasets

    rng = random.Random(seed)
    prompt_len = seq // 2
    completion_len = seq - prompt_len - 1

    def text(k: int) -> str:
        return " ".join(f"w{rng.randrange(WORDS - 3)}" for _ in range(k))

    rows = [{"prompt": text(prompt_len), "chosen": " " + text(completion_len), "rejected": " " + text(completion_len)} for _ in range(n)]
    return datasets.Dataset.from_list(rows)


def _model(args: argparse.Namespace, device: Any, dtype: Any) -> Any:
    import torch
    import transformers

    cfg = llama_config(args, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(args.seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg).to(dtype)


def child(args: argparse.Namespace) -> dict[str, Any]:
    import copy

    import torch
    import trl

    variant = args.child
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = _model(args, device, dtype)
    ref = copy.deepcopy(model).eval()
    if variant == "polykernel+patch":
        from polykernel.integrations.transformers import patch

        for m in (model, ref):  # the loss is the DPO trainer's: no causal-LM loss switches
            patch(m, cross_entropy=False, fused_linear_cross_entropy=False)
    step_times: list[float] = []
    peaks: list[float] = []  # each step's CUDA peak: the first step's first-call checks apart
    config = trl.DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_dpo_"),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        max_length=None,
        learning_rate=1e-6,
        beta=0.1,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=args.gradient_checkpointing,
        use_liger_kernel=variant == "liger",
        dataloader_num_workers=0,
        seed=args.seed,
    )
    kwargs = dict(model=model, ref_model=ref, args=config, train_dataset=_dataset(args.batch * args.steps, args.seq, args.seed),
                  processing_class=_tokenizer(), callbacks=[step_timer(cuda, step_times, peaks)])  # fmt: skip
    if variant.startswith("polykernel"):
        from polykernel.integrations.trl import PolykernelDPOTrainer

        trainer = PolykernelDPOTrainer(**kwargs)
    else:
        trainer = trl.DPOTrainer(**kwargs)
    tokens = int(next(iter(trainer.get_train_dataloader()))["attention_mask"].sum())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with memory_trace(cuda and args.memory_trace) as at_peak:
        trainer.train()
    steady = step_times[1:] or step_times
    logs = [log for log in trainer.state.log_history if "loss" in log]
    keep = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
    return {
        "variant": variant,
        "tokens_per_step": tokens,
        "step_s_median": statistics.median(steady),
        "tokens_per_s": tokens / statistics.median(steady),
        **peak_fields(peaks),
        **({"at_peak": at_peak} if at_peak else {}),
        "step_s": step_times,
        "steps": [{k: log.get(k) for k in keep} for log in logs],
    }


def env() -> dict[str, Any]:
    """The record's environment: Python, torch, the trainer's packages (None: missing), the GPU."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "argv": sys.argv[1:]}
    out |= versions("transformers", "trl", "accelerate", "liger-kernel")
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
    return out


def _tiny(args: argparse.Namespace) -> None:
    if args.tiny:
        tiny_llama(args, vocab=4096)
        args.seq, args.batch, args.steps = 32, 2, min(args.steps, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="preference pairs per step (2x sequences)")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    add_llama_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model (smoke run)")
    add_memory_trace_arg(parser)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per variant")
    args = parse(parser, child, required="--json PATH", prepare=_tiny)
    if args is None:
        return
    argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in _SHAPE]
    argv += ["--gradient-checkpointing"] * args.gradient_checkpointing + ["--tiny"] * args.tiny + ["--memory-trace"] * args.memory_trace

    def summary(record: dict[str, Any]) -> str:
        losses = " ".join(f"{s['loss']:.4f}" for s in record["steps"])
        return f"{record['tokens_per_s']:10.0f} tok/s  peak {peak_text(record):>24}  losses {losses}" + at_peak_text(record)

    out = RowFile(args.json, {"env": env()})  # each variant's record kept as it ends
    run_all(__file__, args.only.split(","), argv, args.timeout, summary, width=18, out=out, per_variant_s=20 if args.tiny else 120)
    out.finish()


if __name__ == "__main__":
    main()
