"""Where does a forward+backward step's time go? Kernel times from the torch profiler next to
the do_bench median of the whole step.

    PYTHONPATH=src python benchmarks/models/profile_step.py [op] [impl] [--json FILE]

Rows: the step's two timings, kept (``--json``) as measured; the profiler's kernel table is a
profile dump, not rows: printed, and added to the file (``profile``) at the end.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

import polykernel
from polykernel.core import registry
from polykernel.tools.rows import RowFile, announce

SHAPES = {
    "rms_norm": (16384, 4096),
    "rope": (4, 32, 4096, 128),
    "layer_norm": (16384, 4096),
    "swiglu": (16384, 14336),
    "softmax": (8192, 32768),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("op", nargs="?", default="rms_norm", choices=sorted(SHAPES))
    p.add_argument("impl", nargs="?", default="triton")
    p.add_argument("--json", default=None, help="keep the rows here, written as measured (default: printed only)")
    a = p.parse_args(argv)
    name, impl = a.op, a.impl
    announce(3, per_case_s=5, what="measurements (2 timings, 1 profile)", path=a.json)
    out = RowFile(a.json, {"op": name, "impl": impl, "shape": list(SHAPES[name]), "device": torch.cuda.get_device_name()})
    op = registry.get_op(name)
    case = op.example(SHAPES[name], torch.bfloat16, "cuda", True)
    fn = getattr(polykernel, op.name)
    ins = [a for a in case.args if isinstance(a, torch.Tensor) and a.requires_grad]
    out = fn(*case.args, impl=impl, **case.kwargs)
    outs = list(out) if isinstance(out, tuple) else [out]
    cots = [torch.randn_like(o) for o in outs]

    def step():
        o = fn(*case.args, impl=impl, **case.kwargs)
        return torch.autograd.grad(list(o) if isinstance(o, tuple) else [o], ins, cots)

    for flush in (True, False):
        ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median") if flush else None
        if not flush:
            step()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 50
        timing = "do_bench, L2 flushed" if flush else "back-to-back loop"
        out.add({"timing": timing, "ms": ms}, f"{name} {impl} fwd+bwd step: {ms:.3f} ms ({timing})")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
    print(table)
    out.finish(profile=table)


if __name__ == "__main__":
    main()
