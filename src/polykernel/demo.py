"""``polykernel demo``: what runs on this machine, then the same small LM trained with and without
polykernel, side by side.

1. The platform, and every op with each impl's verdict here (``polykernel.explain``).
2. A Llama-style model (:mod:`polykernel.models.llama`) trained for ``--steps`` steps on a
   synthetic but learnable token stream (a fixed random Markov chain: the loss falls from
   ``ln(vocab)`` towards the chain's entropy), twice from the same seed and initial weights: once
   through polykernel (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy), once in plain PyTorch.
3. The losses per step side by side (they agree within the dtype's noise), tokens/s, peak memory,
   and which impl each op used and why.

Nothing is downloaded. ``--size tiny`` (the CPU default) takes well under a minute on two cores;
``--size medium`` (the default on a GPU with 60 GiB or more) is a ~1.4B-parameter model with a
128K vocabulary in bf16, where not materializing the logits saves gigabytes.

    $ polykernel demo                       # or: python -m polykernel.demo
    $ polykernel demo --size medium --steps 50 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform as _platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

__all__ = ["SETUPS", "DemoResult", "DemoSetup", "RunResult", "main", "markov_stream", "run_demo"]


# ------------------------------------------------------------------------------------------------
# Setups


@dataclass(frozen=True)
class DemoSetup:
    """One size: the model preset and the training run."""

    preset: str
    batch: int
    seq_len: int
    lr: float
    states: int  # tokens the Markov chain visits (a subset of the vocabulary)
    successors: int = 4  # possible next tokens per state
    warmup: int = 5


SETUPS: dict[str, DemoSetup] = {
    "tiny": DemoSetup("tiny", batch=8, seq_len=128, lr=3e-3, states=128),
    "small": DemoSetup("small", batch=8, seq_len=512, lr=1e-3, states=512),
    "medium": DemoSetup("medium", batch=4, seq_len=2048, lr=6e-4, states=1024),
}

# Accepted |loss(polykernel) - loss(torch)| per step: atol + rtol * |loss(torch)|. The two paths
# round differently (fused kernels vs eager chains) and the difference compounds over optimizer
# steps. fp32: ulp-level differences amplified by Adam over a few dozen steps stay far below 1e-3.
# bf16/fp16: every activation carries a 2^-8 (2^-11) relative rounding that may land either way.
LOSS_TOL = {
    torch.float32: (2e-3, 0.0),
    torch.float64: (1e-6, 0.0),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (1e-2, 5e-3),
}


# ------------------------------------------------------------------------------------------------
# Data


def markov_stream(vocab: int, n_seqs: int, seq_len: int, *, states: int, successors: int = 4, seed: int = 0) -> tuple[torch.Tensor, float]:
    """``n_seqs`` sequences of ``seq_len + 1`` tokens from a fixed random Markov chain.

    The chain visits ``states`` tokens (a random subset of the vocabulary), each followed by one of
    ``successors`` tokens with fixed random probabilities. Returns the int64 tokens ``[n_seqs,
    seq_len + 1]`` (CPU) and the chain's conditional entropy on this sample in nats: the lowest
    loss any model can reach. Deterministic in ``seed`` on every machine.
    """
    g = torch.Generator().manual_seed(seed)
    states = min(states, vocab)
    ids = torch.randperm(vocab, generator=g)[:states]
    succ = torch.randint(0, states, (states, successors), generator=g)
    probs = torch.rand(states, successors, generator=g, dtype=torch.float64) + 0.25
    probs /= probs.sum(-1, keepdim=True)
    cum = probs.cumsum(-1)
    cum[:, -1] = 1.0 + 1e-9
    state = torch.randint(0, states, (n_seqs,), generator=g)
    out = torch.empty(n_seqs, seq_len + 1, dtype=torch.int64)
    nll = torch.zeros((), dtype=torch.float64)
    for t in range(seq_len + 1):
        out[:, t] = ids[state]
        choice = torch.searchsorted(cum[state], torch.rand(n_seqs, 1, generator=g, dtype=torch.float64)).squeeze(1)
        if t < seq_len:
            nll -= probs[state, choice].log().sum()
        state = succ[state, choice]
    return out, float(nll) / max(1, n_seqs * seq_len)


# ------------------------------------------------------------------------------------------------
# Measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Memory:
    """Peak memory of a run: CUDA allocator peak, or the process's peak RSS growth on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = ""
        self._base = 0

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.kind = "CUDA peak allocated (torch.cuda.max_memory_allocated), weights, gradients and optimizer state included"
            return
        _malloc_trim()
        if _reset_hwm():
            self.kind = "peak RSS growth over the run, weights excluded (VmHWM after resetting it via /proc/self/clear_refs)"
            self._base = _proc_status("VmRSS")
        else:
            import resource

            self.kind = "ru_maxrss growth (order-dependent: the second run only shows what exceeds the first)"
            self._base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if "VmHWM" in self.kind:
            return max(0, _proc_status("VmHWM") - self._base)
        import resource

        return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self._base)


