"""Training the contenders: one run each, same data, seed and initial weights, with per-step loss
and time, peak memory, and (for polykernel) the dispatcher's decisions. ``isolate=True`` runs each
contender in a subprocess of its own, so that one run's allocator cache, compiled kernels and
imports cannot shape another's peak memory or speed."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .data import LOSS_TOL, SETUPS, DemoSetup, markov_stream
from .models import built, model_kind, parse_compare

__all__ = ["DemoResult", "RunResult", "run_demo", "train", "used_impls"]

# Throughput is the median step time of steps 4..15 (1-based): step 1 allocates the optimizer
# state and compiles kernels (torch.compile's whole graph), steps 2-3 still warm caches.
TIMED_STEPS = slice(3, 15)


# ------------------------------------------------------------------------------------------------
# Memory


class Memory:
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

            self.kind = "ru_maxrss growth (order-dependent: a later run only shows what exceeds the earlier ones)"
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


# ------------------------------------------------------------------------------------------------
# One run


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
    def timed(self) -> list[float]:
        """The step times that count: steps 4..15, or all but the first on a shorter run."""
        t = self.step_seconds
        return t[TIMED_STEPS] if len(t) > TIMED_STEPS.start else (t[1:] or t)

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(self.timed) if self.timed else math.nan

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / max(self.median_step_seconds, 1e-12)

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "tokens_per_second": self.tokens_per_second,
            "median_step_seconds": self.median_step_seconds,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunResult:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    batches: torch.Tensor,
    *,
    steps: int,
    lr: float,
    warmup: int,
    device: torch.device,
    label: str,
    memory: Memory,
    on_step: Callable[[int, float], None] | None = None,
) -> RunResult:
    """AdamW (fused on CUDA) with linear warmup and grad-norm clipping; one batch per step,
    cycling ``batches`` (``[n, B, T + 1]`` token ids), ``loss_fn(batch)`` the step's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    losses, times = [], []
    model.train()
    for step in range(steps):
        batch = batches[step % len(batches)].to(device, non_blocking=True)
        _sync(device)
        t0 = time.perf_counter()
        loss = loss_fn(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # synchronizes
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(value)
        if on_step is not None:
            on_step(step + 1, value)
    b, t1 = batches.shape[1], batches.shape[2]
    return RunResult(label, losses, times, b * (t1 - 1), memory.peak(), memory.kind)


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
    """The decisions the dispatcher made since the last ``clear_caches()`` (``decisions()``): per
    op, the impl that ran, the source of the choice and why better-ranked impls did not run."""
    import polykernel

    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    for d in polykernel.decisions():
        grad = bool(d["arg_class"].get("needs_grad"))
        key = (d["op"], d["impl"], d["source"])
        row = seen.setdefault(
            key,
            {
                "op": d["op"],
                "impl": d["impl"],
                "source": d["source"],
                "why": _SOURCES.get(d["source"], d["source"]),
                "skipped": [f"{name}: {reason}" for name, reason in d["skipped"]],
                "forward_only": True,
            },
        )
        row["forward_only"] = row["forward_only"] and not grad
    return list(seen.values())


# ------------------------------------------------------------------------------------------------
# The demo


@dataclass
class DemoResult:
    """Every run of one demo; the first (``torch``) is the baseline."""

    setup: DemoSetup
    shape: dict[str, Any]
    kind: str  # "hf" (a transformers Llama) or "builtin"
    device: str
    dtype: str
    floor: float
    runs: list[RunResult]
    atol: float
    rtol: float
    isolated: bool = False
    failed: dict[str, str] = field(default_factory=dict)  # contender -> why its run failed (--isolate)

    @property
    def baseline(self) -> RunResult:
        return self.runs[0]

    def max_abs_diff(self, run: RunResult) -> float:
        """max over steps of |loss(run) - loss(torch)| (NaN when any loss is NaN)."""
        pairs = list(zip(run.losses, self.baseline.losses))
        if any(math.isnan(a) or math.isnan(b) for a, b in pairs):
            return math.nan
        return max((abs(a - b) for a, b in pairs), default=0.0)

    def agrees(self, run: RunResult) -> bool:
        """Every step's loss within ``atol + rtol * |loss(torch)|`` of the baseline's (NaN never agrees)."""
        base = self.baseline.losses
        return len(run.losses) == len(base) and all(abs(a - b) <= self.atol + self.rtol * abs(b) for a, b in zip(run.losses, base))

    @property
    def agree(self) -> bool:
        return all(self.agrees(r) for r in self.runs)

    @property
    def tolerance_text(self) -> str:
        return f"{self.atol:g}" + (f" + {self.rtol:g} x loss" if self.rtol else "")

    @property
    def learned(self) -> bool:
        """Every run's loss fell clearly: the mean of the last quarter is below the first loss by 10%."""
        for r in self.runs:
            tail = r.losses[-max(1, len(r.losses) // 4) :]
            if not (sum(tail) / len(tail) < 0.9 * r.losses[0]):
                return False
        return True

    def run(self, label: str) -> RunResult | None:
        return next((r for r in self.runs if r.label == label), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "setup": dataclasses.asdict(self.setup),
            "model": {"kind": self.kind, **self.shape},
            "device": self.device,
            "dtype": self.dtype,
            "isolated": self.isolated,
            "entropy_floor": self.floor,
            "tolerance": {"atol": self.atol, "rtol": self.rtol},
            "agree": self.agree,
            "learned": self.learned,
            "runs": [{**r.as_dict(), "max_abs_loss_diff": self.max_abs_diff(r), "agrees": self.agrees(r)} for r in self.runs],
            "failed": self.failed,
        }


def model_shape(size: str) -> dict[str, Any]:
    """The model shape of a size: the built-in preset's fields, with the size's overrides."""
    from polykernel.tools.models import LlamaConfig

    setup = SETUPS[size]
    cfg = LlamaConfig.preset(setup.preset, **setup.model)
    return {"preset": setup.preset, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "init_std"}}


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
    compare: str | list[str] | None = None,
    model: str = "auto",
    isolate: bool = False,
    on_step: Callable[[str, int, float], None] | None = None,
) -> DemoResult:
    """Train each contender (``compare``: torch first, then polykernel, liger, compile; see
    :mod:`polykernel.tools.demo.models`) from the same seed on the same batches and return the runs.

    >>> res = run_demo(steps=4, size="tiny", compare="torch,polykernel", batch=2, seq_len=16)  # doctest: +SKIP
    >>> res.run("polykernel").tokens_per_second > 0                                       # doctest: +SKIP
    True
    """
    device = torch.device(device)
    kind = model_kind(model)
    names = parse_compare(",".join(compare) if isinstance(compare, list) else compare, device, kind)
    setup, shape, batches, floor = _prepare(steps, size, device, seed, batch, seq_len, lr)
    runs, failed = [], {}
    for name in names:
        if isolate:
            # a contender that crashes its own process (a peer's patch that no longer fits this
            # transformers, an OOM) is reported with its error; the baseline's failure still ends the demo
            try:
                runs.append(_run_isolated(name, steps, size, device, dtype, seed, setup, fused_loss, kind))
            except RuntimeError as exc:
                if name == "torch":
                    raise
                failed[name] = str(exc)
        else:
            runs.append(_run_one(name, kind, shape, batches, setup, steps, device, dtype, seed, fused_loss, on_step))
    atol, rtol = LOSS_TOL.get(dtype, LOSS_TOL[torch.bfloat16])
    return DemoResult(setup, shape, kind, str(device), str(dtype).removeprefix("torch."), floor, runs, atol, rtol, isolate, failed)


def _prepare(
    steps: int, size: str, device: torch.device, seed: int, batch: int | None, seq_len: int | None, lr: float | None
) -> tuple[DemoSetup, dict[str, Any], torch.Tensor, float]:
    """The setup, the model shape, the batches ``[steps, B, T + 1]`` and the data's entropy floor."""
    setup = SETUPS[size]
    setup = dataclasses.replace(setup, batch=batch or setup.batch, seq_len=seq_len or setup.seq_len, lr=lr or setup.lr)
    shape = model_shape(size)
    shape["max_seq_len"] = max(shape["max_seq_len"], setup.seq_len + 1)
    n_batches = max(1, steps)
    tokens, floor = markov_stream(
        shape["vocab_size"], n_batches * setup.batch, setup.seq_len, states=setup.states, successors=setup.successors, seed=seed + 1
    )
    batches = tokens.view(n_batches, setup.batch, setup.seq_len + 1)
    if device.type == "cuda":
        batches = batches.pin_memory()
    return setup, shape, batches, floor


def _run_one(
    name: str,
    kind: str,
    shape: dict[str, Any],
    batches: torch.Tensor,
    setup: DemoSetup,
    steps: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    fused_loss: bool,
    on_step: Callable[[str, int, float], None] | None,
) -> RunResult:
    import polykernel

    polykernel.clear_caches()  # so the impl table shows this run's decisions only
    with built(name, kind, shape, device=device, dtype=dtype, seed=seed, fused_loss=fused_loss) as v:
        memory = Memory(device)
        memory.start()  # after building the model: the fp32-then-cast transient is not training
        run = train(
            v.model,
            v.loss,
            batches,
            steps=steps,
            lr=setup.lr,
            warmup=setup.warmup,
            device=device,
            label=name,
            memory=memory,
            on_step=(lambda s, loss: on_step(name, s, loss)) if on_step else None,
        )
        if name == "polykernel":
            run.impls = used_impls()
        del v
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run


def _run_isolated(
    name: str, steps: int, size: str, device: torch.device, dtype: torch.dtype, seed: int, setup: DemoSetup, fused_loss: bool, kind: str
) -> RunResult:
    """One contender in a fresh ``python -m polykernel.tools.demo`` process; its RunResult comes back as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        argv = [
            sys.executable, "-m", "polykernel.tools.demo", "--compare", name, "--worker", path,
            "--steps", str(steps), "--size", size, "--device", str(device), "--dtype", str(dtype).removeprefix("torch."),
            "--seed", str(seed), "--batch", str(setup.batch), "--seq-len", str(setup.seq_len), "--lr", repr(setup.lr),
            "--loss", "fused" if fused_loss else "logits", "--model", kind,
        ]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"polykernel demo --isolate: the {name} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(path) as f:
            return RunResult.from_dict(json.load(f))


def run_worker(
    name: str,
    path: str,
    *,
    steps: int,
    size: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    batch: int | None,
    seq_len: int | None,
    lr: float | None,
    fused_loss: bool,
    model: str,
) -> int:
    """The child side of ``--isolate``: run the one contender ``name``, write its RunResult to ``path``."""
    kind = model_kind(model)
    parse_compare(name, device, kind)  # the same checks as the parent's
    setup, shape, batches, _ = _prepare(steps, size, device, seed, batch, seq_len, lr)
    run = _run_one(name, kind, shape, batches, setup, steps, device, dtype, seed, fused_loss, None)
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(run), f)
    return 0
