"""Where does a forward+backward step's time go? Kernel times from the torch profiler next to
the do_bench median of the whole step.

    PYTHONPATH=src python benchmarks/models/profile_step.py [op] [impl]
"""

from __future__ import annotations

import sys

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

import polykernel
from polykernel.core import registry

SHAPES = {
    "rms_norm": (16384, 4096),
    "rope": (4, 32, 4096, 128),
    "layer_norm": (16384, 4096),
    "swiglu": (16384, 14336),
    "softmax": (8192, 32768),
}


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "rms_norm"
    impl = sys.argv[2] if len(sys.argv) > 2 else "triton"
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
        print(f"{name} {impl} fwd+bwd step: {ms:.3f} ms ({'do_bench, L2 flushed' if flush else 'back-to-back loop'})")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
