"""rms_norm's generated dispatch against the earlier templates, in one process.

    PYTHONPATH=src python benchmarks/host/hot_path_templates.py [--repeats 5] [--rounds 100] [--json FILE]

The A/B of ``ab_overhead.sh`` runs each tree in processes of its own, and on the H200 hosts those
processes spread by up to 2x (0.52-1.34 µs for one tree on 2026-12-05): a few percent between trees
drowns there. Here the templates run interleaved in one process, on the same decision records and
tensors, so only the generated code differs. The earlier ones are rebuilt from this tree's source:

- ``ed50770`` (the tree issue 36 was filed on): a loop over the records, the whole compile check
  (``dynamo_compiling() or compiler_mod._is_compiling_flag``) first, no forward-AD check;
- ``e40d92d``: the same plus the forward-AD check (a dual level open?);
- this tree: the last record tested before the loop, with the scope and deterministic flag read
  in its test; Dynamo's check alone first (the rest of a compile reaches the slow path:
  ``polykernel.core.hot_path._TRACING_EXPR``); no subclass check where the guard saw every tensor.

The impl is a no-op, the tensors 1x64 fp32 on the CPU (``--device cuda``: on the GPU, where the
decision is an impl that reads raw memory, so the subclass check counts), one thread. Each repeat is one row: every
template's best round of ``--calls`` calls, and this tree's ratio to ``ed50770``.
"""

from __future__ import annotations

import argparse
import linecache
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import polykernel
from polykernel.core import codegen, hot_path, registry
from polykernel.tools.rows import RowFile, announce

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timer import interleaved_best_us


def _noop(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    return x


def _templates(op: Any) -> dict[str, str]:
    """This tree's dispatch source and the two earlier templates, written from its pieces (the
    signature, the arguments, the record test, the subclass check) as those trees generated them."""
    now = "".join(linecache.getlines(op.dispatch.__code__.co_filename))
    sig = now.splitlines()[0]
    args = re.search(r"return op\.custom_op\(impl, (.*)\)\n", now)
    test = re.search(r"\n                if (.*):\n                    break\n", now)
    if args is None or test is None or "scope is f[3] and dt is f[4]" not in test.group(1):
        raise SystemExit("the generated dispatch is not the one this script knows: update its templates")
    call, tup = args.group(1), f"({args.group(1)},)"
    plain = " and ".join(f"type(a{i}) in P" for i in hot_path._tensor_positions(op.reference))
    check = "dynamo_compiling() or compiler_mod._is_compiling_flag"
    forward_ad = f"    if fwad._current_level >= 0:\n        return op.forward_ad(impl, {tup})\n"
    body = (
        f"    scope = scope_get()\n    dt = det()\n    for f in fast:\n        try:\n            if {test.group(1)}:\n"
        f"                break\n        except Exception:\n            pass\n    else:\n"
        f"        return slow(impl, {tup}, scope, dt, grad())\n    try:\n        if f is not fast[0]:\n"
        f"            fast.remove(f)\n            fast.insert(0, f)\n    except (ValueError, IndexError):\n"
        f"        pass\n    d = f[5]\n    if d.guarded:\n        if d.cuda and capturing():\n"
        f"            d = op._captured(d.key, {tup})\n        if d.raw and not ({plain}):\n"
        f"            d = op._subclass(d.key, {tup}, d)\n    try:\n        return d.fn({call})\n"
        f"    except Exception as exc:\n        return d.on_fault(exc, {tup})\n"
    )
    head = f"{sig}\n    if {check}:\n        return op.custom_op(impl, {call})\n"
    return {"ed50770": head + body, "e40d92d": head + forward_ad + body, "this tree": now}


def _namespace(op: Any) -> dict[str, Any]:
    """The names the generated code reads (``hot_path._exec``'s namespace for this op)."""
    seen: dict[str, Any] = {}
    define = codegen.define

    def grab(src: str, filename: str, name: str, namespace: dict[str, Any]) -> Callable[..., Any]:
        seen.update(namespace)
        return define(src, filename, name, namespace)

    codegen.define = grab  # type: ignore[assignment]
    try:
        hot_path._hot_dispatch(op)
    finally:
        codegen.define = define  # type: ignore[assignment]
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--json", help="keep the rows here, written as measured")
    p.add_argument("--device", default="cpu", help="where the tensors live (cuda: the decision is a GPU impl's)")
    a = p.parse_args()
    torch.set_num_threads(1)
    x, w = torch.randn(1, 64, device=a.device), torch.randn(64, device=a.device)
    polykernel.rms_norm(x, w)  # the decision and its guard record
    op = registry.get_op("rms_norm")
    if not op._fast:
        raise SystemExit("no guard record (no hot-path guard in this torch): nothing to compare")
    decision = op._fast[0][5]
    for d in op._memo.values():
        d.fn = _noop
    namespace = _namespace(op)
    fns = {}
    for name, src in _templates(op).items():
        ns = dict(namespace)
        exec(compile(src, f"<{name} template>", "exec"), ns)
        fns[name] = ns["dispatch"]
        assert fns[name](None, x, w) is x, name
    announce(a.repeats, per_case_s=a.rounds * a.calls * len(fns) * 0.6e-6 + 0.5, what="repeats", path=a.json)
    out = RowFile(
        a.json,
        {
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "device": a.device,
            "impl": decision.impl,
            "calls": a.calls,
            "rounds": a.rounds,
        },
    )
    cands = {name: (lambda fn: lambda: fn(None, x, w))(fn) for name, fn in fns.items()}
    for _ in range(a.repeats):
        best = interleaved_best_us(cands, a.rounds, a.calls)
        ratio = best["this tree"] / best["ed50770"]
        out.add({**best, "this_over_ed50770": ratio}, "  ".join(f"{k} {v:.4f} us" for k, v in best.items()) + f"  this/ed50770 {ratio:.3f}")
    out.finish()


if __name__ == "__main__":
    main()
