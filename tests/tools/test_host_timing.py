"""``timing.host_us_per_call`` on the CPU: its GPU hold and synchronize stood in for, the clock
faked, so what it returns is exact (the best round's time per call), the hold asked for is the
one queued before every round, and a round queues no more than ~1 ms of calls."""

from __future__ import annotations

import torch

from _tuning_helpers import use_fake_clock
from polykernel import timing


def test_host_time_is_the_best_rounds_per_call_time_behind_the_hold_asked_for(monkeypatch):
    clock = use_fake_clock(monkeypatch)
    holds: list[int] = []
    monkeypatch.setattr(timing, "hold_gpu", holds.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    # the warm-up call, the probe (20 calls of 30 µs fit in 1 ms: rounds of 20), then three rounds
    costs = iter([1e-3, 30e-6] + [30e-6] * 20 + [10e-6] * 20 + [50e-6] * 20)

    def step() -> None:
        clock.now += next(costs)

    us = timing.host_us_per_call(step, calls=20, rounds=3, hold_cycles=1234)
    assert abs(us - 10.0) < 1e-6  # the best round, per call
    assert next(costs, None) is None  # every round queued its 20 calls
    assert holds == [1234] * 4  # one hold of the asked length before the probe and each round


def test_a_step_of_many_launches_is_queued_one_at_a_time(monkeypatch):
    """A 2 ms step (a chunked loss: hundreds of launches) is not queued 20 deep behind the hold,
    where the launch queue would fill and the host would wait on the GPU."""
    clock = use_fake_clock(monkeypatch)
    monkeypatch.setattr(timing, "hold_gpu", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    calls = 0

    def step() -> None:
        nonlocal calls
        calls += 1
        clock.now += 2e-3

    us = timing.host_us_per_call(step, calls=20, rounds=3)
    assert abs(us - 2000.0) < 1e-6
    assert calls == 1 + 1 + 3  # the warm-up, the probe, then one call a round


def test_the_default_hold_is_the_long_one(monkeypatch):
    use_fake_clock(monkeypatch)
    holds: list[int] = []
    monkeypatch.setattr(timing, "hold_gpu", holds.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    timing.host_us_per_call(lambda: None, calls=2, rounds=2)
    assert holds == [timing.HOST_HOLD_CYCLES] * 3  # the probe and two rounds
