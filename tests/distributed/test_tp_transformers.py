"""``integrations.transformers.patch`` on a tensor- and sequence-parallel Llama (CPU, 2 gloo ranks).

A tiny transformers Llama is sharded with ``parallelize_module`` as torchtitan does it
(tests/_tp_llama.py: sequence-parallel norms, column/row-parallel attention and MLP). Patched
and unpatched, one training step gives the same loss and gradients (and both match the
unsharded model); the patched norms received DTensors and ran polykernel's default choice, the
Triton kernels through the interpreter, on their local shards.

One spawn runs every variant (~40 s on 2 cores); rank 0 writes a JSON report the tests read.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
from typing import Any

import pytest
import torch

from _tp_llama import finish_worker, spawn_report

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

WORLD = 2
VARIANTS = ("tp", "tp-patched", "tp-patched-dtensor-mlp")


def _model() -> Any:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms start at 1: move them so that a wrong weight gradient shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _step(model: Any) -> tuple[float, dict[str, torch.Tensor]]:
    from _tp_llama import full_grads

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    model.train()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return float(out.loss), full_grads(model)


def _worker(rank: int, init_file: str, out_file: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    report: dict[str, Any] = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        import polykernel
        from _tp_llama import parallelize_llama
        from polykernel.distributed import dtensor
        from polykernel.integrations import transformers as pkt

        mesh = init_device_mesh("cpu", (WORLD,))
        routed: list[tuple[str, str]] = []  # (op, lead placement) of every call through the DTensor route
        run = dtensor.run

        def spy(op, impl, p, args):
            routed.append((op.id, p.text))
            return run(op, impl, p, args)

        dtensor.run = spy
        base = _model()
        loss, grads = _step(copy.deepcopy(base))
        report["plain"] = {"loss": loss}
        for name in VARIANTS:
            model = parallelize_llama(copy.deepcopy(base), mesh, dtensor_mlp=name.endswith("dtensor-mlp"))
            if "patched" in name:
                pkt.patch(model)
            polykernel.clear_caches()
            del routed[:]
            try:
                got, g = _step(model)
                report[name] = {
                    "loss": got,
                    "grad_diff": {k: float((g[k] - grads[k]).abs().max()) for k in grads},
                    "grad_scale": {k: float(grads[k].abs().max()) for k in grads},
                    "decisions": [(d["op"], d["impl"], d.get("subclass"), d["source"]) for d in polykernel.decisions()],
                    "routed": sorted(set(routed)),
                    "patched": {k: len(v) for k, v in pkt.patched(model).items()},
                }
            except Exception as exc:
                report[name] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        finish_worker(rank, report, out_file)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    data = spawn_report(_worker, WORLD)
    assert "error" not in data, data["error"]
    return data


@pytest.mark.parametrize("variant", VARIANTS)
def test_same_loss_and_grads_as_the_unsharded_model(report, variant):
    r = report[variant]
    assert "error" not in r, r.get("tb")
    assert r["loss"] == pytest.approx(report["plain"]["loss"], rel=1e-5, abs=1e-6)
    bad = {k: d for k, d in r["grad_diff"].items() if d > 1e-5 + 1e-4 * r["grad_scale"][k]}
    assert not bad, bad


@pytest.mark.parametrize("variant", ["tp-patched", "tp-patched-dtensor-mlp"])
def test_patched_ops_ran_triton_on_local_shards(report, variant):
    r = report[variant]
    assert "error" not in r, r.get("tb")
    assert r["patched"] == {"rms_norm": 5, "swiglu": 2, "rope": 2, "loss": 1, "sdpa_is_causal": 1}
    ran = {op: impl for op, impl, _, _ in r["decisions"]}
    # the default selection with the interpreter on: Triton on every op that ran
    # the loss: the fused one on the colwise lm_head, vocab-parallel (the route's record: torch math
    # on the vocabulary slices; the plain decision made before it never ran), no logits' CE
    assert ran == {
        "norm.rms_norm": "triton",
        "activation.swiglu": "triton",
        "embedding.rope": "triton",
        "loss.fused_linear_cross_entropy": "torch",
    }
    routes = [d for d in r["decisions"] if d[2] is not None]
    assert routes == [["loss.fused_linear_cross_entropy", "torch", "DTensor", "vocab-parallel route"]], (
        "a decision was made on subclass arguments"
    )
    routed = dict(r["routed"])
    assert routed.get("norm.rms_norm") == "DTensor Shard(1) on mesh of 2"  # the sequence-parallel norms
    if variant.endswith("dtensor-mlp"):
        assert routed.get("activation.swiglu") == "DTensor Shard(2) on mesh of 2"  # gate/up column shards
    else:
        assert "activation.swiglu" not in routed  # plain local tensors
