"""Vocab-parallel losses on the CPU (gloo; 2 and 4 spawned ranks, one spawn per world size):
``cross_entropy`` on logits ``Shard(-1)`` and ``fused_linear_cross_entropy`` on a weight (and
bias) ``Shard(0)`` give the unsharded reference's loss and gradients (logits / hidden / weight /
bias) for every option, uneven vocabulary shards (V not divisible by the world size, an empty
slice), targets owned unevenly by the ranks; the options being added to the single-device ops
(softcap, z_loss, class weight) match a plain-torch formula; ranks calling with different shapes
get an error naming the op and the argument; ``explain`` says the call holds a collective; and a
``parallelize_module``'d tiny Llama with a colwise ``lm_head``, patched, keeps the fused loss
(vocab-parallel: the weight is never gathered) with the unsharded model's loss and gradients.

Each worker runs every case and rank 0 writes a JSON report that the tests read.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import sys
import traceback
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _tp_llama import finish_worker, run_job, spawn_report

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

CE, FLCE = "loss.cross_entropy", "loss.fused_linear_cross_entropy"


def _targets(n: int, v: int, *, ignored: float = 0.3, owner_low: bool = False) -> torch.Tensor:
    """Targets with some ignored; ``owner_low``: all in the first few classes (rank 0's slice), so
    the ranks own very different numbers of targets."""
    t = torch.randint(0, max(1, v // 4) if owner_low else v, (n,))
    return t.masked_fill(torch.rand(n) < ignored, -100)


def _ce_cases() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, builder args, kwargs)."""
    return [
        ("mean", {"n": 9, "v": 12}, {}),
        ("sum-uneven-V", {"n": 7, "v": 13}, {"reduction": "sum"}),
        ("none-3d", {"shape": (2, 3, 10)}, {"reduction": "none"}),
        ("smoothing-uneven-owners", {"n": 8, "v": 11, "owner_low": True}, {"label_smoothing": 0.2}),
        (
            "ignore7-none-smooth",
            {"n": 6, "v": 10, "ignore7": True, "ignored": 0.0},
            {"ignore_index": 7, "reduction": "none", "label_smoothing": 0.1},
        ),
        ("all-ignored", {"n": 5, "v": 10, "ignored": 1.0}, {}),
        ("V-below-world", {"n": 4, "v": 3}, {"label_smoothing": 0.1}),
    ]


def _flce_cases() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [
        ("mean-bias", {"n": 9, "h": 8, "v": 12, "bias": True}, {}),
        ("sum-uneven-V", {"n": 7, "h": 8, "v": 13}, {"reduction": "sum"}),
        ("none-bias-smooth", {"n": 6, "h": 8, "v": 11, "bias": True}, {"reduction": "none", "label_smoothing": 0.2}),
        ("3d-uneven-owners", {"shape": (2, 3, 8), "v": 10, "owner_low": True}, {}),
        ("hidden-rows-sharded", {"n": 8, "h": 8, "v": 10, "hidden_shard": True}, {"label_smoothing": 0.1}),
        ("all-ignored-sum", {"n": 5, "h": 8, "v": 10, "ignored": 1.0, "bias": True}, {"reduction": "sum"}),
        ("V-below-world", {"n": 4, "h": 8, "v": 3, "bias": True}, {"reduction": "sum"}),
    ]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if not b.numel():
        return 0.0
    both = a.isnan() & b.isnan()
    return (a.double() - b.double()).abs().masked_fill(both, 0.0).nan_to_num(nan=math.inf).max().item()


def _cot(ref: torch.Tensor) -> torch.Tensor:
    return torch.randn(ref.shape, dtype=ref.dtype) if ref.dim() else torch.tensor(0.7, dtype=ref.dtype)


def _compare(got: Any, ref: torch.Tensor, pairs: list[tuple[str, Any, torch.Tensor]], cot: torch.Tensor) -> dict[str, Any]:
    """Loss and gradients of the DTensor call against the reference's (``pairs``: name, DTensor
    argument, reference leaf)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {"placements": [str(p) for p in got.placements], "is_dtensor": isinstance(got, DTensor)}
    out["fwd"] = _max_diff(got.full_tensor(), ref.detach())
    (got * (distribute_tensor(cot, got.device_mesh, got.placements) if got.dim() else cot)).sum().backward()
    (ref * cot).sum().backward()
    out["bwd"], out["grad_placements"] = {}, {}
    for name, d, r in pairs:
        if d.grad is None:
            out["bwd"][name] = "no gradient"
            continue
        out["bwd"][name] = _max_diff(d.grad.full_tensor(), r.grad)
        out["grad_placements"][name] = [str(p) for p in d.grad.placements]
    return out


def _run_ce(mesh: Any, kw: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import polykernel
    from polykernel.ops import cross_entropy as ce

    shape = kw.get("shape") or (kw["n"], kw["v"])
    v = shape[-1]
    x = 3 * torch.randn(shape)
    t = _targets(math.prod(shape[:-1]), v, ignored=kw.get("ignored", 0.3), owner_low=kw.get("owner_low", False)).reshape(shape[:-1])
    if kw.get("ignore7"):
        t[::2] = 7
    ref_x = x.clone().requires_grad_()
    ref = ce.reference(ref_x, t, **opts)
    dx = distribute_tensor(x, mesh, [Shard(x.dim() - 1)]).requires_grad_()
    dt = distribute_tensor(t, mesh, [Replicate()])
    before = _decided()
    got = polykernel.cross_entropy(dx, dt, **opts)
    r_decided = sorted(_decided() - before)
    r = _compare(got, ref, [("logits", dx, ref_x)], _cot(ref))
    r["logits_unchanged"] = bool(torch.equal(dx.detach().full_tensor(), x))  # the backward works in its own buffers
    r["explain"] = polykernel.explain("cross_entropy", dx, dt, **opts).route
    r["decided"] = r_decided
    return r


def _decided() -> set[tuple[str, str, str, str]]:
    """What ``decisions()`` says ran: (op, impl, source, subclass)."""
    import polykernel

    return {(d["op"], d["impl"], d["source"], d.get("subclass", "")) for d in polykernel.decisions()}


def _run_flce(mesh: Any, kw: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import polykernel
    from polykernel.ops import fused_linear_cross_entropy as flce

    hshape = kw.get("shape") or (kw["n"], kw["h"])
    v, hs = kw["v"], hshape[-1]
    h, w = torch.randn(hshape), 2 * torch.randn(v, hs) / hs**0.5
    b = torch.randn(v) if kw.get("bias") else None
    t = _targets(math.prod(hshape[:-1]), v, ignored=kw.get("ignored", 0.3), owner_low=kw.get("owner_low", False)).reshape(hshape[:-1])
    leaves = [a.clone().requires_grad_() if a is not None else None for a in (h, w, b)]
    ref = flce.reference(leaves[0], leaves[1], t, leaves[2], **opts)
    dh = distribute_tensor(h, mesh, [Shard(0) if kw.get("hidden_shard") else Replicate()]).requires_grad_()
    dw = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    db = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_() if b is not None else None
    dt = distribute_tensor(t, mesh, [Shard(0) if kw.get("hidden_shard") else Replicate()])
    got = polykernel.fused_linear_cross_entropy(dh, dw, dt, db, **opts)
    pairs = [("hidden", dh, leaves[0]), ("weight", dw, leaves[1])] + ([("bias", db, leaves[2])] if b is not None else [])
    r = _compare(got, ref, pairs, _cot(ref))
    r["explain"] = polykernel.explain("fused_linear_cross_entropy", dh, dw, dt, db, **opts).route
    return r


def _formula(z: torch.Tensor, t: torch.Tensor, *, cw, softcap, z_loss, eps, reduction, ignore_index=-100) -> torch.Tensor:
    """The options' semantics in plain torch (fp64): softcap before the lse, PyTorch's class
    weights and smoothing, z_loss·w[t]·lse² per scored row; "mean" over Σ w[t] (the single-device
    ops' semantics)."""
    z = z.double()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    per = F.cross_entropy(
        z, t, weight=None if cw is None else cw.double(), ignore_index=ignore_index, label_smoothing=eps, reduction="none"
    )
    valid = t != ignore_index
    wt = valid.double() if cw is None else torch.where(valid, cw.double()[t.clamp(min=0)], 0.0)
    per = per + z_loss * wt * torch.logsumexp(z, -1) ** 2
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    return per.sum() / wt.sum()


OPTION_CASES = [
    ("softcap", {"softcap": 3.0}),
    ("z_loss", {"z_loss": 1e-2}),
    ("class-weight-smooth", {"cw": True, "eps": 0.1}),
    ("all", {"softcap": 2.5, "z_loss": 1e-3, "cw": True, "eps": 0.2}),
]


def _run_options(mesh: Any, kind: str, opts: dict[str, Any], reduction: str) -> dict[str, Any]:
    """The vocab-parallel path with the options that the single-device ops are getting (called
    through polykernel.distributed.vocab directly, as the ops will once they take them)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from polykernel.distributed import vocab

    n, hs, v = 9, 8, 13
    t = _targets(n, v)
    cw = torch.rand(v) + 0.5 if opts.get("cw") else None
    o = {"softcap": opts.get("softcap"), "z_loss": opts.get("z_loss", 0.0), "eps": opts.get("eps", 0.0), "reduction": reduction}
    dt = distribute_tensor(t, mesh, [Replicate()])
    dcw = distribute_tensor(cw, mesh, [Replicate()]) if cw is not None else None
    common = {"target": dt, "ignore_index": -100, "label_smoothing": o["eps"], "reduction": reduction}
    common |= {"softcap": o["softcap"], "z_loss": o["z_loss"]}
    if kind == "logits":
        x = 3 * torch.randn(n, v)
        leaf = x.clone().requires_grad_()
        ref = _formula(leaf, t, cw=cw, **o)
        dx = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
        args = {"logits": dx, **common, "weight": dcw}
        pairs = [("logits", dx, leaf)]
    else:
        h, w, b = torch.randn(n, hs), 2 * torch.randn(v, hs) / hs**0.5, torch.randn(v)
        leaves = [a.clone().requires_grad_() for a in (h, w, b)]
        ref = _formula(F.linear(*leaves), t, cw=cw, **o)
        dh = distribute_tensor(h, mesh, [Replicate()]).requires_grad_()
        dw = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        db = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_()
        args = {"hidden": dh, "weight": dw, "bias": db, **common, "ce_weight": dcw}
        pairs = [("hidden", dh, leaves[0]), ("weight", dw, leaves[1]), ("bias", db, leaves[2])]
    op_id = CE if kind == "logits" else FLCE
    vp = vocab.vocab_plan(op_id, kind, tuple(args), tuple(args.values()))
    got = vocab.run(op_id, vp)
    return _compare(got, ref.float(), pairs, _cot(ref.float()))


def _mismatch(mesh: Any, rank: int, kind: str) -> str:
    """Rank 1 calls with one more row than the others: every rank gets the error."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import polykernel

    n = 5 + (rank == 1)
    t = DTensor.from_local(torch.randint(0, 8, (n,)), mesh, [Replicate()], run_check=False)
    try:
        if kind == "logits":
            polykernel.cross_entropy(DTensor.from_local(torch.randn(n, 4), mesh, [Shard(1)], run_check=False), t)
        else:
            h = DTensor.from_local(torch.randn(n, 6), mesh, [Replicate()], run_check=False)
            w = DTensor.from_local(torch.randn(4, 6), mesh, [Shard(0)], run_check=False)
            polykernel.fused_linear_cross_entropy(h, w, t)
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _fallbacks(mesh: Any, world: int) -> dict[str, Any]:
    """What takes the gather path: an argument the vocab-parallel path does not know (an option
    added to the op later) and, with 4 ranks, a 2-D mesh (still the right loss, gathered)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import polykernel
    from polykernel.distributed import vocab
    from polykernel.ops import cross_entropy as ce

    x, t = torch.randn(8, 12), _targets(8, 12)
    dx, dt = distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(t, mesh, [Replicate()])
    names = ("logits", "target", "ignore_index", "label_smoothing", "reduction")
    values = (dx, dt, -100, 0.0, "mean")
    out = {
        "known": vocab.vocab_plan(CE, "logits", names, values) is not None,
        "unknown-set": vocab.vocab_plan(CE, "logits", (*names, "mystery"), (*values, 1.5)) is not None,
        "unknown-off": vocab.vocab_plan(CE, "logits", (*names, "mystery"), (*values, None)) is not None,
    }
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2))
        d2 = distribute_tensor(x, mesh2, [Shard(0), Shard(1)]).requires_grad_()
        t2 = distribute_tensor(t, mesh2, [Shard(0), Replicate()])
        got = polykernel.cross_entropy(d2, t2)
        out["2d-fwd"] = _max_diff(got.full_tensor(), ce.reference(x, t))
        out["2d-route"] = polykernel.explain("cross_entropy", d2, t2).route
    return out


def _llama(mesh: Any) -> dict[str, Any]:
    """Patched and unpatched TP Llama (colwise lm_head) against the unsharded model."""
    from test_tp_transformers import _model, _step

    from _tp_llama import full_grads, parallelize_llama
    from polykernel.distributed import dtensor, vocab
    from polykernel.integrations import transformers as pkt

    base = _model()
    loss, grads = _step(copy.deepcopy(base))
    out: dict[str, Any] = {"plain": loss}
    calls: list[str] = []
    run = vocab.run

    def spy(op_id, vp):
        calls.append(f"{op_id} {vp.text}")
        return run(op_id, vp)

    vocab.run = spy
    gathered: list[str] = []
    redistributing = dtensor._redistributing
    dtensor._redistributing = lambda op, p: (gathered.append(f"{op.id}: {p.reason}"), redistributing(op, p))[1]
    try:
        for name in ("tp", "tp-patched"):
            model = parallelize_llama(copy.deepcopy(base), mesh)
            if name == "tp-patched":
                pkt.patch(model)
            del calls[:], gathered[:]
            model.train()
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(1, 128, (2, 16), generator=g)
            labels = ids.clone()
            labels[0, :5] = -100
            res = model(input_ids=ids, labels=labels)
            res.loss.backward()
            got = full_grads(model)
            out[name] = {
                "loss": float(res.loss),
                "logits_none": res.logits is None,
                "grad_diff": {k: float((got[k] - grads[k]).abs().max()) for k in grads},
                "grad_scale": {k: float(grads[k].abs().max()) for k in grads},
                "vocab_calls": list(calls),
                "gathered": list(gathered),
            }
    finally:
        vocab.run, dtensor._redistributing = run, redistributing
    return out


def _worker(world: int, rank: int, init_file: str, out_file: str, device: str = "cpu") -> None:
    os.environ["TRITON_INTERPRET"] = "1" if device == "cpu" else os.environ.get("TRITON_INTERPRET", "0")
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    sys.path.insert(0, os.path.dirname(__file__))
    import torch.distributed as dist

    if device == "cuda":  # every tensor the cases make lands on the rank's GPU
        torch.cuda.set_device(rank)
        torch.set_default_device("cuda")
    # a collective one rank skips fails in a minute instead of hanging the suite
    backend = "gloo" if device == "cpu" else "nccl"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    report: dict[str, Any] = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (world,))
        jobs: list[tuple[str, Any]] = []
        for name, kw, opts in _ce_cases():
            jobs.append((f"ce-{name}", lambda kw=kw, opts=opts: _run_ce(mesh, kw, opts)))
        for name, kw, opts in _flce_cases():
            jobs.append((f"flce-{name}", lambda kw=kw, opts=opts: _run_flce(mesh, kw, opts)))
        for kind in ("logits", "weight"):
            for name, opts in OPTION_CASES:
                for reduction in ("mean", "none"):
                    jobs.append((f"opt-{kind}-{name}-{reduction}", lambda k=kind, o=opts, r=reduction: _run_options(mesh, k, o, r)))
            jobs.append((f"mismatch-{kind}", lambda k=kind: {"error_text": _mismatch(mesh, rank, k)}))
        jobs.append(("fallbacks", lambda: _fallbacks(mesh, world)))
        if world == 2 and device == "cpu" and _has_transformers():
            jobs.append(("llama", lambda: _llama(mesh)))
        for i, (name, job) in enumerate(jobs):
            torch.manual_seed(1000 + i)
            run_job(report, name, job)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        finish_worker(rank, report, out_file)


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _worker2(rank: int, init_file: str, out_file: str) -> None:
    _worker(2, rank, init_file, out_file)


def _worker4(rank: int, init_file: str, out_file: str) -> None:
    _worker(4, rank, init_file, out_file)


def _worker_nccl2(rank: int, init_file: str, out_file: str) -> None:
    _worker(2, rank, init_file, out_file, device="cuda")


_REPORTS: dict[int, Any] = {}


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def report(request) -> dict[str, Any]:
    world = request.param
    if world not in _REPORTS:
        _REPORTS[world] = spawn_report(_worker2 if world == 2 else _worker4, world)
    data = _REPORTS[world]
    assert "error" not in data, data["error"]
    return data


def _check(r: dict[str, Any], grads: set[str], tol: float = 1e-5) -> None:
    assert "error" not in r, r.get("tb")
    assert r["is_dtensor"] and r["placements"] == ["R"], r
    assert r["fwd"] <= tol, r
    assert set(r["bwd"]) == grads, r
    assert all(isinstance(d, float) and d <= tol for d in r["bwd"].values()), r


@pytest.mark.parametrize("name", [n for n, _, _ in _ce_cases()])
def test_cross_entropy_on_vocab_sharded_logits_matches_unsharded(report, name):
    r = report[f"ce-{name}"]
    _check(r, {"logits"})
    assert r["logits_unchanged"]
    assert r["grad_placements"]["logits"] == [f"S({2 if name == 'none-3d' else 1})"]
    assert "vocab-parallel" in r["explain"] and "holds a collective" in r["explain"], r["explain"]
    # decisions() lists the route that ran, not the plain decision made before the route took over
    assert all(d == [CE, "torch", "vocab-parallel route", "DTensor"] for d in r["decided"]), r["decided"]


@pytest.mark.parametrize("name", [n for n, _, _ in _flce_cases()])
def test_fused_linear_cross_entropy_on_vocab_sharded_weight_matches_unsharded(report, name):
    kw = next(k for n, k, _ in _flce_cases() if n == name)
    r = report[f"flce-{name}"]
    _check(r, {"hidden", "weight"} | ({"bias"} if kw.get("bias") else set()))
    assert r["grad_placements"]["weight"] == ["S(0)"]
    assert "vocab-parallel" in r["explain"] and "Partial()" in r["explain"] and "column-parallel backward" in r["explain"]
    if kw.get("hidden_shard"):  # rows sharded: replicated first, said so
        assert "redistributed (hidden Shard(0) -> Replicate(); target Shard(0) -> Replicate())" in r["explain"], r["explain"]


@pytest.mark.parametrize("kind", ["logits", "weight"])
@pytest.mark.parametrize("name", [n for n, _ in OPTION_CASES])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_options_on_the_vocab_parallel_path_match_their_formula(report, kind, name, reduction):
    r = report[f"opt-{kind}-{name}-{reduction}"]
    _check(r, {"logits"} if kind == "logits" else {"hidden", "weight", "bias"})


@pytest.mark.parametrize("kind", ["logits", "weight"])
def test_ranks_with_different_shapes_get_a_named_error(report, kind):
    text = report[f"mismatch-{kind}"]["error_text"]
    op = CE if kind == "logits" else FLCE
    arg = "logits" if kind == "logits" else "hidden"
    assert text.startswith("OpArgumentError") and op in text and arg in text and "same shapes" in text, text


def test_what_the_vocab_parallel_path_does_not_know_takes_the_gather_path(report):
    r = report["fallbacks"]
    assert "error" not in r, r.get("tb")
    assert r["known"] and r["unknown-off"] and not r["unknown-set"]
    if "2d-fwd" in r:  # 4 ranks: a 2x2 mesh
        assert r["2d-fwd"] <= 1e-5
        assert "vocab-parallel" not in r["2d-route"] and "redistributed (" in r["2d-route"], r["2d-route"]


def test_patched_tp_llama_keeps_the_fused_loss_vocab_parallel(report):
    if "llama" not in report:
        pytest.skip("2 ranks with transformers only")
    r = report["llama"]
    assert "error" not in r, r.get("tb")
    for name in ("tp", "tp-patched"):
        got = r[name]
        assert got["loss"] == pytest.approx(r["plain"], rel=1e-5, abs=1e-6), name
        bad = {k: d for k, d in got["grad_diff"].items() if d > 1e-5 + 1e-4 * got["grad_scale"][k]}
        assert not bad, (name, bad)
    assert r["tp"]["vocab_calls"] == [] and not r["tp"]["logits_none"]
    patched = r["tp-patched"]
    assert patched["logits_none"]  # the fused loss: no [tokens, vocab] logits
    assert patched["vocab_calls"] == [f"{FLCE} DTensor weight Shard(0) on mesh of 2"]
    assert patched["gathered"] == []  # the LM head was never gathered


@pytest.mark.gpu2
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_nccl_available(), reason="needs NCCL")
def test_every_case_on_two_gpus_with_nccl():
    """The same cases (fp32) on 2 GPUs through NCCL: ``pytest -m gpu2 tests/distributed/test_vocab_parallel.py``."""
    data = spawn_report(_worker_nccl2, 2)
    assert "error" not in data, data["error"]
    for name, r in data.items():
        if name == "fallbacks":
            continue
        if name.startswith("mismatch-"):
            assert r["error_text"].startswith("OpArgumentError") and "same shapes" in r["error_text"], r
            continue
        grads = {"logits"} if name.startswith(("ce-", "opt-logits")) else set(r.get("bwd", {})) | {"hidden", "weight"}
        _check(r, grads, tol=1e-4)


# -- a weighted mean whose scored targets' weights sum to 0 ----------------------------------------

ZERO_WEIGHT_CASES = [
    # (name, kind, placements of (logits|hidden, weight), options)
    ("ce-vocab-smooth", "logits", ("S1", None), {"label_smoothing": 0.1}),
    ("ce-vocab-smooth-softcap-zloss", "logits", ("S1", None), {"label_smoothing": 0.2, "softcap": 3.0, "z_loss": 0.01}),
    ("ce-vocab-plain", "logits", ("S1", None), {}),
    ("ce-rows-smooth", "logits", ("S0", None), {"label_smoothing": 0.1}),
    ("flce-vocab-smooth", "hidden", ("R", "S0"), {"label_smoothing": 0.1}),
    ("flce-vocab-plain", "hidden", ("R", "S0"), {}),
    # rows sharded: the mean's NaN reaches each rank's "sum" call as its cotangent, and the
    # single-device fused loss scales the gradients it made for a cotangent of 1 by it, so its
    # ignored rows' grad_hidden are NaN too (0·NaN; F.cross_entropy's sum gives 0): compared on
    # the scored rows only (a single-device matter, not this path's)
    ("flce-rows-smooth", "hidden", ("S0", "R"), {"label_smoothing": 0.1}),
]


def _same_nan(got: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """NaN exactly where ``ref`` is, and the largest difference elsewhere."""
    got, ref = got.double(), ref.double()
    both = ~ref.isnan() & ~got.isnan()
    return {
        "nan_match": bool(torch.equal(got.isnan(), ref.isnan())),
        "ref_nan": int(ref.isnan().sum()),
        "diff": float((got - ref)[both].abs().max()) if both.any() else 0.0,
    }


def _run_zero_weights(mesh: Any, kind: str, places: tuple[str, str | None], opts: dict[str, Any]) -> dict[str, Any]:
    """``reduction="mean"`` with class weights that are 0 for every scored target: against
    ``F.cross_entropy`` on the full tensors (NaN loss, NaN gradients on the scored rows, 0 on the
    ignored ones)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import polykernel

    pl = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    n, hs, v = 8, 6, 10
    t = torch.tensor([1, 2, -100, 1, 4, -100, 2, 4])
    cw = torch.rand(v) + 0.5
    cw[[1, 2, 4]] = 0.0  # the scored targets' classes
    softcap, z_loss, eps = opts.get("softcap"), opts.get("z_loss", 0.0), opts.get("label_smoothing", 0.0)
    dt = distribute_tensor(t, mesh, [Shard(0) if places[0] == "S0" else Replicate()])
    dcw = distribute_tensor(cw, mesh, [Replicate()])
    if kind == "logits":
        x = 3 * torch.randn(n, v)
        leaves = [x.clone().requires_grad_()]
        z = leaves[0]
        dargs = [distribute_tensor(x, mesh, [pl[places[0]]]).requires_grad_()]
        got = polykernel.cross_entropy(dargs[0], dt, weight=dcw, **opts)
    else:
        h, w = torch.randn(n, hs), 2 * torch.randn(v, hs) / hs**0.5
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        z = F.linear(*leaves)
        dargs = [distribute_tensor(a, mesh, [pl[p]]).requires_grad_() for a, p in zip((h, w), places)]  # type: ignore[index]
        got = polykernel.fused_linear_cross_entropy(dargs[0], dargs[1], dt, ce_weight=dcw, **opts)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    ref = F.cross_entropy(z, t, weight=cw, label_smoothing=eps)
    if z_loss:  # w[t]·lse² on the scored rows (where: the ignored rows' gradients stay 0), over Σ w[t]: 0 / 0 too
        valid = t != -100
        zl = torch.where(valid, cw[t.clamp(min=0)] * torch.logsumexp(z, -1) ** 2, 0.0)
        ref = ref + z_loss * zl.sum() / cw[t[valid]].sum()
    got.backward()
    ref.backward()
    out = {"loss": _same_nan(got.full_tensor(), ref.detach()), "grads": {}}
    for i, (d, r) in enumerate(zip(dargs, leaves)):
        g = d.grad.full_tensor()
        keep = t != -100 if i == 0 and kind == "hidden" and places[0] == "S0" else slice(None)
        out["grads"][str(i)] = _same_nan(g[keep], r.grad[keep])
    out["scored_rows_nan"] = bool(leaves[0].grad[t != -100].isnan().all())
    out["ignored_rows_zero"] = bool((leaves[0].grad[t == -100] == 0).all())
    return out


def _worker_zero_weights(rank: int, init_file: str, out_file: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    sys.path.insert(0, os.path.dirname(__file__))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=90))
    report: dict[str, Any] = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        for i, (name, kind, places, opts) in enumerate(ZERO_WEIGHT_CASES):
            torch.manual_seed(2000 + i)
            run_job(report, name, lambda k=kind, p=places, o=opts: _run_zero_weights(mesh, k, p, o))
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        finish_worker(rank, report, out_file)


def test_zero_weight_sum_mean_is_nan_with_nan_scored_gradients_as_f_cross_entropy():
    """``reduction="mean"`` with class weights, the scored targets' weights summing to 0: as
    ``F.cross_entropy`` (2 ranks; vocab-sharded logits / LM-head weight and row-sharded calls),
    the loss is NaN, the scored rows' gradients NaN and the ignored rows' 0, smoothing or not
    (the vocab-parallel path gave +inf with label smoothing, the row-sharded mean zero gradients)."""
    data = spawn_report(_worker_zero_weights, 2)
    assert "error" not in data, data["error"]
    for name, *_ in ZERO_WEIGHT_CASES:
        r = data[name]
        assert "error" not in r, (name, r.get("tb"))
        assert r["loss"]["nan_match"] and r["loss"]["ref_nan"] == 1, (name, r)
        assert r["scored_rows_nan"] and r["ignored_rows_zero"], (name, r)  # the reference's own shape
        for g in r["grads"].values():
            assert g["nan_match"] and g["diff"] <= 1e-5, (name, r)


# -- the local slice padded to 16 bytes for the matmuls (core/aligned_head.py) ----------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])  # grads made in the forward; recomputed in the backward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_local_slice_matmuls_run_padded_and_change_nothing(monkeypatch, dtype, reduction):
    """One rank's walk (the collective made the identity: a world of one): every matmul of the fused
    loss's forward and backward sees the slice's classes rounded up to 16 bytes, and the loss and
    gradients equal the unpadded walk's, NaNs in the same places for a hidden row with an inf."""
    from _matmul_helpers import Matmuls, assert_padded, assert_same
    from polykernel.distributed import vocab, vocab_math

    monkeypatch.setattr(vocab_math, "_all_gather", lambda x, group: x[None])
    n, h, v = 12, 16, 37  # 37 classes: 40 (fp32) or 48 (bf16) padded
    per = 16 // torch.empty((), dtype=dtype).element_size()
    o = vocab_math.Options(ignore_index=-100, label_smoothing=0.1, reduction=reduction, softcap=None, z_loss=0.0)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    hidden[3, 5] = float("inf")
    weight = (0.3 * torch.randn(v, h, generator=gen)).to(dtype)
    bias = (0.1 * torch.randn(v, generator=gen)).to(dtype)
    target = _targets(n, v)

    def run():
        hs, ws, bs = (x.detach().clone().requires_grad_() for x in (hidden, weight, bias))
        rec = Matmuls()
        with rec:
            loss = vocab._VocabFLCE.apply(hs, ws, bs, target, None, 0, v, o, None)
            grads = torch.autograd.grad(loss, (hs, ws, bs), torch.ones_like(loss))
        run.calls = rec.calls
        return (loss.detach(), *grads)

    padded = run()
    assert_padded(run.calls, v, per)
    monkeypatch.setattr(vocab, "aligned_head", lambda weight, bias, element_size: (weight, bias))
    assert_same(padded, run(), rtol=1e-5, atol=1e-6)
