"""rms_norm's generated dispatch against the earlier templates, in one process.

    PYTHONPATH=src python benchmarks/host/hot_path_templates.py [--repeats 5] [--rounds 100] [--json FILE]

The A/B of ``ab_overhead.sh`` runs each tree in processes of its own, and on the H200 hosts those
processes spread by up to 2x (0.52-1.34 µs for one tree on 2026-12-05): a few percent between trees
drowns there. Here the templates run interleaved in one process, on the same decision records and
tensors, so only the generated code differs. The earlier ones are rebuilt from this tree's source:

- ``ed50770`` (the tree issue 36 was filed on): a loop over the records, the whole compile check
  (``dynamo_compiling() or compiler_mod._is_compiling_flag``) first, no forward-AD check;
- ``e40d92d``: the same plus the forward-AD check (a dual level open?);
- this tree: the last record tested before the loop, Dynamo's check alone first (the rest of a
  compile reaches the slow path: ``polykernel.core.hot_path._TRACING_EXPR``).

The impl is a no-op, the tensors 1x64 fp32 on the CPU, one thread. Each repeat is one row: every
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

_FORWARD_AD = "    if fwad._current_level >= 0:  # dual tensors: their tangents (see Op.forward_ad)\n"


def _noop(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    return x


def _templates(op: Any) -> dict[str, str]:
    """This tree's dispatch source and the two earlier templates rebuilt from it."""
    now = "".join(linecache.getlines(op.dispatch.__code__.co_filename))
    test = re.search(r"        miss = not \((.*)\)\n", now)
    if test is None or _FORWARD_AD not in now:
        raise SystemExit("the generated dispatch is not the one this script knows: update its templates")
    args = re.search(r"slow\(impl, (\(.*\)), scope", now).group(1)  # type: ignore[union-attr]
    head, tail = now.split("    scope = scope_get()")[0], now.split("    d = f[5]\n")[1]
    loop = (
        f"    scope = scope_get()\n    dt = det()\n    for f in fast:\n        try:\n            if {test.group(1)}:\n"
        f"                break\n        except Exception:\n            pass\n    else:\n"
        f"        return slow(impl, {args}, scope, dt, grad())\n    try:\n        if f is not fast[0]:\n"
        f"            fast.remove(f)\n            fast.insert(0, f)\n    except (ValueError, IndexError):\n"
        f"        pass\n    d = f[5]\n"
    )
    e40 = head.replace("if dynamo_compiling():", "if dynamo_compiling() or compiler_mod._is_compiling_flag:") + loop + tail
    forward_ad = _FORWARD_AD + f"        return op.forward_ad(impl, {args})\n"
    return {"ed50770": e40.replace(forward_ad, ""), "e40d92d": e40, "this tree": now}


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
    a = p.parse_args()
    torch.set_num_threads(1)
    x, w = torch.randn(1, 64), torch.randn(64)
    polykernel.rms_norm(x, w)  # the decision and its guard record
    op = registry.get_op("rms_norm")
    if not op._fast:
        raise SystemExit("no guard record (no hot-path guard in this torch): nothing to compare")
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
    out = RowFile(a.json, {"torch": torch.__version__, "calls": a.calls, "rounds": a.rounds})
    cands = {name: (lambda fn: lambda: fn(None, x, w))(fn) for name, fn in fns.items()}
    for _ in range(a.repeats):
        best = interleaved_best_us(cands, a.rounds, a.calls)
        ratio = best["this tree"] / best["ed50770"]
        out.add({**best, "this_over_ed50770": ratio}, "  ".join(f"{k} {v:.4f} us" for k, v in best.items()) + f"  this/ed50770 {ratio:.3f}")
    out.finish()


if __name__ == "__main__":
    main()
