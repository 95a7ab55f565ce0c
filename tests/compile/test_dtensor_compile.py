"""DTensors through ``torch.compile(fullgraph=True)`` (CPU, 2 gloo ranks): the custom ops carry
sharding rules (polykernel.compile.sharding), so the trace has no graph break, the result matches
eager on the whole tensors, row-sharded inputs stay sharded (no gather) and the dispatcher's
Triton impl (interpreter) runs on the local shards. Compiled training too: the training custom
ops (``<op>_train``, ``<op>_train_backward``) carry rules, so a fwd+bwd graph runs them on the
local shards, gradients match eager on the whole tensors and a replicated weight's gradient is
``Partial``. A mean loss over sharded rows runs our ops too, as their sum over the global count
of scored rows (uneven ignored targets per rank, label smoothing, none scored at all)."""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch

from _tp_llama import finish_worker, spawn_report
from polykernel import _compat

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

WORLD = 2


def _cases() -> list[tuple[str, Any, Any]]:
    """(name, fn, build): build() -> (args, placements); fn is what gets compiled."""
    from torch.distributed.tensor import Replicate, Shard

    import polykernel as pk

    R = Replicate()
    return [
        ("rms_norm-S0", lambda x, w: pk.rms_norm(x, w) * 2, lambda: ((torch.randn(8, 16), 1 + torch.randn(16)), (Shard(0), R))),
        ("rms_norm-S1-3d", lambda x, w: pk.rms_norm(x, w, offset=1.0), lambda: ((torch.randn(2, 6, 16), torch.randn(16)), (Shard(1), R))),
        (
            "layer_norm-S0",
            lambda x, w, b: pk.layer_norm(x, w, b),
            lambda: ((torch.randn(8, 16), torch.randn(16), torch.randn(16)), (Shard(0), R, R)),
        ),
        ("softmax-S0", lambda x: pk.softmax(x) + 1, lambda: ((torch.randn(8, 16),), (Shard(0),))),
        (
            "fused_add_rms_norm-S0",
            lambda x, r, w: pk.fused_add_rms_norm(x, r, w, impl="triton"),
            lambda: ((torch.randn(8, 16), torch.randn(8, 16), torch.randn(16)), (Shard(0), Shard(0), R)),
        ),
        (
            "swiglu-S-last",
            lambda g, u: pk.swiglu(g, u, impl="triton"),
            lambda: ((torch.randn(4, 16), torch.randn(4, 16)), (Shard(1), Shard(1))),
        ),
        (
            "rope-heads",
            lambda q, k, c, s: pk.rope(q, k, c, s, impl="triton"),
            lambda: (
                (torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 6, 8), torch.randn(1, 6, 8)),
                (Shard(1), Shard(1), R, R),
            ),
        ),
        (
            "cross_entropy-sum-S0",
            lambda x, t: pk.cross_entropy(x, t, reduction="sum"),
            lambda: ((torch.randn(8, 10), torch.tensor([1, 2, -100, 3, 4, 5, 6, 7])), (Shard(0), Shard(0))),
        ),
        (
            "cross_entropy-mean-S0",
            lambda x, t: pk.cross_entropy(x, t),
            lambda: ((torch.randn(8, 10), torch.tensor([1, 2, -100, 3, 4, 5, 6, 7])), (Shard(0), Shard(0))),
        ),
        (
            "cross_entropy-none-S0",
            lambda x, t: pk.cross_entropy(x, t, reduction="none"),
            lambda: ((torch.randn(8, 10), torch.tensor([1, 2, -100, 3, 4, 5, 6, 7])), (Shard(0), Shard(0))),
        ),
    ]


