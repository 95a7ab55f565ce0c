"""The demo model (polykernel path vs plain-torch path) and ``polykernel demo`` end to end on the CPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import itertools
import json
import math

import pytest
import torch

import polykernel
from polykernel import _compat
from polykernel.tools import demo
from polykernel.tools.demo import command as demo_command
from polykernel.tools.models import PRESETS, LlamaConfig, LlamaForCausalLM

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


SHORT = ["--device", "cpu", "--batch", "4", "--seq-len", "64", "--no-progress"]


def test_demo_end_to_end_on_cpu_with_a_transformers_llama(cpu_default, tmp_path):
    pytest.importorskip("transformers")
    out = io.StringIO()
    path = tmp_path / "demo.json"
    rc = demo.main([*SHORT, "--steps", "12", "--json", str(path)], out=out)
    text = out.getvalue()
    assert rc == 0, text
    # every op chooses its torch impl on a CPU: one line for all of them, one per reason the others cannot run
    assert f"every op ({len(polykernel.list_ops())}) chooses torch (auto)" in text and text.count("needs a CUDA device (") == 1
    assert "platform: cpu" in text and "a transformers Llama" in text and "tokens/s" in text and "agree" in text
    assert "VmHWM" in text or "ru_maxrss" in text  # says which memory measure it used
    res = json.loads(path.read_text())
    assert res["agree"] and res["learned"] and res["device"] == "cpu" and res["dtype"] == "float32"
    assert res["model"]["kind"] == "hf"
    pt, pk = res["runs"]
    assert (pt["label"], pk["label"]) == ("torch", "polykernel")  # the CPU default: no compile, no Liger
    assert len(pk["losses"]) == len(pt["losses"]) == 12
    assert pk["losses"][-1] < pk["losses"][0] - 1.0  # the loss visibly falls
    assert abs(pk["losses"][0] - math.log(res["model"]["vocab_size"])) < 0.5  # from ~ln(V)
    used = {r["op"]: r for r in pk["impls"]}
    # the fused loss patches the lm_head only where its hooks can be seen (polykernel._compat)
    loss = "loss.cross_entropy" if _compat.module_has_hooks(torch.nn.Linear(1, 1)) else "loss.fused_linear_cross_entropy"
    for op_id in ("norm.rms_norm", "activation.swiglu", "embedding.rope", loss):
        assert used[op_id]["impl"] == "torch" and used[op_id]["source"] == "auto", used
    assert pk["tokens_per_second"] > 0 and pk["median_step_seconds"] > 0 and pk["peak_bytes"] >= 0
    assert pk["max_abs_loss_diff"] <= 2e-3 and pk["agrees"]
    assert pt["impls"] == []  # the plain run never calls polykernel


def test_demo_falls_back_to_the_builtin_model(cpu_default, monkeypatch):
    import importlib.util

    from polykernel.tools.demo import models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    assert models.model_kind("auto") == "builtin"
    with pytest.raises(ValueError, match="transformers is not installed"):
        models.model_kind("hf")
    out = io.StringIO()
    assert demo.main([*SHORT, "--steps", "3"], out=out) == 0, out.getvalue()
    assert "the built-in Llama" in out.getvalue()


@pytest.mark.parametrize("model", ["hf", "builtin"])
def test_demo_logits_loss_uses_cross_entropy(cpu_default, model):
    if model == "hf":
        pytest.importorskip("transformers")
    res = demo.run_demo(steps=2, size="tiny", device="cpu", batch=2, seq_len=32, fused_loss=False, model=model)
    ops = {r["op"] for r in res.run("polykernel").impls}
    assert "loss.cross_entropy" in ops and "loss.fused_linear_cross_entropy" not in ops
    assert res.agree


def test_demo_flags_a_disagreement(cpu_default, monkeypatch):
    # a polykernel path that computes something else must be reported, not hidden
    from polykernel.tools.models import llama

    real = llama._Polykernel.norm
    monkeypatch.setattr(llama._Polykernel, "norm", staticmethod(lambda mod, x: real(mod, x) * 2))
    out = io.StringIO()
    rc = demo.main(["--model", "builtin", "--steps", "3", *SHORT], out=out)
    assert rc == 1 and "DIFFER" in out.getvalue() and "PROBLEM: the losses of polykernel differ" in out.getvalue()


def test_demo_compare_option_is_checked_before_training():
    from polykernel.tools.demo.models import parse_compare

    cpu = torch.device("cpu")
    assert parse_compare(None, cpu, "hf") == ["torch", "polykernel"]  # CPU default: no compile (slow to build), no Liger
    assert parse_compare("compile,polykernel", cpu, "builtin") == ["torch", "compile", "polykernel"]  # torch: the baseline, first
    for text, match in [
        ("torch,triton", "unknown run triton"),
        ("liger", "Liger-Kernel patches Hugging Face models"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_compare(text, cpu, "builtin")
    if importlib.util.find_spec("liger_kernel") is not None:
        with pytest.raises(ValueError, match="need a CUDA device"):
            parse_compare("liger", cpu, "hf")
    with pytest.raises(SystemExit, match="unknown run"):
        demo.main(["--device", "cpu", "--compare", "torch,fast"], out=io.StringIO())
    with pytest.raises(SystemExit):
        demo.main(["--dtype", "int8", "--device", "cpu"], out=io.StringIO())
    with pytest.raises(SystemExit):
        demo.main(["--size", "huge"], out=io.StringIO())
    assert demo_command.resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert demo_command.resolve_size("auto", torch.device("cpu")) == "tiny"


def test_liger_patch_is_undone_for_later_runs():
    pytest.importorskip("liger_kernel")
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    from polykernel.tools.demo import models

    before = {n: getattr(modeling_llama, n) for n in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}
    forward = modeling_llama.LlamaForCausalLM.forward
    shape = demo.runs.model_shape("tiny")
    with models.built("liger", "hf", shape, device=torch.device("cpu"), dtype=torch.float32, seed=0) as v:
        assert modeling_llama.apply_rotary_pos_emb is not before["apply_rotary_pos_emb"]  # Liger's, while its run lasts
        assert "Liger" in type(v.model.model.norm).__name__ or v.model.model.norm.forward.__func__.__module__.startswith("liger")
    assert {n: getattr(modeling_llama, n) for n in before} == before
    assert modeling_llama.LlamaForCausalLM.forward is forward


def test_same_initial_weights_for_every_contender():
    pytest.importorskip("transformers")
    from polykernel.tools.demo import models

    shape = demo.runs.model_shape("tiny")
    kw = {"device": torch.device("cpu"), "dtype": torch.float32, "seed": 3}
    a = models.build("torch", "hf", shape, **kw).model.state_dict()
    b = models.build("polykernel", "hf", shape, **kw).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "plain"])
def test_demo_output_on_a_terminal_and_plain(cpu_default, terminal, tmp_path):
    from polykernel.tools.console import make_console

    buf = io.StringIO()
    argv = ["--device", "cpu", "--batch", "2", "--seq-len", "32", "--steps", "4", "--model", "builtin", "--json", str(tmp_path / "d.json")]
    assert demo.main(argv, console=make_console(buf, force_terminal=terminal, width=200)) == 0
    text = buf.getvalue()
    assert ("\x1b[" in text) is terminal  # colours, styles and the progress bars only on a terminal
    assert "━" in text if terminal else not any(c in text for c in "━─│")
    row = next(ln for ln in text.splitlines() if ln.lstrip().startswith("polykernel ") and "x" in ln)
    assert "MiB" in row and ("agree" in row)
    assert text.rstrip().endswith("ok: polykernel trains to the same losses as plain PyTorch.")


def test_demo_plot_and_load(cpu_default, tmp_path):
    pytest.importorskip("matplotlib")
    path, png, png2 = tmp_path / "d.json", tmp_path / "d.png", tmp_path / "again.png"
    out = io.StringIO()
    argv = ["--model", "builtin", "--steps", "3", *SHORT, "--json", str(path), "--plot", str(png)]
    assert demo.main(argv, out=out) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and f"wrote {png}" in out.getvalue()
    assert demo.main(["--load", str(path), "--plot", str(png2)], out=io.StringIO()) == 0 and png2.exists()


def test_demo_isolate_runs_each_contender_in_its_own_process(cpu_default, tmp_path):
    path = tmp_path / "d.json"
    argv = ["--model", "builtin", "--steps", "2", "--device", "cpu", "--batch", "2", "--seq-len", "16", "--no-progress", "--isolate"]
    out = io.StringIO()
    assert demo.main([*argv, "--json", str(path)], out=out) == 0, out.getvalue()
    res = json.loads(path.read_text())
    assert res["isolated"] and [r["label"] for r in res["runs"]] == ["torch", "polykernel"]
    assert res["runs"][1]["impls"] and "each in its own process" in out.getvalue()


def test_demo_isolate_reports_a_failed_contender(cpu_default, monkeypatch, tmp_path):
    # a contender whose process dies (say a peer's patch that no longer fits transformers) is named
    # with its error and fails the demo, but the other runs are still measured and reported
    from polykernel.tools.demo import runs as demo_runs

    real = demo_runs._run_isolated

    def crash_polykernel(name, *args):
        if name == "polykernel":
            raise RuntimeError("polykernel demo --isolate: the polykernel run failed (exit 1):\nValueError: planted")
        return real(name, *args)

    monkeypatch.setattr(demo_runs, "_run_isolated", crash_polykernel)
    path = tmp_path / "d.json"
    argv = ["--model", "builtin", "--steps", "2", "--device", "cpu", "--batch", "2", "--seq-len", "16", "--no-progress", "--isolate"]
    out = io.StringIO()
    assert demo.main([*argv, "--json", str(path)], out=out) == 1
    res = json.loads(path.read_text())
    assert [r["label"] for r in res["runs"]] == ["torch"] and "planted" in res["failed"]["polykernel"]
    assert "FAILED: the polykernel run: ValueError: planted" in out.getvalue() and "PROBLEM: the polykernel run failed" in out.getvalue()


@pytest.mark.gpu
def test_demo_on_gpu_all_contenders(tmp_path):
    path = tmp_path / "demo.json"
    out = io.StringIO()
    rc = demo.main(["--device", "cuda", "--size", "small", "--steps", "16", "--no-progress", "--json", str(path)], out=out)
    text = out.getvalue()
    assert rc == 0, text
    res = json.loads(path.read_text())
    assert res["dtype"] == "bfloat16" and res["agree"] and res["learned"]
    runs = {r["label"]: r for r in res["runs"]}
    assert {"torch", "polykernel", "compile"} <= set(runs)
    used = {r["op"]: r["impl"] for r in runs["polykernel"]["impls"]}
    assert used["norm.rms_norm"] != "torch" and used["loss.fused_linear_cross_entropy"] != "torch", used
    # the fused loss never materializes the [B*T, V] logits (and their fp32 copies and gradients)
    assert runs["polykernel"]["peak_bytes"] < runs["torch"]["peak_bytes"], (runs["polykernel"]["peak_bytes"], runs["torch"]["peak_bytes"])


# ------------------------------------------------------------------------------------------------
# The report on an 80-column terminal, and what it says (no training: a made-up result)


def _result(device: str, impl: str = "torch", labels=("torch", "polykernel", "liger", "compile", "polykernel+compile")):
    from polykernel.tools.demo import runs

    base_losses = [6.2 - 0.1 * i for i in range(20)]
    used = [
        {"op": op, "impl": impl, "source": "auto", "why": "auto: best-ranked impl that can run", "forward_only": False,
         "skipped": [] if impl != "torch" else ["triton: needs a CUDA device", "cute_dsl: needs a CUDA device"]}
        for op in ("norm.rms_norm", "loss.fused_linear_cross_entropy")
    ]  # fmt: skip
    made = [
        runs.RunResult(
            label, [x + 1.43e-6 * k for x in base_losses], [45.6 + k] + [0.0123 * (1 + k / 10)] * 19, 65536 * 256,
            (12 - k) * 2**30 + 345 * 2**20, "torch.cuda.max_memory_allocated", used if label == "polykernel" else [],
        )
        for k, label in enumerate(labels)
    ]  # fmt: skip
    return runs.DemoResult(runs.SETUPS["tiny"], runs.model_shape("tiny"), "hf", device, "bfloat16", 1.309, made, 2e-3, 0.0)


def _render(print_fn, *args) -> list[str]:
    import re

    from polykernel.tools.console import make_console

    buf = io.StringIO()
    print_fn(make_console(buf, force_terminal=True, width=80), *args)
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", buf.getvalue()).splitlines()


def _on_one_line(value: str, lines: list[str]) -> bool:
    return any(value in ln for ln in lines)


def test_the_runs_tables_fit_80_columns_without_breaking_a_value():
    from polykernel.tools.demo import report

    res = _result("cuda:0")
    lines = _render(report.print_result, res)
    assert max(map(len, lines)) <= 80
    base = res.baseline
    for r in res.runs:
        cells = [
            report._RUN_NAMES[r.label],
            f"{r.tokens_per_second:,.0f}",
            f"{r.median_step_seconds * 1e3:,.1f} ms",
            report._gib(r.peak_bytes),
        ]
        if r is not base:
            cells += [f"{r.tokens_per_second / base.tokens_per_second:.2f}x", f"{res.max_abs_diff(r):.2e}", "agree"]
        for cell in cells:
            assert _on_one_line(cell, lines), (cell, lines)
    assert _on_one_line("baseline", lines)
    assert _on_one_line("max |loss - torch|", lines) and _on_one_line("tokens/s", lines)


def test_the_op_table_on_a_cpu_is_one_line_per_reason(cpu_default):
    from polykernel.tools.demo import report

    rows = report.op_table(torch.device("cpu"), torch.float32)
    text = "\n".join(_render(report.print_op_table, rows, torch.device("cpu"), torch.float32))
    assert text.count("needs a CUDA device") == 1, text
    assert f"every op ({len(rows)}) chooses torch (auto)" in text
    assert len(text.splitlines()) <= 10, text


def test_the_op_table_fits_80_columns_without_breaking_a_name(cpu_default):
    from polykernel.tools.demo import report

    rows = report.op_table(torch.device("cpu"), torch.float32)
    rows[0] = {**rows[0], "chosen": "torch_compile", "source": "argument"}  # two choices: a row per op
    lines = _render(report.print_op_table, rows, torch.device("cpu"), torch.float32)
    assert max(map(len, lines)) <= 80
    assert " ".join(lines).count("needs a CUDA device") == 1  # shared by every op: one line under the table
    for r in rows:
        assert _on_one_line(r["op"], lines) and _on_one_line(f"{r['chosen']} ({r['source']})", lines)
        for i in r["impls"]:
            assert _on_one_line(i["name"] + ("*" if i["name"] == r["chosen"] else ""), lines)


def test_the_report_says_why_polykernel_is_no_faster_when_only_torch_impls_ran():
    from polykernel.tools.demo import report

    text = " ".join(" ".join(_render(report.print_result, _result("cpu"))).split())
    assert "on this CPU every op ran its torch impl (Triton and the GPU kernels need CUDA), so every run does the same work" in text
    assert "'vs torch' measures this machine's noise, not polykernel" in text and "read it as about 1.0x" in text
    assert "skipped triton, cute_dsl: needs a CUDA device" in text  # one reason, the impls it kept out named together
    text = " ".join(_render(report.print_result, _result("cuda:0", impl="triton")))
    assert "every op ran its torch impl" not in text


def test_the_closing_line_reads_as_a_sentence():
    from polykernel.tools.demo import report

    assert report.ok_line(_result("cpu", labels=("torch", "polykernel"))) == "ok: polykernel trains to the same losses as plain PyTorch."
    assert report.ok_line(_result("cpu", labels=("torch", "polykernel", "liger", "compile"))) == (
        "ok: polykernel, the Liger-Kernel patch and torch.compile train to the same losses as plain PyTorch."
    )
