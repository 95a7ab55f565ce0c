"""``timing.host_us_per_call`` on the CPU: its GPU hold and synchronize stood in for, the clock
faked, so what it returns is exact (the best round's time per call) and the hold asked for is the
one queued before every round."""

from __future__ import annotations

import torch

from _tuning_helpers import use_fake_clock
from polykernel import timing


def test_host_time_is_the_best_rounds_per_call_time_behind_the_hold_asked_for(monkeypatch):
    clock = use_fake_clock(monkeypatch)
    holds: list[int] = []
    monkeypatch.setattr(timing, "hold_gpu", holds.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    costs = iter([1e-3] + [30e-6] * 20 + [10e-6] * 20 + [50e-6] * 20)  # the warm-up call, then three rounds

    def step() -> None:
        clock.now += next(costs)

    us = timing.host_us_per_call(step, calls=20, rounds=3, hold_cycles=1234)
    assert abs(us - 10.0) < 1e-6  # the best round, per call
    assert holds == [1234, 1234, 1234]  # one hold of the asked length before each round


def test_the_default_hold_is_the_long_one(monkeypatch):
    use_fake_clock(monkeypatch)
    holds: list[int] = []
    monkeypatch.setattr(timing, "hold_gpu", holds.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    timing.host_us_per_call(lambda: None, calls=2, rounds=2)
    assert holds == [timing.HOST_HOLD_CYCLES] * 2
