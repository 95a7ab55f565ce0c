"""Timing GPU and host work: what ``polykernel bench`` and the tuner (:mod:`polykernel.tuning.measure`) share.

- :class:`Timer`: one call timed with CUDA events, L2 flushed before it and the GPU held busy while
  the host issues it (so the events time the GPU work alone, not the host's launch gaps), plus the
  host time around the launch; wall time alone on the CPU.
- :func:`host_us_per_call`: host microseconds to issue one step with the GPU never the bottleneck.
- :func:`do_bench`: Triton's median over repeated runs (it flushes L2 between them), which
  ``polykernel bench`` reports; :func:`capture_graph` for timing CUDA-graph replays with it.
- :func:`copy_bandwidth` (the bench's reference), :func:`hold_gpu`, :func:`median`, :func:`now`.

torch and Triton load when a function runs, not on import (``polykernel bench --load`` needs
neither). Example::

    timer = Timer(x.device, hold_cycles=2_000_000)
    samples = [timer.time(fn, x) for _ in range(25)]
    torch.cuda.synchronize()
    gpu_ms, host_ms = median(s.gpu_ms() for s in samples), median(s.host_ms for s in samples)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Bytes zeroed before each timed call: several times a large GPU's L2, so no call finds its
# inputs cached by the previous one.
L2_FLUSH_BYTES = 256 << 20
# Cycles queued ahead of a host-time measurement: ~25 ms on a ~2 GHz GPU, longer than the calls
# take to issue.
HOST_HOLD_CYCLES = 50_000_000
# Host seconds of calls a host-time round queues behind the hold: ~250-500 launches at 2-4 µs
# each, well inside the driver's launch queue (~1024 entries), so the host never waits on it.
QUEUED_HOST_S = 1e-3


def now() -> float:
    """Seconds on the host's monotonic clock (``time.perf_counter``; tests replace ``time``)."""
    return time.perf_counter()


def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def hold_gpu(cycles: int) -> None:
    """Keep the current CUDA stream busy for about ``cycles`` GPU cycles, so that what the host
    issues next queues behind it (``torch.cuda._sleep``, or its fallback: polykernel._compat)."""
    from . import _compat

    _compat.cuda_sleep(cycles)


@dataclass
class Sample:
    """One timed call: host milliseconds around the launch, and on CUDA the events around it."""

    host_ms: float
    events: tuple[Any, Any] | None = None

    def gpu_ms(self) -> float | None:
        """Milliseconds between the events (once the device has synchronized); None on the CPU."""
        return None if self.events is None else self.events[0].elapsed_time(self.events[1])


class Timer:
    """Times single calls on ``device`` (see the module doc); the L2 flush buffer lives as long as it."""

    def __init__(self, device: torch.device, hold_cycles: int = 0, flush_bytes: int = L2_FLUSH_BYTES) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.hold_cycles = hold_cycles
        self._flush = torch.empty(flush_bytes, dtype=torch.int8, device=device) if self.cuda else None

    def time(self, fn: Callable[..., Any], *args: Any) -> Sample:
        """``fn(*args)`` timed. On CUDA its GPU time is known only after a synchronize."""
        if self._flush is None:
            t0 = now()
            fn(*args)
            return Sample((now() - t0) * 1e3)
        import torch

        self._flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self.hold_cycles:
            hold_gpu(self.hold_cycles)
        start.record()
        t0 = now()
        fn(*args)
        t1 = now()
        end.record()
        return Sample((t1 - t0) * 1e3, (start, end))


def host_us_per_call(step: Callable[[], Any], calls: int = 20, rounds: int = 7, hold_cycles: int = HOST_HOLD_CYCLES) -> float:
    """Host (CPU) microseconds to issue one ``step`` with the GPU never the bottleneck: a long
    :func:`hold_gpu` (``hold_cycles``, ~25 ms by default) is queued first, so each call only
    enqueues its work; best round. A shorter hold buys more rounds for the same time, as long as
    it outlasts the ``calls`` (20 calls of 100 µs: 2 ms).

    A probe round (one call behind the hold) sets how many calls a round queues: at most
    ``calls``, and no more than ~:data:`QUEUED_HOST_S` of issuing. A step of hundreds of launches
    (a chunked loss) would otherwise fill the driver's launch queue behind the hold, and the host
    would wait for the GPU to drain it: the GPU's pace read as the host's.

    A step that synchronizes with the GPU (``.item()``, a host copy) waits out the hold and shows
    up as thousands of microseconds here: that is the point.
    """
    import torch

    step()
    torch.cuda.synchronize()
    best, per_round = float("inf"), 1
    for r in range(rounds + 1):  # round 0: the probe
        hold_gpu(hold_cycles)
        t = now()
        for _ in range(per_round):
            step()
        best = min(best, (now() - t) / per_round)
        torch.cuda.synchronize()
        if r == 0:
            per_round = max(1, min(calls, int(QUEUED_HOST_S / max(best, 1e-9))))
    return best * 1e6


def do_bench(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` over ``rep`` ms of runs after ``warmup`` ms
    (``triton.testing.do_bench``: CUDA events, L2 flushed between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy (bytes read + written)."""
    import torch

    src = torch.randn(2**30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100)
    return 2 * 2**31 / (ms * 1e-3) / 1e9


def capture_graph(step: Callable[[], Any], calls: int = 1, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back ``step``s, captured after ``warmup`` calls on a side
    stream (what capture needs: allocator pools, lazy inits and autotuning done first)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    return graph