def _train_cases() -> list[tuple[str, Any, Any]]:
    """Training-only cases (the inference ones are reused too)."""
    from torch.distributed.tensor import Replicate, Shard

    import polykernel as pk

    R = Replicate()
    target = torch.tensor([[1, 2, -100, 3, 4], [5, 6, 7, 8, -100]])
    return [
        ("rms_norm-S1-uneven", lambda x, w: pk.rms_norm(x, w) * 2, lambda: ((torch.randn(2, 5, 16), 1 + torch.randn(16)), (Shard(1), R))),
        ("rms_norm-S-last", lambda x, w: pk.rms_norm(x, w), lambda: ((torch.randn(8, 16), 1 + torch.randn(16)), (Shard(1), R))),
        (
            "cross_entropy-sum-S1-3d",
            lambda x, t: pk.cross_entropy(x, t, reduction="sum"),
            lambda: ((torch.randn(2, 5, 10), target), (Shard(1), Shard(1))),
        ),
        (
            "cross_entropy-mean-S0-uneven-smoothed",  # rank 0 scores 1 row of 4, rank 1 all 4
            lambda x, t: pk.cross_entropy(x, t, label_smoothing=0.1),
            lambda: ((torch.randn(8, 10), torch.tensor([-100, 2, -100, -100, 4, 5, 6, 7])), (Shard(0), Shard(0))),
        ),
        (
            # a weighted mean over uneven shards: the divisor is the global sum of the scored
            # targets' weights (some 0), softcap and z_loss per row
            "cross_entropy-mean-S0-uneven-options-classweights",
            lambda x, t, w: pk.cross_entropy(x, t, weight=w, softcap=3.0, z_loss=0.01),
            lambda: (
                (torch.randn(8, 10), torch.tensor([-100, 2, -100, -100, 4, 5, 6, 7]), (torch.arange(10) % 3).float()),
                (Shard(0), Shard(0), R),
            ),
        ),
        (
            "swiglu-forced-S1",
            lambda g, u: pk.swiglu(g, u, impl="triton"),
            lambda: ((torch.randn(4, 16), torch.randn(4, 16)), (Shard(1), Shard(1))),
        ),
        (
            "rope-heads-qk",  # the Triton kernel computes q's and k's gradients only
            lambda q, k, c, s: pk.rope(q, k, c, s, impl="triton"),
            lambda: (
                (torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 6, 8), torch.randn(1, 6, 8)),
                (Shard(1), Shard(1), R, R),
            ),
        ),
        *_flce_cases(),
    ]


def _flce_cases() -> list[tuple[str, Any, Any]]:
    """The fused linear cross-entropy (its saved slots: grad_hidden, grad_weight, grad_bias, a
    placeholder where not computed) on sharded rows, replicated LM head."""
    from torch.distributed.tensor import Replicate, Shard

    import polykernel as pk

    R = Replicate()
    rows = torch.tensor([1, 2, -100, 3, 4, 5, 6, 7])
    target = torch.tensor([[1, 2, -100, 3, 4], [5, 6, 7, 8, -100]])
    uneven = torch.tensor([[1, 2, -100, 3, -100], [5, 6, -100, -100, -100]])

    def flce(reduction: str) -> Any:
        return lambda h, w, t, b=None: pk.fused_linear_cross_entropy(h, w, t, b, reduction=reduction)

    return [
        ("flce-sum-S0", flce("sum"), lambda: ((torch.randn(8, 16), torch.randn(10, 16), rows), (Shard(0), R, Shard(0)))),
        ("flce-none-S0", flce("none"), lambda: ((torch.randn(8, 16), torch.randn(10, 16), rows), (Shard(0), R, Shard(0)))),
        (
            "flce-sum-S1-3d-bias",  # uneven: 5 rows over 2 ranks; the bias's gradient is a saved slot too
            flce("sum"),
            lambda: ((torch.randn(2, 5, 16), torch.randn(10, 16), target, torch.randn(10)), (Shard(1), R, Shard(1), R)),
        ),
        (
            "flce-none-S1-3d-bias",
            flce("none"),
            lambda: ((torch.randn(2, 5, 16), torch.randn(10, 16), target, torch.randn(10)), (Shard(1), R, Shard(1), R)),
        ),
        (
            "flce-sum-S0-weight-only",  # hidden takes no gradient: its saved slot is a placeholder
            flce("sum"),
            lambda: ((torch.randn(8, 16), torch.randn(10, 16), rows), (Shard(0), R, Shard(0))),
        ),
        ("flce-mean-replicated", flce("mean"), lambda: ((torch.randn(8, 16), torch.randn(10, 16), rows), (R, R, R))),
        ("flce-mean-S0", flce("mean"), lambda: ((torch.randn(8, 16), torch.randn(10, 16), rows), (Shard(0), R, Shard(0)))),
        (
            "flce-mean-S1-3d-bias-uneven",  # rank 0 scores 4 rows of 6, rank 1 one of 4
            flce("mean"),
            lambda: ((torch.randn(2, 5, 16), torch.randn(10, 16), uneven, torch.randn(10)), (Shard(1), R, Shard(1), R)),
        ),
        (
            "flce-mean-S0-none-scored",  # the reference: a NaN loss, zero gradients
            lambda h, w, t: pk.fused_linear_cross_entropy(h, w, t, label_smoothing=0.1),
            lambda: ((torch.randn(8, 16), torch.randn(10, 16), torch.full((8,), -100)), (Shard(0), R, Shard(0))),
        ),
    ]


