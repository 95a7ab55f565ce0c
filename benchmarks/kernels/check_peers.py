"""On a GPU: explain every op, then parity of the peer impls (Liger-Kernel, QuACK) with the reference.

    source /opt/pk/env.sh   # after ../shared/gpu/stage.sh cute (QuACK needs the CuTeDSL native lib)
    PYTHONPATH=src python3 benchmarks/kernels/check_peers.py [--large] [--op rms_norm ...]

Prints each op's explain (bf16, default arguments), then one line per failing (op, impl, case,
dtype), one line per case a peer refuses (its predicate's reason), and a summary. Exit status 1 if
anything failed.
"""

from __future__ import annotations

import argparse
import sys

import torch

import polykernel
from polykernel.core import registry
from polykernel.testing import _one, refusal

PEERS = ("liger", "quack")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", nargs="*", default=None, help="ops to check (default: every op)")
    p.add_argument("--large", action="store_true", help="add the ops' full-size GPU cases")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_peers needs a CUDA GPU", file=sys.stderr)
        return 2
    ops = [registry.get_op(o) for o in (a.op or registry.all_op_ids())]
    for op in ops:
        print(polykernel.explain(op.id, device="cuda", dtype=torch.bfloat16), flush=True)
    ran = failed = refused = 0
    for op in ops:
        for dtype in DTYPES:
            impls = [i for i in PEERS if i in polykernel.available_impls(op.id, device="cuda", dtype=dtype)]
            if not impls:
                continue
            torch.manual_seed(0)
            for case in op.cases("cuda", dtype, a.large):
                for impl in impls:
                    why = refusal(op, impl, case)
                    if why is not None:
                        refused += 1
                        print(f"refused {op.name} [{impl}] {case.label} {str(dtype).removeprefix('torch.')}: {why}", flush=True)
                        continue
                    r = _one(op, impl, case, dtype, True)
                    ran += 1
                    if not r.ok:
                        failed += 1
                        print(r, flush=True)
            torch.cuda.empty_cache()
    print(f"peer parity: {ran} checks, {failed} failed, {refused} refused by predicates")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
