"""``polykernel tune OP... [--shapes 4096x4096,...] [--dtype bfloat16] [--grad]``: fill the tuning
store ahead of time.

For every op, shape and dtype it builds the op's example arguments (``Op.example``), measures
every runnable impl on them (as ``POLYKERNEL_TUNE=on`` would on first sight) and stores the choice.
Under ``torchrun`` every rank measures its own device, the times are gathered, and rank 0 stores
the choice made from the slowest rank's times (so one slow GPU is not tuned for as if it were
the fast one).

In one process each case's decision is stored as soon as the case is measured (merged into the
store file under its lock, as any writer's), so a run cut by a time limit (SIGTERM) or Ctrl-C
keeps every finished case; Ctrl-C ends with how many decisions were stored and where. Under
``torchrun`` the ranks' times are gathered once, at the end (the collectives stay in lockstep):
a distributed run that is cut stores nothing.

::

    $ polykernel tune rms_norm softmax --shapes 4096x4096,16384x4096 --dtype bfloat16
    $ torchrun --nproc-per-node 8 -m polykernel tune rms_norm --grad
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from polykernel.tools import options
from polykernel.tools.console import make_console, progress, table

_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _shapes(text: str) -> list[tuple[int, ...]]:
    out = [options.shape(part, "--shapes") for part in text.split(",") if part.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: expected sizes like 4096x4096,1024x8192")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ops", nargs="+", metavar="OP", help="op ids or bare names (rms_norm softmax ...)")
    p.add_argument("--shapes", type=_shapes, help="comma-separated example shapes (default: the bench shapes of each op)")
    p.add_argument("--dtype", action="append", choices=_DTYPES, help="repeatable (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--grad", action="store_true", help="tune forward+backward (inputs require grad)")
    p.add_argument("--device", help="default: cuda (this rank's GPU under torchrun), else cpu")
    p.add_argument("--json", action="store_true", help="print the stored entries as JSON")


def _init_distributed() -> tuple[Any, bool]:
    """(torch.distributed or None, whether this call initialized it)."""
    if int(os.environ.get("WORLD_SIZE", "1") or "1") <= 1:
        return None, False
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist, False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist, True


def run_cli(args: argparse.Namespace) -> int:
    import torch

    from polykernel import tuning
    from polykernel.core import registry

    dist, owned = _init_distributed()
    try:
        default = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        device = options.device(args.device) if args.device else default
        cuda = torch.device(device).type == "cuda"
        dtypes = [getattr(torch, d) for d in (args.dtype or (["bfloat16"] if cuda else ["float32"]))]
        ops = [registry.get_op(op) for op in args.ops]
        unmeasured = []
        con = getattr(args, "console", None) or make_console(sys.stderr if args.json else None)  # stdout: the JSON
        cases = []
        for op in ops:
            if args.shapes:
                shapes = args.shapes
            else:
                from polykernel.tools.bench import SHAPES

                shapes = [s for _, s in SHAPES.get(op.name) or op.bench_shapes]
                if not shapes:
                    raise ValueError(f"{op.id}: no default shapes; give --shapes")
            cases += [(op, shape, dtype) for shape in shapes for dtype in dtypes]
        stored = 0  # decisions stored so far (one process)

        def keep(records: list[dict[str, Any]]) -> None:
            # Decide from every record so far: a key met by several cases (one size bucket) gets
            # the slowest times, as at the end; putting all again writes entries a busy file
            # lock left in memory (clear_caches drops the in-memory store before the next case).
            nonlocal stored
            stored = len(tuning.decide_and_store(records, persist=True))

        try:
            records = _measure(cases, args.grad, device, con, unmeasured, None if dist is not None else keep)
        except KeyboardInterrupt:
            if dist is not None:
                raise KeyboardInterrupt("no decision stored (under torchrun they are stored at the end of the run)") from None
            raise KeyboardInterrupt(f"{stored} decision{'s' * (stored != 1)} stored in {_where()}") from None
        if dist is not None:  # every rank's times (as JSON): rank 0 decides from the slowest
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, _plain(records))
            records = _restored([r for rank_records in gathered for r in rank_records or []])
        rank0 = dist is None or dist.get_rank() == 0
        status = 0
        if rank0:
            entries = tuning.decide_and_store(records, persist=True)  # all of the run's entries
            _report(entries, _where(), args.json, con)
            for line in unmeasured:
                print(line, file=sys.stderr)
            if not entries:  # every case was an override or a key already decided: a run that stored nothing
                print("polykernel tune: nothing was measured; no decision stored", file=sys.stderr)
                status = 1
        if dist is not None:
            dist.barrier()
        return status
    finally:
        if owned and dist is not None:
            dist.destroy_process_group()


def _measure(
    cases: list[tuple[Any, Any, Any]],
    grad: bool,
    device: str,
    con: Any,
    unmeasured: list[str],
    keep: Callable[[list[dict[str, Any]]], None] | None,
) -> list[dict[str, Any]]:
    """Measure every case (``tuning.collecting``'s records); ``keep(records)`` after each case
    that measured something (None: keep nothing as it goes)."""
    import polykernel
    from polykernel import tuning
    from polykernel.core import selection as dispatch

    with tuning.collecting() as records, progress(con) as bar:
        task = bar.add_task("tuning", total=len(cases))
        for op, shape, dtype in cases:
            dispatch.clear_caches()  # every case must be a memo miss (that is where tuning measures)
            case = options.example(op, shape, dtype, device, grad, "--shapes")
            before = len(records)
            bar.update(task, description=f"tuning {op.name} {case.label} {str(dtype).removeprefix('torch.')}{' +grad' if grad else ''}")
            getattr(polykernel, op.name)(*case.args, **case.kwargs)
            if len(records) == before:
                unmeasured.append(f"{op.id} {case.label}: not measured (an impl override or an already-seen key applies)")
            elif keep is not None:
                keep(list(records))
            bar.advance(task)
    return records


def _plain(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records with JSON times (what ``all_gather_object`` sends)."""
    return [{**r, "times": {n: t.as_json() for n, t in r["times"].items()}} for r in records]


def _restored(plain: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from polykernel.tuning.measure import Timing

    return [{**r, "times": {n: Timing.from_json(t) for n, t in r["times"].items()}} for r in plain]


def _where() -> str:
    from polykernel import tuning

    return str(tuning.store().path or "memory only")


def _report(entries: dict[str, dict[str, Any]], where: str, as_json: bool, con: Any) -> None:
    if as_json:
        print(json.dumps({"store": where, "entries": dict(entries)}, indent=1))
        return
    t = table(con, "key", "eager", "graph", "static", "times (ms)", title=f"{len(entries)} decisions stored in {where}")
    for key, entry in entries.items():
        k = json.loads(key)
        times = "; ".join(f"{name} {tm.get('error') or _ms(tm)}" for name, tm in entry["times"].items())
        label = f"{k['op']} {' '.join(k['tensors'])}{' +grad' if k['class'].get('needs_grad') else ''}"
        t.add_row(label, entry["eager"], entry["graph"], entry["static"], times)
    con.print(t)


def _ms(t: dict[str, Any]) -> str:
    host = t.get("host_ms")
    if t.get("gpu_ms") is None:
        return f"wall {host:.4g} ms"
    return f"gpu {t['gpu_ms']:.4g} ms, host {host:.4g} ms"