def _grad_args(name: str, args: list) -> set[int]:
    """Which arguments of a training case take gradients (the floating ones, unless named)."""
    if name.endswith("-qk"):  # q and k only
        return {0, 1}
    if name.endswith("-weight-only"):
        return {1}
    if name.endswith("-classweights"):  # class weights take no gradient
        return {0}
    return {i for i, a in enumerate(args) if a.is_floating_point()}


def _recording_backend(graphs: list) -> Any:
    """aot_eager that keeps the forward and backward graphs AOTAutograd made (DTensors desugared:
    the custom ops there run on local tensors). Inductor's partitioner (min-cut), which recomputes
    only allowlisted ops: the default one recomputes a forward op whose output the backward needs
    (the norm's output, for the MLP's weight gradients) rather than save it."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def keep(gm: Any, _inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    return aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)


def _polykernel_nodes(graphs: list) -> list[str]:
    return sorted(
        str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function" and str(n.target).startswith("polykernel.")
    )


def _loss(out: Any) -> Any:
    """A scalar from an op's output(s) (weighted, so each output's gradient differs)."""
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o if o.dim() == 0 else (o * (i + 1)).sum()) for i, o in enumerate(outs))


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference, NaN where ``want`` has one (a mean over no scored row) equal
    to NaN in ``got``, and inf where the NaNs differ."""
    if not torch.equal(got.isnan(), want.isnan()):
        return float("inf")
    return float((got - want).nan_to_num(0.0).abs().max())


def _train_once(mesh: Any, fn: Any, args: list, placements: tuple, grad_args: set[int]) -> dict[str, Any]:
    """fwd+bwd of ``fn`` eager on whole tensors and compiled on DTensors (the ``grad_args`` take
    gradients): loss and gradient diffs, the gradients' placements, the polykernel nodes of the
    compiled graphs, the impls chosen and the ops whose decomposition was logged."""
    from torch.distributed.tensor import distribute_tensor

    import polykernel
    from polykernel.core import selection as dispatch
    from polykernel.distributed.dtensor import _placement

    leaves = [a.clone().requires_grad_(i in grad_args) for i, a in enumerate(args)]
    want = _loss(fn(*leaves))
    want.backward()
    dargs = [distribute_tensor(a, mesh, [p]).requires_grad_(leaf.requires_grad) for a, p, leaf in zip(args, placements, leaves)]
    graphs: list = []
    got = _loss(torch.compile(fn, fullgraph=True, backend=_recording_backend(graphs))(*dargs))
    got.backward()
    diffs = [_diff(d.grad.full_tensor(), a.grad) for d, a in zip(dargs, leaves) if a.grad is not None]
    diffs.append(_diff(got.full_tensor(), want.detach()))
    return {
        "diff": max(diffs),
        "grads": len(diffs),
        "grad_placements": [[_placement(p) for p in d.grad.placements] for d in dargs if d.grad is not None],
        "nodes": _polykernel_nodes(graphs),
        "impls": sorted({d["impl"] for d in polykernel.decisions()}),
        "decomposed": sorted({k[1] for k in dispatch._logged if k[0] == "compile-dtensor"}),
    }


