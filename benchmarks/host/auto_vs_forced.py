"""Does the public call's automatic path cost GPU time that the same impl forced with ``impl=``
does not? The H200 sweep (benchmarks/tuning/sweep_tuning.py, 2026-11-30) timed the tuned public call
7-11% slower than the impl it chose at some points (rms_norm fwd 4K/8K, softmax 128K).

For each case: CUDA-graph replay time of ``impl=<chosen>`` and of the automatic call (tuning off,
then on with a fresh store), interleaved A/B/A/B with ``polykernel.tools.bench.measure``, plus the
kernels each captured graph launches (``torch.profiler`` over replays). Writes
``DIR/auto_vs_forced.json``, ``{"complete", "rows"}``, each case's row as it is measured (a bare
list of rows before issue 35).

    PYTHONPATH=src python benchmarks/host/auto_vs_forced.py --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from polykernel.tools.rows import RowFile, announce

CASES = [  # (op, M, N, backward)
    ("rms_norm", 32768, 4096, False),
    ("rms_norm", 16384, 8192, False),
    ("rms_norm", 2048, 65536, False),
    ("softmax", 32768, 4096, True),
    ("softmax", 1024, 131072, False),
]


def _kernels(step: Any) -> list[str]:
    """Names of the GPU kernels one replay of ``step``'s graph runs."""
    import torch

    from polykernel.tools.bench import capture_graph

    graph = capture_graph(step)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ["POLYKERNEL_CACHE_DIR"] = tempfile.mkdtemp()
    import torch

    import polykernel
    from polykernel.backends.triton import _native

    _native.module(wait=True)  # the fresh cache dir has no build: built now, not in the background mid-run
    from polykernel.core import registry
    from polykernel.tools import bench

    out = RowFile(a.out / "auto_vs_forced.json", {"device": torch.cuda.get_device_name()})
    announce(len(CASES), per_case_s=8, what="cases (3 variants, 2 rounds, kernel lists)", path=str(out.path))
    for op_name, m, n, backward in CASES:
        op = registry.get_op(op_name)
        public = getattr(polykernel, op.name)
        torch.manual_seed(0)
        args = op.example((m, n), torch.bfloat16, "cuda", requires_grad=backward).args
        grads = [x for x in args if isinstance(x, torch.Tensor) and x.requires_grad]
        nbytes = op.bytes_moved(*args, backward=backward)
        times: dict[str, list[float]] = {}
        chosen = {}
        for tune in ("off", "on"):
            os.environ["POLYKERNEL_TUNE"] = tune
            polykernel.clear_caches()
            public(*args)  # decide (and, with tuning on, measure) eagerly first
            chosen[tune] = polykernel.decisions(op.name)[-1]["impl"]
        impl = chosen["on"]
        variants = {"forced": lambda: public(*args, impl=impl), "auto (tune off)": None, "auto (tune on)": None}
        for _ in range(2):  # interleaved: forced, auto off, auto on, forced, ...
            for name in variants:
                if name.startswith("auto"):
                    os.environ["POLYKERNEL_TUNE"] = "off" if "off" in name else "on"
                fn = variants[name] or (lambda: public(*args))
                ms = bench.measure(fn, grads, backward, graph=True, warmup=10, rep=60)[0]
                times.setdefault(name, []).append(ms)
        kernels = {}
        for name in variants:
            os.environ["POLYKERNEL_TUNE"] = "off" if "off" in name else "on"
            fn = variants[name] or (lambda: public(*args))
            step = (lambda fn=fn: torch.autograd.grad(fn(), grads, torch.ones_like(args[0]))) if backward else fn
            with torch.no_grad() if not backward else torch.enable_grad():
                kernels[name] = _kernels(step)
        row = {
            "op": op_name,
            "M": m,
            "N": n,
            "mode": "fwd+bwd" if backward else "fwd",
            "chosen": chosen,
            "ms": times,
            "TB/s": {k: [nbytes / (t * 1e-3) / 1e12 for t in v] for k, v in times.items()},
            "kernels": kernels,
        }
        tbs = "  ".join(f"{k} {', '.join(f'{x:.2f}' for x in v)}" for k, v in row["TB/s"].items())
        lines = [f"{op_name} {m}x{n} {row['mode']} chose {chosen}: {tbs}", *(f"    {k}: {v}" for k, v in kernels.items())]
        out.add(row, "\n".join(lines))
    out.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