def _malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so the next run's RSS peak starts clean."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status("VmHWM") > 0
    except OSError:
        return False


def _proc_status(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _Progress:
    """A one-line text progress bar on a terminal; a single summary line otherwise."""

    def __init__(self, label: str, total: int, stream: TextIO, width: int = 30) -> None:
        self.label, self.total, self.stream, self.width = label, total, stream, width
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()

    def update(self, done: int, loss: float) -> None:
        if not self.tty:
            return
        filled = int(self.width * done / max(1, self.total))
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r  {self.label:<10} [{bar}] {done:>4}/{self.total}  loss {loss:7.4f}  {time.perf_counter() - self.t0:6.1f} s")
        self.stream.flush()

    def close(self, loss: float) -> None:
        line = f"  {self.label:<10} {self.total} steps in {time.perf_counter() - self.t0:.1f} s, final loss {loss:.4f}"
        if self.tty:
            self.stream.write("\r" + line + " " * 30 + "\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


# ------------------------------------------------------------------------------------------------
# Training


@dataclass
class RunResult:
    """One training run: per-step losses and times, peak memory, and the impls polykernel used."""

    label: str
    losses: list[float]
    step_seconds: list[float]
    tokens_per_step: int
    peak_bytes: int
    memory_kind: str
    impls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        """Steady-state throughput: the first step (optimizer state allocation) is left out."""
        times = self.step_seconds[1:] if len(self.step_seconds) > 2 else self.step_seconds
        return self.tokens_per_step * len(times) / max(sum(times), 1e-9)


def train(
    model: torch.nn.Module,
    batches: torch.Tensor,
    *,
    steps: int,
    lr: float,
    warmup: int,
    device: torch.device,
    label: str,
    memory: _Memory,
    progress: _Progress | None = None,
) -> RunResult:
    """AdamW with linear warmup and grad-norm clipping; one batch per step, cycling ``batches``
    (``[n, B, T + 1]`` token ids: inputs ``[:, :-1]``, next-token targets ``[:, 1:]``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    losses, times = [], []
    model.train()
    for step in range(steps):
        batch = batches[step % len(batches)].to(device, non_blocking=True)
        _sync(device)
        t0 = time.perf_counter()
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # synchronizes
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(value)
        if progress is not None:
            progress.update(step + 1, value)
    if progress is not None:
        progress.close(losses[-1] if losses else float("nan"))
    b, t1 = batches.shape[1], batches.shape[2]
    return RunResult(label, losses, times, b * (t1 - 1), memory.peak(), memory.kind)


# ------------------------------------------------------------------------------------------------
# What the dispatcher knows and did


def op_table(device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Every op: each impl's verdict for ``device``/``dtype`` and the auto choice (``explain``)."""
    import polykernel

    rows = []
    for op_id in polykernel.list_ops():
        try:
            e = polykernel.explain(op_id, device=device, dtype=dtype).as_dict()
        except ImportError as exc:
            rows.append({"op": op_id, "chosen": None, "source": None, "impls": [], "missing": f"not in this build ({exc.name or exc})"})
            continue
        except Exception as exc:
            rows.append({"op": op_id, "chosen": None, "source": None, "impls": [], "missing": f"{type(exc).__name__}: {exc}"})
            continue
        rows.append({"op": op_id, "chosen": e["chosen"], "source": e["source"], "impls": e["impls"], "missing": e["error"]})
    return rows


_SOURCES = {
    "argument": "impl= argument",
    "scope": "polykernel.use_impl scope",
    "env": "environment (POLYKERNEL_IMPL*)",
    "global": "polykernel.set_impl",
    "tuned": "measured (tuning cache)",
    "auto": "auto: best-ranked impl that can run",
    "fallback": "fallback after a runtime fault",
}


def used_impls() -> list[dict[str, Any]]:
    """The decisions the dispatcher made since the last ``clear_caches()``: per op, the impl that
    ran, the source of the choice and why better-ranked impls did not run.

    Read from the dispatcher's decision memo, i.e. exactly what the training run called.
    """
    import polykernel

    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    for d in polykernel.decisions():
        grad = bool(d["arg_class"].get("needs_grad"))
        row = seen.get((d["op"], d["impl"], d["source"]))
        if row is None:
            row = {
                "op": d["op"],
                "impl": d["impl"],
                "source": d["source"],
                "why": _SOURCES.get(d["source"], d["source"]),
                "skipped": [f"{name}: {reason}" for name, reason in d["skipped"]],
                "forward_only": not grad,
            }
            seen[(d["op"], d["impl"], d["source"])] = row
        row["forward_only"] = row["forward_only"] and not grad
    return list(seen.values())


# ------------------------------------------------------------------------------------------------
# The demo


@dataclass
class DemoResult:
    setup: DemoSetup
    config: Any
    device: str
    dtype: str
    floor: float
    runs: list[RunResult]
    max_abs_diff: float
    atol: float
    rtol: float

    @property
    def agree(self) -> bool:
        """Every step's losses within ``atol + rtol * |loss(torch)|`` (NaN never agrees)."""
        pk, pt = self.runs
        return len(pk.losses) == len(pt.losses) and all(abs(a - b) <= self.atol + self.rtol * abs(b) for a, b in zip(pk.losses, pt.losses))

    @property
    def tolerance_text(self) -> str:
        return f"{self.atol:g}" + (f" + {self.rtol:g} x loss" if self.rtol else "")

    @property
    def learned(self) -> bool:
        """Both runs' loss fell clearly: the mean of the last quarter is below the first loss by 10%."""
        for r in self.runs:
            tail = r.losses[-max(1, len(r.losses) // 4) :]
            if not (sum(tail) / len(tail) < 0.9 * r.losses[0]):
                return False
        return True

    def as_dict(self) -> dict[str, Any]:
        return {
            "setup": dataclasses.asdict(self.setup),
            "config": dataclasses.asdict(self.config),
            "device": self.device,
            "dtype": self.dtype,
            "entropy_floor": self.floor,
            "max_abs_loss_diff": self.max_abs_diff,
            "tolerance": {"atol": self.atol, "rtol": self.rtol},
            "agree": self.agree,
            "learned": self.learned,
            "runs": [
                {
                    "label": r.label,
                    "losses": r.losses,
                    "step_seconds": r.step_seconds,
                    "tokens_per_second": r.tokens_per_second,
                    "peak_bytes": r.peak_bytes,
                    "memory_kind": r.memory_kind,
                    "impls": r.impls,
                }
                for r in self.runs
            ],
        }


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("polykernel demo: --device cuda but CUDA is not available here")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise SystemExit(f"polykernel demo: unknown --dtype {name!r}; use auto, float32, bfloat16 or float16") from None


def resolve_size(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= 60 * 2**30:
        return "medium"
    return "small" if device.type == "cuda" else "tiny"


def run_demo(
    *,
    steps: int = 30,
    size: str = "tiny",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    batch: int | None = None,
    seq_len: int | None = None,
    lr: float | None = None,
    fused_loss: bool = True,
    config_overrides: dict[str, Any] | None = None,
    out: TextIO | None = None,
    progress: bool = True,
) -> DemoResult:
    """Train the model twice (polykernel, then plain PyTorch) and return both runs."""
    import polykernel
    from polykernel.models import LlamaConfig, LlamaForCausalLM

    device = torch.device(device)
    out = out if out is not None else sys.stdout
    setup = SETUPS[size]
    setup = dataclasses.replace(setup, batch=batch or setup.batch, seq_len=seq_len or setup.seq_len, lr=lr or setup.lr)
    cfg = LlamaConfig.preset(setup.preset, **(config_overrides or {}))
    if setup.seq_len > cfg.max_seq_len:
        cfg = dataclasses.replace(cfg, max_seq_len=setup.seq_len)
    n_batches = max(1, steps)
    tokens, floor = markov_stream(
        cfg.vocab_size, n_batches * setup.batch, setup.seq_len, states=setup.states, successors=setup.successors, seed=seed + 1
    )
    batches = tokens.view(n_batches, setup.batch, setup.seq_len + 1)
    if device.type == "cuda":
        batches = batches.pin_memory()

    # Warm-up, unmeasured: one optimizer step per path, so lazy imports (the optimizer's too), JIT
    # compiles and allocator/thread-pool start-up land in neither run's time or memory.
    for use_pk in (True, False):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg, use_polykernel=use_pk, fused_loss=fused_loss, device=device).to(dtype)
        train(model, batches[:1], steps=1, lr=setup.lr, warmup=1, device=device, label="warm-up", memory=_Memory(device))
        del model

    runs = []
    for use_pk in (True, False):
        label = "polykernel" if use_pk else "torch"
        if use_pk:
            polykernel.clear_caches()  # so the impl table shows this run's decisions only
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg, use_polykernel=use_pk, fused_loss=fused_loss, device=device).to(dtype)
        memory = _Memory(device)
        memory.start()  # after building the model: the fp32-then-cast transient is not training
        bar = _Progress(label, steps, out) if progress else None
        run = train(model, batches, steps=steps, lr=setup.lr, warmup=setup.warmup, device=device, label=label, memory=memory, progress=bar)
        if use_pk:
            run.impls = used_impls()
        runs.append(run)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    diffs = [abs(a - b) for a, b in zip(runs[0].losses, runs[1].losses)]
    max_diff = max(diffs) if diffs else 0.0
    if any(math.isnan(x) for r in runs for x in r.losses):
        max_diff = float("nan")
    atol, rtol = LOSS_TOL.get(dtype, LOSS_TOL[torch.bfloat16])
    return DemoResult(setup, cfg, str(device), str(dtype).removeprefix("torch."), floor, runs, max_diff, atol, rtol)


# ------------------------------------------------------------------------------------------------
# Printing


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO, indent: str = "  ") -> None:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda r: indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    out.write(line(headers) + "\n")
    out.write(indent + "  ".join("-" * w for w in widths) + "\n")
    for r in cells:
        out.write(line(r) + "\n")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def print_platform(device: torch.device, dtype: torch.dtype, out: TextIO) -> None:
    import polykernel
    from polykernel.spec import PlatformInfo

    parts = [f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("triton not installed")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        parts.append(f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    else:
        parts.append(f"torch using {torch.get_num_threads()} of {os.cpu_count()} CPU threads ({_platform.machine()})")
    out.write(f"polykernel {polykernel.__version__} demo\n")
    out.write(f"platform: {PlatformInfo.detect(device)} | {' | '.join(parts)} | python {_platform.python_version()}\n")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        out.write("note: TRITON_INTERPRET=1 is set, so Triton kernels run through the (slow) interpreter on the CPU\n")


def print_op_table(rows: list[dict[str, Any]], device: torch.device, dtype: torch.dtype, out: TextIO) -> None:
    out.write(f"\nops on {device} for {str(dtype).removeprefix('torch.')} (* = the dispatcher's choice; x = cannot run here: why)\n")
    table = []
    for r in rows:
        if not r["impls"]:
            table.append((r["op"], "-", r["missing"] or "no impl"))
            continue
        impls = []
        for i in r["impls"]:
            mark = "*" if i["name"] == r["chosen"] else ("" if i["runnable"] else " x")
            impls.append(f"{i['name']}{mark}" + (f" ({i['reason']})" if not i["runnable"] else ""))
        chosen = f"{r['chosen']} ({r['source']})" if r["chosen"] else f"none: {r['missing']}"
        table.append((r["op"], chosen, "; ".join(impls)))
    _table(("op", "chosen", "impls"), table, out)


def print_result(res: DemoResult, out: TextIO) -> None:
    pk, pt = res.runs
    out.write(
        f"\nlosses per step (entropy floor of the data: {res.floor:.3f} nats; start ~ ln(vocab) = {math.log(res.config.vocab_size):.3f})\n"
    )
    n = len(pk.losses)
    every = 1 if n <= 40 else math.ceil(n / 30)
    rows = [
        (i + 1, f"{a:.5f}", f"{b:.5f}", f"{abs(a - b):.2e}")
        for i, (a, b) in enumerate(zip(pk.losses, pt.losses))
        if i % every == 0 or i == n - 1
    ]
    _table(("step", "polykernel", "torch", "|diff|"), rows, out)
    verdict = "agree" if res.agree else "DIFFER"
    out.write(
        f"  max |diff| = {res.max_abs_diff:.3e} over {n} steps (step 1, same weights and data: {abs(pk.losses[0] - pt.losses[0]):.3e}): "
        f"{verdict} (tolerance per step {res.tolerance_text} for {res.dtype})\n"
    )

    out.write("\nthroughput and memory\n")
    t_pk, t_pt = pk.tokens_per_second, pt.tokens_per_second
    _table(
        ("", "polykernel", "torch", "polykernel / torch"),
        [
            ("tokens/s (after step 1)", f"{t_pk:,.0f}", f"{t_pt:,.0f}", f"{t_pk / max(t_pt, 1e-9):.2f}x"),
            ("step time, median", f"{_median(pk.step_seconds) * 1e3:,.1f} ms", f"{_median(pt.step_seconds) * 1e3:,.1f} ms", ""),
            (
                "peak memory",
                _mib(pk.peak_bytes),
                _mib(pt.peak_bytes),
                f"{pk.peak_bytes / max(pt.peak_bytes, 1):.2f}x" if pt.peak_bytes else "n/a",
            ),
        ],
        out,
    )
    out.write(f"  memory: {pk.memory_kind}\n")

    out.write("\nimpls polykernel used in training (from the dispatcher's decisions)\n")
    rows = []
    for r in pk.impls:
        why = r["why"] + (f"; skipped {', '.join(r['skipped'])}" if r["skipped"] else "")
        rows.append((r["op"], r["impl"] + (" (no-grad calls)" if r["forward_only"] else ""), why))
    if rows:
        _table(("op", "impl", "why"), rows, out)
    else:
        out.write("  (none recorded)\n")


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


# ------------------------------------------------------------------------------------------------
# Command line


def build_parser(prog: str = "polykernel demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Show which kernels run here, then train a small Llama-style LM with and without polykernel and compare.",
    )
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument(
        "--size",
        choices=["auto", *SETUPS],
        default="auto",
        help="model size (default: tiny on CPU, medium on a GPU with >= 60 GiB, else small)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16 or float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=None, help="override the size's batch")
    p.add_argument("--seq-len", type=int, default=None, help="override the size's sequence length")
    p.add_argument("--lr", type=float, default=None, help="override the size's learning rate")
    p.add_argument(
        "--loss",
        choices=["fused", "logits"],
        default="fused",
        help="polykernel loss: fused linear CE (default) or CE on materialized logits",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: 1 for --size tiny on the CPU, whose ops are too small to gain from more "
        "and which OpenMP spin-waits slow down badly when other processes share the cores; else torch's default)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run the demo; 0 when the two runs agree and the loss fell, 1 otherwise."""
    args = build_parser().parse_args(argv)
    out = out if out is not None else sys.stdout
    if args.steps < 1:
        raise SystemExit("polykernel demo: --steps must be >= 1")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    size = resolve_size(args.size, device)
    threads_before = torch.get_num_threads()
    threads = args.threads or (1 if device.type == "cpu" and size == "tiny" else None)
    if threads:
        torch.set_num_threads(threads)
    try:
        return _main(args, device, dtype, size, out)
    finally:
        torch.set_num_threads(threads_before)


def _main(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, size: str, out: TextIO) -> int:
    print_platform(device, dtype, out)
    print_op_table(op_table(device, dtype), device, dtype, out)

    from polykernel.models import LlamaConfig

    setup = SETUPS[size]
    cfg = LlamaConfig.preset(setup.preset)
    b, t = args.batch or setup.batch, args.seq_len or setup.seq_len
    out.write(
        f"\ntraining: size {size} ({cfg.num_parameters() / 1e6:,.1f}M parameters: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads}/{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}), batch {b} x {t} tokens, {args.steps} steps, "
        f"{str(dtype).removeprefix('torch.')}, seed {args.seed}, loss: {'fused linear CE' if args.loss == 'fused' else 'CE on logits'}\n"
    )
    out.write("  data: a fixed random Markov chain (synthetic, learnable); same batches, seed and initial weights for both runs\n")
    out.flush()
    res = run_demo(
        steps=args.steps,
        size=size,
        device=device,
        dtype=dtype,
        seed=args.seed,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        fused_loss=args.loss == "fused",
        out=out,
        progress=not args.no_progress,
    )
    print_result(res, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res.as_dict(), f, indent=1)
        out.write(f"\nwrote {args.json}\n")
    problems = []
    if not res.agree:
        problems.append(f"the losses differ by up to {res.max_abs_diff:.3g}, beyond {res.tolerance_text}")
    if not res.learned and args.steps >= 10:
        problems.append("the loss did not fall by 10%")
    if problems:
        out.write("\nPROBLEM: " + "; ".join(problems) + "\n")
        return 1
    out.write("\nok: same losses with and without polykernel.\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