def _tp_block(mesh: Any) -> dict[str, Any]:
    """A sequence-parallel norm and a tensor-parallel SwiGLU MLP (torchtitan's plan, through
    parallelize_module), compiled fwd+bwd with fullgraph=True: our training ops in the graphs,
    gradients equal to the unsharded block's."""
    import copy

    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module

    import polykernel as pk

    class Norm(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return pk.rms_norm(x, self.weight)

    class Mlp(nn.Module):
        def __init__(self, n: int, h: int) -> None:
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(n, h, bias=False), nn.Linear(n, h, bias=False), nn.Linear(h, n, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(pk.swiglu(self.gate(x), self.up(x), impl="triton"))

    class Block(nn.Module):
        def __init__(self, n: int = 16, h: int = 32) -> None:
            super().__init__()
            self.norm, self.mlp = Norm(n), Mlp(n, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(self.norm(x))

    torch.manual_seed(0)
    ref = Block()
    model = parallelize_module(
        copy.deepcopy(ref),
        mesh,
        {
            "norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate": ColwiseParallel(),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        },
    )
    x = torch.randn(2, 6, 16)
    ref(x).square().sum().backward()
    from torch.distributed.tensor import distribute_tensor

    graphs: list = []
    dx = distribute_tensor(x, mesh, [Shard(1)])
    out = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))(dx)
    out.square().sum().backward()
    diffs = {}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        diffs[name] = float((g - q.grad).abs().max())
    return {"diffs": diffs, "nodes": _polykernel_nodes(graphs)}


def _worker(rank: int, init_file: str, out_file: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    reports: dict[str, Any] = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, distribute_tensor

        import polykernel
        from polykernel.distributed.dtensor import _placement

        mesh = init_device_mesh("cpu", (WORLD,))
        for name, fn, build in _cases():
            torch._dynamo.reset()
            polykernel.clear_caches()
            torch.manual_seed(0)
            args, placements = build()
            try:
                with torch.no_grad():
                    want = fn(*args)
                    dargs = [distribute_tensor(a, mesh, [p]) for a, p in zip(args, placements)]
                    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*dargs)
                wants = want if isinstance(want, tuple) else (want,)
                gots = got if isinstance(got, tuple) else (got,)
                reports[name] = {
                    "types": [type(g).__name__ for g in gots],
                    "placements": [[_placement(p) for p in g.placements] for g in gots if isinstance(g, DTensor)],
                    "diff": max(float((g.full_tensor() - w).abs().max()) for g, w in zip(gots, wants)),
                    "impls": [d["impl"] for d in polykernel.decisions()],
                }
            except Exception as exc:
                reports[name] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
        # Compiled training: fwd+bwd through the training custom ops, on the local shards.
        for name, fn, build in [*_cases(), *_train_cases()]:
            if name not in TRAIN:
                continue
            torch._dynamo.reset()
            polykernel.clear_caches()
            torch.manual_seed(0)
            args, placements = build()
            try:
                reports["train:" + name] = _train_once(mesh, fn, args, placements, _grad_args(name, args))
            except Exception as exc:
                reports["train:" + name] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
        try:
            reports["block"] = _tp_block(mesh)
        except Exception as exc:
            reports["block"] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
    finally:
        finish_worker(rank, reports, out_file)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return spawn_report(_worker, WORLD)


# The sharding rules need DTensor's private schema infos (polykernel._compat.dtensor_schema_infos):
# without them (POLYKERNEL_COMPAT_FALLBACKS=1) no rule is registered, compiled DTensor calls of our
# ops fail with DTensor's error and training decomposes (the last test here checks that).
_NO_RULES = _compat.dtensor_schema_infos() is None
needs_rules = pytest.mark.skipif(_NO_RULES, reason="no DTensor schema infos here: no sharding rules")


# case -> the output placements expected: sharded inputs stay sharded (no gather), a summed loss
# is Partial, a mean over sharded rows is replicated (the local sums and counts, all-reduced)
EXPECTED = {
    "rms_norm-S0": [["Shard(0)"]],
    "rms_norm-S1-3d": [["Shard(1)"]],
    "layer_norm-S0": [["Shard(0)"]],
    "softmax-S0": [["Shard(0)"]],
    "fused_add_rms_norm-S0": [["Shard(0)"], ["Shard(0)"]],
    "swiglu-S-last": [["Shard(1)"]],
    "rope-heads": [["Shard(1)"], ["Shard(1)"]],
    "cross_entropy-sum-S0": [["Partial(sum)"]],
    "cross_entropy-mean-S0": [["Replicate()"]],
    "cross_entropy-none-S0": [["Shard(0)"]],
}


# Training case -> the polykernel ops in its compiled fwd+bwd graphs (each once: one forward
# kernel per call, its backward on the saved tensors) and the gradients' placements (a
# replicated weight of sharded rows: Partial). A mean loss over sharded rows too: its sum there.
def _trained(op: str) -> list[str]:
    return [f"polykernel.{op}_train.default", f"polykernel.{op}_train_backward.default"]


TRAIN = {
    "rms_norm-S0": (_trained("rms_norm"), [["Shard(0)"], ["Partial(sum)"]]),
    "rms_norm-S1-3d": (_trained("rms_norm"), [["Shard(1)"], ["Partial(sum)"]]),
    "rms_norm-S1-uneven": (_trained("rms_norm"), [["Shard(1)"], ["Partial(sum)"]]),
    # sharded on the normalized dim: DTensor redistributes x to Replicate() for the ops' rules
    "rms_norm-S-last": (_trained("rms_norm"), None),
    "layer_norm-S0": (_trained("layer_norm"), [["Shard(0)"], ["Partial(sum)"], ["Partial(sum)"]]),
    "softmax-S0": (_trained("softmax"), [["Shard(0)"]]),
    "cross_entropy-sum-S0": (_trained("cross_entropy"), [["Shard(0)"]]),
    "cross_entropy-sum-S1-3d": (_trained("cross_entropy"), [["Shard(1)"]]),
    "cross_entropy-none-S0": (_trained("cross_entropy"), [["Shard(0)"]]),
    "swiglu-forced-S1": (_trained("swiglu"), [["Shard(1)"], ["Shard(1)"]]),
    "rope-heads-qk": (_trained("rope"), [["Shard(1)"], ["Shard(1)"]]),
    "cross_entropy-mean-S0": (_trained("cross_entropy"), [["Shard(0)"]]),
    "cross_entropy-mean-S0-uneven-smoothed": (_trained("cross_entropy"), [["Shard(0)"]]),
    "cross_entropy-mean-S0-uneven-options-classweights": (_trained("cross_entropy"), [["Shard(0)"]]),
    # The fused linear cross-entropy: grad_hidden like hidden, the LM head's gradients Partial
    "flce-sum-S0": (_trained("fused_linear_cross_entropy"), [["Shard(0)"], ["Partial(sum)"]]),
    "flce-none-S0": (_trained("fused_linear_cross_entropy"), [["Shard(0)"], ["Partial(sum)"]]),
    "flce-sum-S1-3d-bias": (_trained("fused_linear_cross_entropy"), [["Shard(1)"], ["Partial(sum)"], ["Partial(sum)"]]),
    "flce-none-S1-3d-bias": (_trained("fused_linear_cross_entropy"), [["Shard(1)"], ["Partial(sum)"], ["Partial(sum)"]]),
    "flce-sum-S0-weight-only": (_trained("fused_linear_cross_entropy"), [["Partial(sum)"]]),
    "flce-mean-replicated": (_trained("fused_linear_cross_entropy"), [["Replicate()"], ["Replicate()"]]),
    "flce-mean-S0": (_trained("fused_linear_cross_entropy"), [["Shard(0)"], ["Partial(sum)"]]),
    "flce-mean-S1-3d-bias-uneven": (_trained("fused_linear_cross_entropy"), [["Shard(1)"], ["Partial(sum)"], ["Partial(sum)"]]),
    "flce-mean-S0-none-scored": (_trained("fused_linear_cross_entropy"), [["Shard(0)"], ["Partial(sum)"]]),
}


@needs_rules
@pytest.mark.parametrize("name", list(TRAIN))
def test_compiled_training_on_dtensors_runs_our_ops_and_matches_eager(report, name):
    r = report["train:" + name]
    assert "error" not in r, r.get("tb")
    assert r["grads"] >= 1 and r["diff"] <= 1e-5
    nodes, placements = TRAIN[name]
    assert r["nodes"] == sorted(nodes)
    assert r["decomposed"] == []  # no call fell back to the torch reference
    assert "triton" in r["impls"], r["impls"]  # the dispatcher's choice, on the local shards
    if placements is not None:
        assert r["grad_placements"] == placements


@needs_rules
def test_compiled_tp_block_trains_through_our_ops(report):
    """Sequence-parallel norm + column/row-parallel SwiGLU MLP, compiled fwd+bwd (fullgraph)."""
    r = report["block"]
    assert "error" not in r, r.get("tb")
    assert r["nodes"] == sorted([*_trained("rms_norm"), *_trained("swiglu")]), r["nodes"]
    assert set(r["diffs"]) == {"norm.weight", "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"}
    assert max(r["diffs"].values()) <= 1e-5, r["diffs"]


@needs_rules
@pytest.mark.parametrize("name", list(EXPECTED))
def test_dtensor_compiles_fullgraph_and_matches_eager(report, name):
    r = report[name]
    assert "error" not in r, r.get("tb")
    assert r["diff"] <= 1e-5
    assert r["placements"] == EXPECTED[name]
    assert r["impls"] and set(r["impls"]) == {"triton"}  # the dispatcher's choice ran, on the local shards


def test_sharded_ops_are_the_dtensor_layouts_and_compiling_does_not_route():
    """Compiling plain tensors imports neither the eager DTensor route nor its subclass checks
    (importing polykernel.distributed.dtensor routes them); once it is imported, every op with a
    layout (its own fact, Op.dtensor_layout) is routed, and the compiled sharding rules read the
    same layouts."""
    import subprocess
    import sys

    code = (
        "import sys, torch, polykernel\n"
        "from polykernel.core import registry, selection as dispatch\n"
        "f = torch.compile(lambda x, w: polykernel.rms_norm(x, w), fullgraph=True, backend='eager')\n"
        "f(torch.randn(4, 8), torch.ones(8))\n"
        "print(sorted(dispatch.routed), 'polykernel.distributed.dtensor' in sys.modules)\n"
        "from polykernel.distributed import dtensor\n"
        "laid_out = sorted(i for i in registry.all_op_ids() if registry.get_op(i).dtensor_layout is not None)\n"
        "print(sorted(dispatch.routed) == laid_out == sorted(dtensor.LAYOUTS), len(laid_out))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"}
    )
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()[-2:]
    assert first == "[] False"
    # the ops with a DTensor layout: 9 built-in, moe_experts(_gpt_oss), group_norm, dyt, poly_norm, relu_squared, mrope
    assert second == "True 16"


