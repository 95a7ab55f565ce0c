"""Tensor parallel on the CPU: 2 processes, gloo, a 1-D mesh. Every op on DTensors with each
supported placement matches the unsharded op, forward and backward (weight gradients included,
as ``Partial`` that reduce to the full gradient), with the Triton impls (through the interpreter)
on the local shards and with the torch impls; no raw-memory impl ever sees a DTensor; placements
that need a cross-rank reduction take the DTensor-rules (or redistribute) path; ``explain`` says
which path and why.

The two workers run every case in one spawn (~10-20 s on 2 cores) and rank 0 writes a JSON report
that the tests below read.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import traceback
import zlib
from typing import Any

import pytest
import torch

from _tp_llama import finish_worker

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

WORLD = 2


CW = (torch.arange(10) % 3).float()  # class weights for the option cases: 0, 1, 2, 0, ...


def _cases() -> list[tuple[str, str, Any]]:
    """(name, op, builder): builder(mesh) -> (args, kwargs, placements per positional tensor, expected route)."""
    from torch.distributed.tensor import Replicate, Shard

    R, S = Replicate(), Shard

    def rn(shape, dim):
        return lambda: ((torch.randn(shape), 1 + 0.1 * torch.randn(shape[-1])), {}, (S(dim), R))

    def ce(shape, dim, reduction, target=None, **kw):
        def build():
            v = shape[-1]
            t = torch.randint(0, v, shape[:-1])
            t.view(-1)[::3] = -100
            return (torch.randn(shape), t), {"reduction": reduction, **kw}, (S(dim), target or S(dim))

        return build

    def rope(dim, table_b=1, table=None, no_table_grad=True, rd=8, **kw):
        def build():
            q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
            cos, sin = torch.randn(table_b, 6, rd), torch.randn(table_b, 6, rd)
            tp = table if table is not None else R
            return (q, k, cos, sin), kw, (S(dim), S(dim), tp, tp), {2, 3} if no_table_grad else set()

        return build

    def mrope(dim, table_b=1, table=None):
        def build():
            q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
            cos, sin = torch.randn(3, table_b, 6, 8), torch.randn(3, table_b, 6, 8)
            tp = table if table is not None else R
            return (q, k, cos, sin, [1, 2, 1]), {}, (S(dim), S(dim), tp, tp), {2, 3}

        return build

    def flce(scored=True, **kw):
        def build():
            h, w, b = torch.randn(6, 8), torch.randn(10, 8), torch.randn(10)
            t = torch.randint(0, 10, (6,))
            t[1] = -100
            if not scored:  # no row scored on any rank: NaN loss, zero gradients (the reference's)
                t[:] = -100
            return (h, w, t, b), dict(kw), (S(0), R, S(0), R)

        return build

    def moe():
        # tokens sharded with their routing, the experts replicated (dW: partial sums over ranks)
        index = torch.stack([torch.randperm(3)[:2] for _ in range(6)])
        weights = torch.rand(6, 2)
        return (torch.randn(6, 16), index, weights, torch.randn(3, 24, 16) / 4, torch.randn(3, 16, 12) / 4), {}, (S(0), S(0), S(0), R, R)

    def moe_gpt_oss():
        # gpt-oss's layout: the same placements, the biases replicated too
        index = torch.stack([torch.randperm(3)[:2] for _ in range(6)])
        params = (torch.randn(3, 16, 24) / 4, torch.randn(3, 24), torch.randn(3, 12, 16) / 4, torch.randn(3, 16))
        return (torch.randn(6, 16), index, torch.rand(6, 2), *params), {"limit": 1.0}, (S(0), S(0), S(0), R, R, R, R)

    def glu(shape, dim, **kw):
        return lambda: ((torch.randn(shape), torch.randn(shape)), kw, (S(dim), S(dim)))

    local = [
        ("rms_norm-S0", "rms_norm", rn((6, 16), 0)),
        ("rms_norm-S1-of-3d-uneven", "rms_norm", rn((2, 5, 16), 1)),
        (
            "fused_add_rms_norm-S0",
            "fused_add_rms_norm",
            lambda: ((torch.randn(6, 16), torch.randn(6, 16), 1 + 0.1 * torch.randn(16)), {}, (S(0), S(0), R)),
        ),
        (
            "layer_norm-S1",
            "layer_norm",
            lambda: ((torch.randn(2, 5, 16), torch.randn(16), torch.randn(16)), {}, (S(1), R, R)),
        ),
        ("softmax-S0", "softmax", lambda: ((torch.randn(6, 16),), {}, (S(0),))),
        ("swiglu-S0", "swiglu", glu((6, 16), 0)),
        ("swiglu-S-last", "swiglu", glu((6, 16), 1)),
        ("geglu-S-last", "geglu", glu((3, 4, 16), 2, approximate="none")),
        ("rope-batch", "rope", rope(0)),
        ("rope-batch-tables", "rope", rope(0, table_b=2, table=S(0))),
        ("rope-heads", "rope", rope(1)),
        ("rope-seq", "rope", rope(2, table=S(1))),
        ("rope-heads-partial-interleaved", "rope", rope(1, rd=4, interleaved=True)),
        ("rope-seq-partial", "rope", rope(2, table=S(1), rd=6, rotary_dim=6)),
        ("mrope-batch-tables", "mrope", mrope(0, table_b=2, table=S(1))),
        ("mrope-seq", "mrope", mrope(2, table=S(2))),
        ("rope-heads-table-grads", "rope", rope(1, no_table_grad=False)),
        ("cross_entropy-mean", "cross_entropy", ce((6, 10), 0, "mean")),
        ("cross_entropy-sum", "cross_entropy", ce((6, 10), 0, "sum")),
        ("cross_entropy-none-S1", "cross_entropy", ce((2, 5, 10), 1, "none")),
        ("cross_entropy-mean-smoothing-S1", "cross_entropy", ce((2, 5, 10), 1, "mean", label_smoothing=0.1)),
        ("fused_linear_cross_entropy-S0", "fused_linear_cross_entropy", flce()),
        ("fused_linear_cross_entropy-none-scored", "fused_linear_cross_entropy", flce(scored=False)),
        # class weights (some 0; the same on every rank): a weighted mean divides by their sum
        # over the scored targets of all ranks; softcap and z_loss are per row
        ("cross_entropy-mean-weight-softcap-zloss", "cross_entropy", ce((6, 10), 0, "mean", weight=CW, softcap=3.0, z_loss=0.01)),
        ("fused_linear_cross_entropy-weight-softcap", "fused_linear_cross_entropy", flce(ce_weight=CW, softcap=2.0, z_loss=0.01)),
        ("moe_experts-S0", "moe_experts", moe),
        ("moe_experts_gpt_oss-S0", "moe_experts_gpt_oss", moe_gpt_oss),
        (
            "group_norm-S0",
            "group_norm",
            lambda: ((torch.randn(4, 6, 5), 3, 1 + 0.1 * torch.randn(6), torch.randn(6)), {}, (S(0), R, R)),
        ),
        (
            "dyt-S1-of-3d",
            "dyt",
            lambda: ((torch.randn(2, 6, 16), torch.full((1,), 0.6), 1 + 0.1 * torch.randn(16), torch.randn(16)), {}, (S(1), R, R, R)),
        ),
        ("poly_norm-S0", "poly_norm", lambda: ((torch.randn(6, 16), torch.randn(3), torch.tensor(0.2)), {}, (S(0), R, R))),
        ("relu_squared-S-last", "relu_squared", lambda: ((torch.randn(6, 16),), {}, (S(1),))),
    ]
    # (cross_entropy on logits sharded on the class dim runs vocab-parallel: tests/distributed/test_vocab_parallel.py)
    moved = [
        ("rms_norm-S-last", "rms_norm", rn((4, 16), 1)),
        ("softmax-S-last", "softmax", lambda: ((torch.randn(4, 16),), {}, (S(1),))),
        ("rope-S-headdim", "rope", rope(3, table=S(2))),
        ("swiglu-mixed-shards", "swiglu", lambda: ((torch.randn(6, 16), torch.randn(6, 16)), {}, (S(0), S(1)))),
        ("rms_norm-weight-sharded", "rms_norm", lambda: ((torch.randn(6, 16), torch.randn(16)), {}, (S(0), S(0)))),
        ("group_norm-S-channels", "group_norm", lambda: ((torch.randn(4, 6, 5), 3, torch.randn(6), torch.randn(6)), {}, (S(1), R, R))),
        ("poly_norm-S-last", "poly_norm", lambda: ((torch.randn(6, 16), torch.randn(3), torch.tensor(0.2)), {}, (S(1), R, R))),
    ]
    return [(n, op, b, "local") for n, op, b in local] + [(n, op, b, "moved") for n, op, b in moved]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, where NaN in both is equal and NaN in one only is infinitely far."""
    if not b.numel():
        return 0.0
    both = a.isnan() & b.isnan()
    return (a - b).abs().masked_fill(both, 0.0).nan_to_num(nan=math.inf).max().item()


