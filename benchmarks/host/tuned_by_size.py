"""Host cost of a tuned decision's per-size-bucket chooser (``polykernel.tuning.by_size``).

    PYTHONPATH=src python benchmarks/host/tuned_by_size.py [--rounds 200] [--calls 200] [--json FILE]

``polykernel.rms_norm`` on a 1x64 fp32 CPU tensor under ``POLYKERNEL_TUNE=cached``, with a store
entry (in a temporary ``POLYKERNEL_CACHE_DIR``) naming the torch impl for the call's bucket, so
the memoized decision is tuned and its callable is the chooser. The kernel is swapped for a no-op
in both candidates, so the difference is the chooser alone: the decision running the chooser
(one ``numel()`` per tensor argument, a dict lookup, the slot's impl) against the same decision
running the no-op directly, as an untuned decision does. Timed interleaved, best round of
``--rounds`` (see ``overhead.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import _noop, interleaved_best_us

from polykernel.tools.rows import RowFile, announce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    os.environ["POLYKERNEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="polykernel-by-size-")
    os.environ["POLYKERNEL_TUNE"] = "cached"
    import polykernel
    from polykernel import tuning
    from polykernel.core import registry
    from polykernel.tuning import key as tuning_key

    torch.set_num_threads(1)
    # one interleaved table (its figures exist once all rounds end): the row; then the old keys
    announce(2, per_case_s=args.rounds * args.calls * 1e-6 + 0.5, what="candidates timed interleaved", path=args.json)
    out = RowFile(args.json, {"torch": torch.__version__}, echo=lambda line: line and print(line, flush=True))
    x, w = torch.randn(1, 64), torch.randn(64)
    op = registry.get_op("rms_norm")
    tuning.store().put({tuning_key.key(op, op.key(x, w), [x, w]): {"eager": "torch", "graph": "torch", "times": {}}})
    polykernel.clear_caches()
    polykernel.rms_norm(x, w)
    (d,) = [d for d in op._memo.values() if d.by_size is not None]
    assert d.source == "tuned", d.source
    chooser = d.fn
    for slot in d.by_size.slots.values():
        slot.run.fn = _noop
    try:

        def plain() -> object:
            d.fn = _noop
            return polykernel.rms_norm(x, w)

        def tuned() -> object:
            d.fn = chooser
            return polykernel.rms_norm(x, w)

        # Interleaved rounds swap `d.fn` once per batch (the first call of a batch sets it).
        best = interleaved_best_us(
            {"untuned decision -> no-op": plain, "tuned decision (chooser) -> no-op": tuned}, args.rounds, args.calls
        )
    finally:
        d.fn = chooser
    added = best["tuned decision (chooser) -> no-op"] - best["untuned decision -> no-op"]
    out.add({"table": "best_us", **best, "chooser_added_us": added}, "")
    print(f"torch {torch.__version__}, 1x64 fp32 on CPU, interleaved, best of {args.rounds} rounds of {args.calls} calls, us per call")
    for name, t in best.items():
        print(f"  {name:<36} {t:7.3f} us")
    print(f"  chooser adds {added:+.3f} us per call")
    out.finish(best_us=best, chooser_added_us=added)


if __name__ == "__main__":
    main()
