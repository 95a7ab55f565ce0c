"""What the model benchmarks share: the Llama-3-style model config and its command-line sizes, the
tiny CPU sizes, a step timer for ``transformers.Trainer`` runs and the packages' versions for the
records (scripts in this folder import it by name)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

# A Llama-3.2-1B-shaped model: the scripts' default sizes
LLAMA_1B = dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256)


def add_llama_args(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """``--layers --hidden --intermediate --heads --kv-heads --vocab``, :data:`LLAMA_1B`'s sizes
    unless ``defaults`` says otherwise."""
    sizes = LLAMA_1B | defaults
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=sizes[name])


def tiny_llama(args: argparse.Namespace, vocab: int) -> None:
    """The CPU smoke runs' model: 2 layers, hidden 64, intermediate 128, 4/2 heads, ``vocab``."""
    args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab = 2, 64, 128, 4, 2, vocab


def llama_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """``transformers.LlamaConfig`` of ``args``' sizes (``vocab``, ``heads``, ``kv_heads`` and ``seq``
    where ``args`` has them, else 128256, 32, 8 and 2048 positions): tied embeddings, RoPE theta
    500000, SDPA attention; ``overrides`` replace or add fields."""
    import transformers

    fields = dict(
        vocab_size=getattr(args, "vocab", 128256),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=getattr(args, "heads", 32),
        num_key_value_heads=getattr(args, "kv_heads", 8),
        max_position_embeddings=max(getattr(args, "seq", 0), 2048),
        tie_word_embeddings=True,
        rope_theta=500000.0,
    )
    cfg = transformers.LlamaConfig(**(fields | overrides))
    cfg._attn_implementation = "sdpa"
    return cfg


def timed_steps(step: Callable[[], Any], steps: int, sync: Callable[[], None]) -> tuple[list[float], list[float], float]:
    """Run ``step()`` (it returns the loss) ``steps`` times, each timed to ``sync()``: the step
    times, the losses, and the median of steps 4..N (the last step's time if there are fewer:
    the first steps compile, tune and warm the allocator)."""
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    steady = times[3:] if len(times) > 3 else times[-1:]
    return times, losses, statistics.median(steady)


def step_timer(cuda: bool, times: list[float]) -> Any:
    """A ``transformers.TrainerCallback`` that appends each optimizer step's wall time to ``times``
    (synchronizing the GPU at both ends when ``cuda``)."""
    import torch
    import transformers

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    return Timer()


def versions(*names: str) -> dict[str, str | None]:
    """Each installed distribution's version, None where it is missing (a record, not a crash)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


# -- the tensor-parallel scripts (tp_block.py, tp_vocab_loss.py) ---------------------------------------
def add_tp_args(parser: argparse.ArgumentParser) -> None:
    """``--batch --seq --steps --warmup`` (defaults by :func:`tp_defaults`) and ``--smoke``."""
    for name in ("batch", "seq", "steps", "warmup"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny model, Triton through its interpreter")


def tp_defaults(args: argparse.Namespace) -> None:
    """The sizes not given: tiny for ``--smoke`` (which also runs Triton through its interpreter)."""
    defaults = dict(batch=2, seq=32, steps=2, warmup=1) if args.smoke else dict(batch=8, seq=2048, steps=10, warmup=3)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"


def tp_model(config: dict[str, Any], max_positions: int, args: argparse.Namespace, device: str) -> tuple[Any, Any, Any]:
    """A seeded ``LlamaForCausalLM`` of ``config``'s fields (pad id 0; fp32 for ``--smoke``, else
    bf16), a seeded ``[batch, seq]`` batch of token ids for it, and the dtype."""
    import torch
    import transformers

    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = transformers.LlamaConfig(max_position_embeddings=max_positions, pad_token_id=0, **config)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
    return model, ids, dtype


def tp_steps(
    model: Any,
    ids: Any,
    steps: int,
    warmup: int,
    device: str,
    barrier: Callable[[], None] | None = None,
    seen: Callable[[Any], None] | None = None,
) -> tuple[list[float], list[float]]:
    """``warmup + steps`` AdamW steps of the causal-LM loss on ``ids``: the times of the steps
    after the warmup (each from a synchronized start, after ``barrier()`` if given) and every
    step's loss; ``seen(output)`` sees each step's model output."""
    import torch

    # foreach=False: the parallelized model mixes DTensor and plain parameters, which torch's
    # foreach kernels refuse ("got mixed torch.Tensor and DTensor"; seen on 2xH200, torch 2.11).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    model.train()
    times, losses = [], []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        sync()
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(out.loss.detach()))
        if seen is not None:
            seen(out)
        del out
    return times, losses


def tp_header(device: str, world: int, config: dict[str, Any], dtype: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The record's first fields: the machine, the world size, the model, the run's sizes."""
    import torch

    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "world": world,
        "config": config,
        "dtype": str(dtype),
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch": torch.__version__,
    }