def _outputs(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def _run_case(mesh, name, op_name, build, mode, raw_seen):
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    import polykernel

    fn = getattr(polykernel, op_name)
    torch.manual_seed(zlib.crc32(name.encode()) % 1000)  # the same data in every process (hash() is salted per process)
    args, kwargs, placements, *rest = build()
    nograd = rest[0] if rest else set()
    # the reference: the same op on the whole tensors (same impl family)
    ref_args = [
        a.clone().requires_grad_(a.is_floating_point() and i not in nograd) if isinstance(a, torch.Tensor) else a
        for i, a in enumerate(args)
    ]
    ref = _outputs(fn(*ref_args, **kwargs))
    cots = [torch.randn(o.shape) if o.dim() else torch.tensor(0.7) for o in ref]
    sum(((o * c).sum() for o, c in zip(ref, cots)), torch.tensor(0.0)).backward()

    dargs, it = [], iter(placements)
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            d = distribute_tensor(a, mesh, [next(it)])
            dargs.append(d.requires_grad_() if a.is_floating_point() and i not in nograd else d)
        else:
            dargs.append(a)
    # tensor options (class weights): replicated, no gradient
    dkwargs = {k: distribute_tensor(v, mesh, [Replicate()]) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    n_raw = len(raw_seen)
    got = _outputs(fn(*dargs, **dkwargs))
    assert all(isinstance(o, DTensor) for o in got), [type(o) for o in got]
    loss = sum(((o * (distribute_tensor(c, mesh, o.placements) if o.dim() else c)).sum() for o, c in zip(got, cots)))
    loss.backward()
    report = {"name": name, "op": op_name, "mode": mode, "fwd": 0.0, "bwd": 0.0, "problems": []}
    for g, r in zip(got, ref):
        report["fwd"] = max(report["fwd"], _max_diff(g.full_tensor(), r.detach()))
    for i, (d, r) in enumerate(zip(dargs, ref_args)):
        if not isinstance(d, DTensor) or not d.requires_grad:
            continue
        if d.grad is None:
            report["problems"].append(f"arg {i}: no gradient")
            continue
        report["bwd"] = max(report["bwd"], _max_diff(d.grad.full_tensor(), r.grad))
        want = list(d.placements)
        if any(p.is_shard() for p in dargs[0].placements) and all(p.is_replicate() for p in d.placements):
            want = [Partial()]  # a replicated input of sharded rows
        report.setdefault("grad_placements", []).append([str(p) for p in d.grad.placements])
        report.setdefault("want_grad_placements", []).append([str(p) for p in want])
    report["out_placements"] = [str(p) for o in got for p in o.placements]
    report["raw_on_dtensor"] = [c for c in raw_seen[n_raw:] if "DTensor" in c[2]]
    report["raw_impls"] = sorted({c[1] for c in raw_seen[n_raw:]})
    report["explain"] = str(polykernel.explain(op_name, *dargs, **dkwargs))
    report["decisions"] = [(d["op"], d["impl"], d.get("subclass")) for d in polykernel.decisions()]
    return report


def _install_raw_spy(raw_seen):
    """Record every call of an impl that reads raw memory (Triton, peers) with its argument types."""
    import polykernel
    from polykernel.core import registry

    for op_id in registry.all_op_ids():
        op = registry.get_op(op_id)
        for name, spec in registry.specs_for(op).items():
            if spec.accepts_subclasses:
                continue
            try:
                fn = registry.load_impl(spec)
            except Exception:
                continue

            def spy(*a, _fn=fn, _name=name, _op=op_id):
                raw_seen.append((_op, _name, [type(x).__name__ for x in a if isinstance(x, torch.Tensor)]))
                return _fn(*a)

            registry.REGISTRY._preloaded[(op_id, name)] = spy
    polykernel.clear_caches()


def _worker(rank: int, init_file: str, out_file: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    reports: list[dict[str, Any]] = []
    try:
        from torch.distributed.device_mesh import init_device_mesh

        import polykernel
        from polykernel import ops  # noqa: F401  (registers every op)

        for m in polykernel.ops.OP_MODULES.values():
            __import__(m)
        mesh = init_device_mesh("cpu", (WORLD,))
        raw_seen: list[Any] = []
        _install_raw_spy(raw_seen)
        for mode in ("triton", "torch"):
            for name, op_name, build, route in _cases():
                polykernel.clear_caches()
                try:
                    with polykernel.use_impl(mode):
                        r = _run_case(mesh, name, op_name, build, mode, raw_seen)
                except Exception as exc:
                    r = {"name": name, "op": op_name, "mode": mode, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
                r["route"] = route
                reports.append(r)
        # strict mode: a redistribution is an error naming the op, before any collective
        polykernel.clear_caches()
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        x = distribute_tensor(torch.randn(4, 16), mesh, [Shard(1)])
        w = distribute_tensor(torch.ones(16), mesh, [Replicate()])
        os.environ["POLYKERNEL_STRICT"] = "1"
        try:
            polykernel.rms_norm(x, w)
            strict = "no error"
        except Exception as exc:
            strict = f"{type(exc).__name__}: {exc}"
        finally:
            del os.environ["POLYKERNEL_STRICT"]
        reports.append({"name": "strict", "error_text": strict})
        try:  # a plain tensor among DTensors: a named error, not a kernel on mixed memory
            polykernel.rms_norm(x, torch.ones(16))
            mixed = "no error"
        except Exception as exc:
            mixed = f"{type(exc).__name__}: {exc}"
        reports.append({"name": "mixed", "error_text": mixed})
        # a decision memoized for plain tensors never captures a DTensor call
        polykernel.clear_caches()
        xs = distribute_tensor(torch.randn(4, 16), mesh, [Shard(0)])
        n = len(raw_seen)
        plain = polykernel.rms_norm(torch.randn(2, 16), torch.ones(16))
        got = polykernel.rms_norm(xs, w)
        reports.append(
            {
                "name": "after-plain",
                "raw": [c[1] for c in raw_seen[n:]],
                "placements": [str(p) for p in got.placements],
                "types": [type(plain).__name__, type(got).__name__],
            }
        )
    finally:
        finish_worker(rank, reports, out_file)


@pytest.fixture(scope="module")
def report() -> dict[tuple[str, str], dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="polykernel-dtensor-") as tmp:
        init_file, out_file = os.path.join(tmp, "store"), os.path.join(tmp, "report.json")
        mp.start_processes(_worker, args=(init_file, out_file), nprocs=WORLD, join=True, start_method="spawn")
        with open(out_file) as f:
            rows = json.load(f)
        if os.environ.get("PK_DTENSOR_DUMP"):
            with open(os.environ["PK_DTENSOR_DUMP"], "w") as f:
                json.dump(rows, f, indent=1)
    return {(r["name"], r.get("mode", "")): r for r in rows}


CASE_NAMES = [(n, route) for n, _, _, route in _cases()] if torch.distributed.is_available() else []


@pytest.mark.parametrize("mode", ["triton", "torch"])
@pytest.mark.parametrize(("name", "route"), CASE_NAMES, ids=[n for n, _ in CASE_NAMES])
def test_op_on_dtensors_matches_unsharded(report, name, route, mode):
    r = report[(name, mode)]
    assert "error" not in r, r.get("tb")
    assert r["problems"] == []
    assert r["fwd"] <= 1e-5, r
    assert r["bwd"] <= 1e-4, r
    assert r["raw_on_dtensor"] == [], "a raw-memory impl was handed a DTensor"
    if route == "local" and mode == "triton" and "table-grads" not in name:  # triton rope has no cos/sin grads
        assert r["raw_impls"] == ["triton"], r["raw_impls"]  # the fast impl ran, on the shards
        assert r["grad_placements"] == r["want_grad_placements"]
        assert "route: DTensor Shard(" in r["explain"] and "on mesh of 2: triton on local shards" in r["explain"], r["explain"]
        assert any(impl == "triton" and sub is None for _, impl, sub in r["decisions"])
    if route == "moved" and mode == "triton":
        assert r["raw_impls"] == ["triton"], r["raw_impls"]  # redistributed, then the fast impl on shards
        assert "redistributed (" in r["explain"] and ", then triton on local shards" in r["explain"], r["explain"]
    if mode == "torch":
        assert r["raw_impls"] == []
        assert all(impl == "torch" for _, impl, _ in r["decisions"])


def test_explain_words_each_route(report):
    local = report[("rms_norm-S0", "triton")]["explain"]
    assert "route: DTensor Shard(0) on mesh of 2: triton on local shards" in local
    moved = report[("rms_norm-S-last", "triton")]["explain"]
    assert "route: DTensor Shard(1) on mesh of 2: redistributed (x Shard(1) -> Replicate() (it is sharded on dim 1: it is the dim" in moved
    weight = report[("rms_norm-weight-sharded", "triton")]["explain"]
    assert "weight Shard(0) -> Replicate() (with x Shard(0))" in weight
    rope = report[("rope-S-headdim", "triton")]["explain"]
    assert "it is the head dim D, which the rotation mixes" in rope


def test_strict_mode_refuses_a_redistribution(report):
    text = report[("strict", "")]["error_text"]
    assert text.startswith("ImplNotAvailableError") and "norm.rms_norm" in text and "needs a redistribution" in text, text


def test_plain_tensor_mixed_with_dtensors_is_a_named_error(report):
    text = report[("mixed", "")]["error_text"]
    assert text.startswith("OpTypeError") and "norm.rms_norm" in text and "weight" in text, text


def test_plain_decision_does_not_capture_dtensor_calls(report):
    r = report[("after-plain", "")]
    assert r["raw"] == ["triton", "triton"]  # the plain call, then the shards of the DTensor call
    assert r["placements"] == ["S(0)"] and r["types"] == ["Tensor", "DTensor"]


def test_the_ops_with_a_layout_are_routed_and_an_op_added_later_too():
    """Importing the DTensor route routes every op whose own facts hold a layout
    (``Op.dtensor_layout``; see dispatch.routed), and an op created later with one; an op without
    one stays off the subclass check. In a subprocess: the toy ops stay out of this one."""
    import subprocess
    import sys

    code = """
import torch
from polykernel.core import registry, selection as dispatch
from polykernel.core.op import Op
from polykernel.distributed import dtensor
from polykernel.distributed.layout import ROWS, Layout, rows_with

laid_out = sorted(i for i in registry.all_op_ids() if registry.get_op(i).dtensor_layout is not None)
assert "norm.rms_norm" in laid_out and sorted(dispatch.routed) == laid_out == sorted(dtensor.LAYOUTS), laid_out

def ref(x: torch.Tensor) -> torch.Tensor:
    return x * 2

common = dict(fields=("device", "dtype", "needs_grad"), key=lambda x: (x.device, x.dtype, False),
              default_key=lambda device, dtype: (device, dtype, False), reference=ref, error_model=None,
              dtypes=(torch.float32,), cases=lambda device, dtype: [], example=None)
Op("toy.laid_out", dtensor_layout=Layout(ROWS, rows_with(), (0,)), **common)
Op("toy.not_laid_out", **common)
assert "toy.laid_out" in dispatch.routed and "toy.not_laid_out" not in dispatch.routed
assert dtensor.LAYOUTS["toy.laid_out"].lead_dims == ROWS and "toy.not_laid_out" not in dtensor.LAYOUTS
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
