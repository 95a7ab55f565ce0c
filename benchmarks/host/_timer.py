"""The host benchmarks' timer: each candidate's best per-call time over interleaved rounds. The
best round is the one least disturbed by other processes, which on a shared machine is the only
stable figure. Plain Python (no polykernel import): ``serving_entry.py`` also runs on older trees."""

from __future__ import annotations

import time
from collections.abc import Callable


def interleaved_best_us(fns: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """Best per-call time (us) of each candidate, over ``rounds`` interleaved rounds of ``calls`` calls."""
    best = dict.fromkeys(fns, float("inf"))
    loop = range(calls)
    for fn in fns.values():  # warm up: memo filled, code paths specialized
        for _ in range(200):
            fn()
    clock = time.perf_counter
    for _ in range(rounds):
        for name, fn in fns.items():
            t = clock()
            for _ in loop:
                fn()
            best[name] = min(best[name], (clock() - t) / calls * 1e6)
    return best
