"""The demo model (polykernel path vs plain-torch path) and ``polykernel demo`` end to end on the CPU."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math

import pytest
import torch

import polykernel
from polykernel import demo
from polykernel.models import PRESETS, LlamaConfig, LlamaForCausalLM

MICRO = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32)


def _pair(cfg: LlamaConfig, dtype=torch.float32, fused_loss=True):
    models = []
    for use_pk in (True, False):
        torch.manual_seed(0)
        models.append(LlamaForCausalLM(cfg, use_polykernel=use_pk, fused_loss=fused_loss).to(dtype))
    return models


def _loss_and_grads(model, ids):
    loss = model(ids[:, :-1], targets=ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------
# The model


@pytest.mark.parametrize(
    "overrides, fused_loss",
    [({}, True), ({}, False), ({"tie_embeddings": True, "norm_casting": "llama", "num_kv_heads": 4}, True)],
    ids=["fused-loss", "logits-loss", "tied-llama-casting-mha"],
)
def test_polykernel_path_matches_torch_path_fp32(overrides, fused_loss):
    # On the CPU the conftest sets TRITON_INTERPRET=1, so the polykernel path runs the dispatcher's
    # first choice (Triton kernels through the interpreter): a real cross-implementation check.
    cfg = dataclasses.replace(MICRO, **overrides)
    pk, pt = _pair(cfg, fused_loss=fused_loss)
    assert all(torch.equal(a, b) for a, b in zip(pk.state_dict().values(), pt.state_dict().values()))
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    ids[0, 5] = -100  # an ignored target (inputs are ids[:, :-1]: position 5 is both)
    ids = ids.clamp(min=0)
    targets = ids[:, 1:].clone()
    targets[1, 3] = -100
    loss_pk = pk(ids[:, :-1], targets=targets)
    loss_pt = pt(ids[:, :-1], targets=targets)
    assert loss_pk.dtype == loss_pt.dtype == torch.float32
    torch.testing.assert_close(loss_pk, loss_pt, atol=1e-5, rtol=1e-5)
    loss_pk.backward()
    loss_pt.backward()
    for (name, a), (_, b) in zip(pk.named_parameters(), pt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_polykernel_path_matches_torch_path_bf16():
    pk, pt = _pair(MICRO, torch.bfloat16)
    ids = torch.randint(0, MICRO.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    lp, gp = _loss_and_grads(pk, ids)
    lt, gt = _loss_and_grads(pt, ids)
    # bf16 activations round at every op; the kernels round in different places
    torch.testing.assert_close(lp, lt, atol=2e-2, rtol=1e-2)
    for name in gp:
        a, b = gp[name].float(), gt[name].float()
        rel = (a - b).norm() / b.norm().clamp_min(1e-12)
        assert rel < 5e-2, f"{name}: relative grad difference {rel:.3g}"


def test_model_surface():
    model = LlamaForCausalLM(MICRO)
    ids = torch.randint(0, MICRO.vocab_size, (3, 9))
    assert model(ids).shape == (3, 9, MICRO.vocab_size)  # no targets: logits
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, MICRO.max_seq_len + 1, dtype=torch.long))
    assert sum(p.numel() for p in model.parameters()) == MICRO.num_parameters()
    tied = dataclasses.replace(MICRO, tie_embeddings=True)
    assert sum(p.numel() for p in LlamaForCausalLM(tied).parameters()) == tied.num_parameters()
    assert "path=polykernel" in repr(model)
    model.use_polykernel = False
    assert "path=torch" in repr(model)
    assert set(PRESETS) == {"tiny", "small", "medium"}
    assert LlamaConfig.preset("medium").vocab_size == 128256
    with pytest.raises(ValueError, match="preset"):
        LlamaConfig.preset("huge")
    with pytest.raises(ValueError, match="num_kv_heads"):
        LlamaConfig(num_heads=4, num_kv_heads=3)


# ------------------------------------------------------------------------------------------------
# Data


def test_markov_stream_is_deterministic_and_learnable():
    a, floor = demo.markov_stream(1000, 6, 50, states=20, successors=3, seed=7)
    b, floor_b = demo.markov_stream(1000, 6, 50, states=20, successors=3, seed=7)
    c, _ = demo.markov_stream(1000, 6, 50, states=20, successors=3, seed=8)
    assert a.shape == (6, 51) and a.dtype == torch.int64
    assert torch.equal(a, b) and floor == floor_b and not torch.equal(a, c)
    assert len(a.unique()) <= 20 and int(a.max()) < 1000
    # each token is followed by at most `successors` distinct tokens
    nxt: dict[int, set[int]] = {}
    for row in a.tolist():
        for x, y in itertools.pairwise(row):
            nxt.setdefault(x, set()).add(y)
    assert max(len(s) for s in nxt.values()) <= 3
    assert 0 < floor < math.log(3)


# ------------------------------------------------------------------------------------------------
# The demo


@pytest.fixture
def cpu_default(monkeypatch):
    """The demo as a user runs it on a CPU machine: no Triton interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    polykernel.clear_caches()
    yield
    polykernel.clear_caches()


