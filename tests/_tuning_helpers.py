"""Helpers for the tuning tests: planted rms_norm impls with controllable speed and correctness,
and the workers that run in spawned processes (they must be importable by name)."""

from __future__ import annotations

import os
import time
import types
from collections.abc import Callable
from typing import Any


class FakeClock:
    """A ``time`` stand-in for ``polykernel.timing`` (the tuner's clock): ``perf_counter`` advances only by the
    planted impls' delays, so measured differences are exact and no test depends on how busy the
    machine is (sleeps overshoot by milliseconds on a loaded 2-core CI box)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


_clock: FakeClock | None = None  # set by use_fake_clock(); planted delays advance it instead of sleeping


def use_fake_clock(monkeypatch) -> FakeClock:
    """Install a :class:`FakeClock` as ``polykernel.timing``'s ``time`` for the rest of the test."""
    import sys

    from polykernel import timing

    clock = FakeClock()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(sys.modules[__name__], "_clock", clock)  # undone at the test's end
    return clock


def isolate_tuning(tmp_path, monkeypatch) -> None:
    """A test's own tuning store under ``tmp_path``, no ``POLYKERNEL_TUNE``/``_MARGIN`` from the
    caller's environment, and empty caches (the autouse fixtures clear them again afterwards)."""
    import polykernel

    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("POLYKERNEL_TUNE", "POLYKERNEL_TUNE_MARGIN", "POLYKERNEL_TUNE_CALLS"):
        monkeypatch.delenv(name, raising=False)
    polykernel.clear_caches()


def plant(
    backend: str,
    rank: int,
    *,
    delay: float | Callable[[Any], float] = 0.0,
    wrong: bool = False,
    fail: bool = False,
    wrong_grad: bool = False,
    first_delay: float = 0.0,
    reports_ms: float | None = None,
) -> list[int]:
    """Register an rms_norm impl named ``backend``; returns the list its calls append to.
    ``delay``: seconds per call, or a function of ``x`` giving them (a speed that depends on the
    size); ``first_delay``: extra time its first call takes (a compile); ``reports_ms``: the
    compile time it reports having paid (``impl.compile_ms``, as the torch_compile impls do)."""
    import torch

    import polykernel
    from polykernel.ops.rms_norm import reference

    calls: list[int] = []

    class _WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            return y.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 3

    @polykernel.register_impl(op="rms_norm", backend=backend, rank=rank)
    def impl(x, weight, eps, offset, casting):
        calls.append(1)
        if fail:
            raise RuntimeError("planted failure")
        if first_delay and len(calls) == 1:
            (_clock or time).sleep(first_delay)
        seconds = delay(x) if callable(delay) else delay
        if seconds:
            (_clock or time).sleep(seconds)
        y = reference(x, weight, eps, offset, casting)
        if wrong_grad:
            return _WrongGrad.apply(y)
        return y * 2 if wrong else y

    if reports_ms is not None:
        impl.compile_ms = lambda *args: reports_ms
    return calls


def only(*names: str) -> None:
    """Keep only these rms_norm impls registered (inside ``polykernel.testing.isolated()``)."""
    from polykernel.core import registry

    specs = registry.specs_for("rms_norm")  # imports the declared locations first
    for name in list(specs):
        if name not in names:
            registry.unregister_impl("rms_norm", name)


# -- spawned workers ----------------------------------------------------------------------------


def store_worker(directory: str, worker: int, keys: int, rounds: int) -> None:
    """Put overlapping keys into one store, one entry at a time (a fresh Store each round)."""
    from pathlib import Path

    from polykernel.tuning.json_store import Store

    ident = {"schema": 1, "test": "concurrency"}
    for r in range(rounds):
        store = Store(Path(directory), ident)
        k = (worker * 3 + r) % keys
        store.put({f"key-{k}": {"eager": "torch", "graph": "torch", "times": {}}, f"only-{worker}-{r}": {"eager": "torch", "times": {}}})


def sync_worker(rank: int, world: int, init_file: str, base: str, out: str) -> None:
    """Rank r has its own store choosing a different impl; after sync every rank runs rank 0's."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["POLYKERNEL_CACHE_DIR"] = os.path.join(base, f"rank{rank}")
    os.environ["POLYKERNEL_TUNE"] = "cached"
    import torch
    import torch.distributed as dist

    import polykernel
    from polykernel import tuning
    from polykernel.core import registry
    from polykernel.tuning import key as tuning_key

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x, w = torch.randn(4, 32), torch.ones(32)
        op = registry.get_op("rms_norm")
        key = tuning_key.key(op, op.key(x, w), [x, w])
        mine = "torch" if rank == 0 else "triton"
        tuning.store().put({key: {"eager": mine, "graph": mine, "static": "triton", "times": {}}})
        polykernel.clear_caches()
        before = polykernel.explain("rms_norm", x, w).chosen
        n = polykernel.sync_decisions()
        polykernel.rms_norm(x, w)
        after = polykernel.decisions("rms_norm")[-1]
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            f.write(f"{before} {after['impl']} {after['source']} {n}")
    finally:
        dist.destroy_process_group()


def tune_and_sync_worker(rank: int, world: int, init_file: str, cache: str, out: str) -> None:
    """Every rank measures overlapping keys into one shared store at once (POLYKERNEL_TUNE=on),
    then ``sync_decisions``; writes what it ran for the shared key after the sync."""
    import json

    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["POLYKERNEL_CACHE_DIR"] = cache
    os.environ["POLYKERNEL_TUNE"] = "on"
    import torch
    import torch.distributed as dist

    import polykernel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)
        shared = [32, 48]  # every rank meets these
        mine = [16 * (rank + 4)]  # and one key of its own
        dist.barrier()  # start together
        for n in shared + mine:
            polykernel.rms_norm(torch.randn(4, n), torch.ones(n))
        dist.barrier()
        polykernel.sync_decisions()
        polykernel.rms_norm(torch.randn(4, 32), torch.ones(32))
        ran = [d for d in polykernel.decisions("rms_norm") if d["arg_class"]["n"] == 32][-1]
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"impl": ran["impl"], "source": ran["source"]}, f)
    finally:
        dist.destroy_process_group()
