"""On a GPU: explain every op, then parity of the peer impls (Liger-Kernel, QuACK) with the reference.

    source /opt/pk/env.sh   # after ../shared/gpu/stage.sh cute (QuACK needs the CuTeDSL native lib)
    PYTHONPATH=src python3 benchmarks/kernels/check_peers.py [--large] [--op rms_norm ...] [--json FILE]

Prints each op's explain (bf16, default arguments), then one line per failing (op, impl, case,
dtype), one line per case a peer refuses (its predicate's reason), and a summary. Exit status 1 if
anything failed. ``--json FILE`` keeps a row per check (ok, failed or refused), written as it runs.
"""

from __future__ import annotations

import argparse
import sys

import torch

import polykernel
from polykernel.core import registry
from polykernel.testing import _one, refusal
from polykernel.tools.rows import RowFile, announce

PEERS = ("liger", "quack")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", nargs="*", default=None, help="ops to check (default: every op)")
    p.add_argument("--large", action="store_true", help="add the ops' full-size GPU cases")
    p.add_argument("--json", default=None, help="keep a row per check here, written as it runs (default: printed only)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_peers needs a CUDA GPU", file=sys.stderr)
        return 2
    ops = [registry.get_op(o) for o in (a.op or registry.all_op_ids())]
    announce(len(ops) * len(DTYPES), per_case_s=10 if a.large else 3, what="(op, dtype) groups", path=a.json)
    # every check is kept in the file; only failures and refusals are printed (an empty line: none)
    out = RowFile(a.json, {"device": torch.cuda.get_device_name(), "large": a.large}, echo=lambda line: line and print(line, flush=True))
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
                    row = {"op": op.name, "impl": impl, "case": case.label, "dtype": str(dtype).removeprefix("torch.")}
                    why = refusal(op, impl, case)
                    if why is not None:
                        refused += 1
                        out.add({**row, "result": "refused", "why": why}, f"refused {op.name} [{impl}] {case.label} {row['dtype']}: {why}")
                        continue
                    r = _one(op, impl, case, dtype, True)
                    ran += 1
                    failed += not r.ok
                    errors = {"forward_error": r.forward_error, "backward_error": r.backward_error, "message": r.message}
                    out.add({**row, "result": "ok" if r.ok else "failed", **errors}, "" if r.ok else str(r))
            torch.cuda.empty_cache()
    out.finish(ran=ran, failed=failed, refused=refused)
    print(f"peer parity: {ran} checks, {failed} failed, {refused} refused by predicates")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