def test_demo_end_to_end_on_cpu(cpu_default, tmp_path):
    out = io.StringIO()
    path = tmp_path / "demo.json"
    argv = ["--device", "cpu", "--steps", "12", "--batch", "4", "--seq-len", "64", "--no-progress", "--json", str(path)]
    rc = demo.main(argv, out=out)
    text = out.getvalue()
    assert rc == 0, text
    for op_id in polykernel.list_ops():
        assert op_id in text  # the op table lists every op
    assert "platform: cpu" in text and "max |diff|" in text and "agree" in text and "tokens/s" in text
    assert "VmHWM" in text or "ru_maxrss" in text  # says which memory measure it used
    res = json.loads(path.read_text())
    assert res["agree"] and res["learned"] and res["device"] == "cpu" and res["dtype"] == "float32"
    pk, pt = res["runs"]
    assert len(pk["losses"]) == len(pt["losses"]) == 12
    assert pk["losses"][-1] < pk["losses"][0] - 1.0  # the loss visibly falls
    assert abs(pk["losses"][0] - math.log(res["config"]["vocab_size"])) < 0.5  # from ~ln(V)
    used = {r["op"]: r for r in pk["impls"]}
    for op_id in ("norm.rms_norm", "activation.swiglu", "embedding.rope", "loss.fused_linear_cross_entropy"):
        assert used[op_id]["impl"] == "torch" and used[op_id]["source"] == "auto", used
    assert pk["tokens_per_second"] > 0 and pk["peak_bytes"] >= 0
    assert pt["impls"] == []  # the torch path never calls polykernel


def test_demo_logits_loss_uses_cross_entropy(cpu_default):
    res = demo.run_demo(steps=2, size="tiny", device="cpu", batch=2, seq_len=32, fused_loss=False, out=io.StringIO(), progress=False)
    ops = {r["op"] for r in res.runs[0].impls}
    assert "loss.cross_entropy" in ops and "loss.fused_linear_cross_entropy" not in ops
    assert res.agree


def test_demo_flags_a_disagreement(cpu_default, monkeypatch):
    # a polykernel path that computes something else must be reported, not hidden
    from polykernel.models import llama

    real = llama._Polykernel.norm
    monkeypatch.setattr(llama._Polykernel, "norm", staticmethod(lambda mod, x: real(mod, x) * 2))
    out = io.StringIO()
    rc = demo.main(["--device", "cpu", "--steps", "3", "--batch", "2", "--seq-len", "32", "--no-progress"], out=out)
    assert rc == 1 and "DIFFER" in out.getvalue() and "PROBLEM" in out.getvalue()


def test_demo_options_and_progress_bar():
    with pytest.raises(SystemExit):
        demo.main(["--dtype", "int8", "--device", "cpu"], out=io.StringIO())
    with pytest.raises(SystemExit):
        demo.main(["--size", "huge"], out=io.StringIO())
    assert demo.resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert demo.resolve_size("auto", torch.device("cpu")) == "tiny"

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = demo._Progress("polykernel", 4, tty, width=8)
    bar.update(2, 3.5)
    bar.close(3.0)
    assert "[####....]    2/4" in tty.getvalue() and "4 steps in" in tty.getvalue()


@pytest.mark.gpu
def test_demo_on_gpu_uses_gpu_kernels_and_saves_memory(tmp_path):
    path = tmp_path / "demo.json"
    out = io.StringIO()
    rc = demo.main(["--device", "cuda", "--size", "small", "--steps", "20", "--no-progress", "--json", str(path)], out=out)
    text = out.getvalue()
    assert rc == 0, text
    res = json.loads(path.read_text())
    assert res["dtype"] == "bfloat16" and res["agree"] and res["learned"]
    pk, pt = res["runs"]
    used = {r["op"]: r["impl"] for r in pk["impls"]}
    assert used["norm.rms_norm"] != "torch" and used["loss.fused_linear_cross_entropy"] != "torch", used
    # the fused loss never materializes the [B*T, V] logits (and their fp32 copies and gradients)
    assert pk["peak_bytes"] < pt["peak_bytes"], (pk["peak_bytes"], pt["peak_bytes"])