_DECOMPOSE_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import polykernel
from polykernel.core import selection as dispatch
from polykernel.compile import sharding as dtensor_sharding
dtensor_sharding._trainable = lambda op_id, compiled: op_id != "activation.swiglu"  # an op with no training rules
mesh = init_device_mesh("cpu", (1,))
g = distribute_tensor(torch.randn(4, 8), mesh, [Shard(0)]).requires_grad_()
u = distribute_tensor(torch.randn(4, 8), mesh, [Shard(0)]).requires_grad_()
f = torch.compile(lambda a, b: polykernel.swiglu(a, b), backend="aot_eager", fullgraph=True)
f(g, u).sum().backward()
print("LOGGED", sorted(k[1:] for k in dispatch._logged if k[0] == "compile-dtensor"))
os.environ["POLYKERNEL_STRICT"] = "1"
torch._dynamo.reset()
try:
    torch.compile(lambda a, b: polykernel.swiglu(a, b), backend="aot_eager", fullgraph=True)(g, u)
    print("STRICT no error")
except Exception as exc:
    print("STRICT", "POLYKERNEL_STRICT=1" in str(exc))
dist.destroy_process_group()
"""


def test_compiled_training_without_rules_decomposes_logged_or_strict(tmp_path):
    # the trace-time side effects (a log line; with POLYKERNEL_STRICT=1 an error) of an op whose
    # training ops have no sharding rules, run while Dynamo traces the call
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "POLYKERNEL_COMPILE_SWIGLU": "ours"}
    env.pop("POLYKERNEL_STRICT", None)
    script = tmp_path / "decompose.py"
    script.write_text(_DECOMPOSE_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, env=env, timeout=300)
    from polykernel.compile import sharding

    why = sharding._NO_RULES if _NO_RULES else "its saved tensors have no placement"
    assert f"LOGGED [('activation.swiglu', {why!r})]" in out.stdout, out.stderr[-2000:]
    assert "STRICT True" in out.stdout, out.stderr[-2000:]
