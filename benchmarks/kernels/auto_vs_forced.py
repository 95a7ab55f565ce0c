"""Auto against the impl it ran, interleaved: is there a cost to letting polykernel choose?

``post_training_losses.py`` measured auto 0.2-0.3 ms slower than ``impl="triton"`` on the N x V
losses (h100-2026-12-06-twentyfirst/losses/post_training.json), with five timed steps a row and
auto always measured first. Here each loss's candidates alternate step by step (round r times
auto, then the forced impl, then auto ...), so clocks, the allocator's state and the order weigh on
both alike; per candidate the median fwd+bwd step (CUDA events), and one profiled step's kernels
(name, count, total GPU us) so that a difference in the launched work shows by name.

    PYTHONPATH=src python benchmarks/kernels/auto_vs_forced.py --json out.json            # GPU
    PYTHONPATH=src python benchmarks/kernels/auto_vs_forced.py --tiny --only kl_div       # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

os.environ.setdefault("POLYKERNEL_VERIFY", "off")  # as post_training_losses.py: no first-use comparison
if "--tiny" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _loss_cases import FULL, TINY, inputs, polykernel_call

import polykernel
from polykernel.timing import Timer
from polykernel.tools.rows import RowFile, announce

LOSSES = ("kl_div", "jsd", "tvd", "dpo")


def stepper(loss: str, x, impl: str | None):
    call = polykernel_call(loss, x, impl)
    params = x.grads

    def step():
        out = call()
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, params)

    return step


def timed(timer: Timer, step) -> float:
    """One step's milliseconds: GPU time between CUDA events, else host time."""
    sample = timer.time(step)
    if sample.events is None:
        return sample.host_ms
    torch.cuda.synchronize()
    return sample.gpu_ms()


def kernels(step, cuda: bool, top: int) -> list[list]:
    """One profiled step: [name, calls, total device us] for its ``top`` kernels of most time."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0.0) if cuda else e.cpu_time_total
        if us > 0 and (not cuda or getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA):
            rows.append([e.key[:90], e.count, round(us, 1)])
    return sorted(rows, key=lambda r: -r[2])[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--only", default=",".join(LOSSES))
    ap.add_argument("--forced", default="triton", help="the impl auto is compared with (on a CPU: torch)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    forced = args.forced if cuda or args.tiny else "torch"
    shapes = TINY if args.tiny else FULL
    losses = [s for s in args.only.split(",") if s]
    out = RowFile(args.json, {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "rounds": args.rounds})
    announce(len(losses) * 2, 0.02 * args.rounds + 3.0, "rows", args.json)
    for loss in losses:
        x = inputs(loss, shapes, device, dtype)
        steps = {"auto": stepper(loss, x, None), forced: stepper(loss, x, forced)}
        polykernel.clear_caches()
        for step in steps.values():  # compiles, first calls
            step()
            step()
        ran = sorted({f"{d['op']}={d['impl']}" for d in polykernel.decisions()})
        timer = Timer(device, flush_bytes=0)  # no L2 flush: the steps run back to back, as in training
        times: dict[str, list[float]] = {k: [] for k in steps}
        for r in range(args.rounds):
            order = list(steps) if r % 2 == 0 else list(reversed(steps))
            for k in order:
                times[k].append(timed(timer, steps[k]))
        for k, step in steps.items():
            row = {"loss": loss, "impl": k, "shape": x.shape, "median_ms": statistics.median(times[k]), "min_ms": min(times[k])}
            if k == "auto":
                row["ran"] = ran
            row["kernels"] = kernels(step, cuda, 12)
            out.add(row, f"{loss:8s} {k:7s} median {row['median_ms']:.3f} ms  min {row['min_ms']:.3f} ms")
        del x, steps
        if cuda:
            torch.cuda.empty_cache()
    out.finish()


if __name__ == "__main__":
    main()
