"""``polykernel bench``'s bookkeeping on the CPU: which rows a run has (the automatic choice with
the impl it chose, each forced impl, the reference, torch.compile), the sweep, the file names,
the tables (terminal and plain), the plot, and its clear errors. Timing itself needs CUDA
(``measure`` is replaced here by a fake that still calls each contender once)."""

from __future__ import annotations

import argparse
import io
import json
import math

import pytest

from polykernel.tools import bench, bench_shapes
from polykernel.tools.console import make_console


def test_sweep_shapes_scale_one_dim_largest_first():
    assert bench.sweep_shapes("rms_norm") == [
        ("16384x4096", (16384, 4096)),
        ("4096x4096", (4096, 4096)),
        ("1024x4096", (1024, 4096)),
        ("256x4096", (256, 4096)),
    ]
    rope = bench.sweep_shapes("rope")
    assert rope[0] == bench.SHAPES["rope"][0] and rope[1] == ("q4x32x1024x128,k8", (4, 32, 1024, 128))
    assert [s for _, s in bench.sweep_shapes("fused_linear_cross_entropy")] == [(8192, 4096, 128256), (2048, 4096, 128256)]
    assert [s[2] for _, s in bench.sweep_shapes("group_norm")] == [64, 16, 4, 1]  # the image height, not the batch of 16
    # README shapes stay, the sweep adds the smaller sizes; only the series is flagged for the plot
    cases = bench.cases_for("rms_norm", sweep=True)
    assert [c[0] for c in cases][:4] == [label for label, _ in bench.SHAPES["rms_norm"]]
    assert [c[2] for c in cases] == [True, False, False, False, True, True, True]
    assert all(not c[2] for c in bench.cases_for("rms_norm", sweep=False))


def test_device_slug():
    assert bench.device_slug("NVIDIA H200") == "h200"
    assert bench.device_slug("NVIDIA A100-SXM4-80GB") == "a100-sxm4"
    assert bench.device_slug("") == "gpu"


def _fake_run(monkeypatch, **kw):
    torch = pytest.importorskip("torch")
    calls = []

    def fake_measure(fn, grad_inputs, backward, graph=False, warmup=25, rep=100):
        with torch.set_grad_enabled(backward):  # as measure: forward under no_grad
            out = fn()  # runs the contender (so the dispatcher records its choice)
        if backward:
            outs = bench._outputs(out)
            torch.autograd.grad(outs, grad_inputs, [torch.ones_like(o) for o in outs])
        calls.append((warmup, rep))
        return 0.5, 1.0

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4000.0)
    monkeypatch.setattr(bench_shapes, "SHAPES", {"rms_norm": [("64x256", (64, 256))], "softmax": [("32x128", (32, 128))]})
    rows, copy = bench.run(
        ["rms_norm", "softmax"], False, torch.float32, device="cpu", console=make_console(io.StringIO(), force_terminal=False), **kw
    )
    return rows, copy, calls


def test_run_has_an_automatic_row_with_its_choice_beside_each_forced_impl(monkeypatch):
    rows, copy, _ = _fake_run(monkeypatch)
    assert copy == 4000.0
    for op in ("rms_norm", "softmax"):
        for mode in ("fwd", "fwd+bwd"):
            mine = [r for r in rows if r["op"] == op and r["mode"] == mode]
            impls = [r["impl"] for r in mine]
            assert impls[0] == "polykernel" and "polykernel:torch" in impls and "eager reference" in impls
            if op == "rms_norm":  # the compiled provider is a row of its own (cuda_jit too, on a GPU)
                assert "polykernel:torch_compile" in impls
            auto = mine[0]
            # the conftest runs Triton through its interpreter on the CPU: the choice is a real impl name
            assert auto["chosen"] in {r["impl"].removeprefix("polykernel:") for r in mine if r["impl"].startswith("polykernel:")}
            assert all(r["chosen"] == "" for r in mine[1:])
            assert all(math.isclose(r["GB/s"] / 4000.0 * 100, r["% copy"]) for r in mine)
            assert all(r["size"] > 0 for r in mine)


def test_sweep_times_extra_sizes_shorter(monkeypatch):
    monkeypatch.setattr(bench_shapes, "_SWEEP_DIM", {"rms_norm": (0, 1), "softmax": (0, 1)})
    rows, _, calls = _fake_run(monkeypatch, sweep=True)
    assert {r["shape"] for r in rows if r["op"] == "rms_norm"} == {"64x256", "16x256"}
    assert all(r["sweep"] for r in rows)
    assert (25, 100) in calls and (10, 40) in calls  # README size at full length, the extra one shorter


def _result():
    rows = []
    for size, scale in ((4.0, 0.5), (16.0, 0.8), (64.0, 1.0)):
        for impl, tbs in (("polykernel", 3.5), ("polykernel:torch", 2.0), ("torch.compile", 3.0)):
            for mode in ("fwd graph", "fwd+bwd graph"):
                rows.append(
                    {
                        "op": "rms_norm",
                        "shape": f"{size}",
                        "mode": mode,
                        "impl": impl,
                        "chosen": "triton" if impl == "polykernel" else "",
                        "sweep": True,
                        "ms": 0.1,
                        "peak_extra_MiB": 0.0,
                        "error": "",
                        "size": size,
                        "GB/s": 1e3 * tbs * scale,
                        "% copy": 50.0,
                    }
                )
    rows.append(
        {
            "op": "fused_linear_cross_entropy",
            "shape": "N8",
            "mode": "fwd graph",
            "impl": "polykernel",
            "chosen": "triton",
            "sweep": True,
            "ms": 1.0,
            "peak_extra_MiB": 1.0,
            "error": "",
            "size": 10.0,
            "TFLOP/s": 500.0,
        }
    )
    rows.append(dict(rows[0], impl="polykernel:liger", ms=float("nan"), error="ImplNotAvailableError: refuses N > 65536"))
    return {"device": "NVIDIA H200", "copy_GBps": 4275.0, "date": "2026-12-01", "mode": "graph", "rows": rows}


def test_tables_on_a_terminal_and_plain():
    result = _result()
    for terminal in (True, False):
        buf = io.StringIO()
        bench.print_rows(result["rows"], make_console(buf, force_terminal=terminal, width=250))
        text = buf.getvalue()
        assert ("\x1b[" in text) is terminal  # colours and styles only on a terminal
        assert "refuses N > 65536" in text and "500 TFLOP/s" in text and "triton" in text
        line = next(ln for ln in text.splitlines() if "polykernel:torch" in ln)
        assert "rms_norm" in line and "1.00" in line  # 2 TB/s x 0.5


def test_plot_and_load(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result()))
    png = tmp_path / "r.png"
    out = io.StringIO()
    args = bench_args(["--load", str(path), "--plot", str(png)])
    args.console = make_console(out, force_terminal=False)
    assert bench.run_cli(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in out.getvalue()
    # --plot without a file: next to the results
    args = bench_args(["--load", str(path), "--plot"])
    args.console = make_console(io.StringIO(), force_terminal=False)
    assert bench.run_cli(args) == 0 and (tmp_path / "r.png").exists()


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result()))
    with pytest.raises(ImportError, match=r"polykernel bench --plot: matplotlib is not installed.*: pip install 'matplotlib>=3\.7'"):
        bench.run_cli(bench_args(["--load", str(path), "--plot", str(tmp_path / "x.png")]))


def test_plot_of_nothing_is_an_error(tmp_path):
    pytest.importorskip("matplotlib")
    from polykernel.tools.plotting import plot_bench

    with pytest.raises(ValueError, match="no measured rows"):
        plot_bench({"rows": [dict(_result()["rows"][-1])]}, str(tmp_path / "x.png"))


def bench_args(argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


def test_moe_experts_rows_report_tflops_next_to_transformers_experts(monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

    def fake_measure(fn, grad_inputs, backward, graph=False, warmup=25, rep=100):
        out = fn()
        if backward:
            torch.autograd.grad(bench._outputs(out), grad_inputs, [torch.ones_like(o) for o in bench._outputs(out)])
        return 0.5, 1.0

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4000.0)
    monkeypatch.setattr(bench_shapes, "SHAPES", {"moe_experts": [("T6,H16,I16,E4,k2", (6, 16, 16, 4, 2))]})
    monkeypatch.setenv("POLYKERNEL_IMPL", "torch")  # (the interpreter's Triton is not what this checks)
    rows, _ = bench.run(["moe_experts"], False, torch.float32, device="cpu", console=make_console(io.StringIO(), force_terminal=False))
    impls = {r["impl"] for r in rows}
    assert {"transformers grouped_mm", "transformers eager", "eager reference", "polykernel:torch"} <= impls
    fwd = next(r for r in rows if r["impl"] == "polykernel:torch" and r["mode"] == "fwd")
    bwd = next(r for r in rows if r["impl"] == "polykernel:torch" and r["mode"] == "fwd+bwd")
    assert math.isclose(fwd["TFLOP/s"], 6 * 12 * 16 * 16 / 0.5e-3 / 1e12) and math.isclose(bwd["TFLOP/s"], 3 * fwd["TFLOP/s"])
    assert all(r["error"] == "" for r in rows), [r["error"] for r in rows if r["error"]]


def test_moe_experts_gpt_oss_rows_report_tflops_next_to_transformers_experts(monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

    def fake_measure(fn, grad_inputs, backward, graph=False, warmup=25, rep=100):
        out = fn()
        if backward:
            torch.autograd.grad(bench._outputs(out), grad_inputs, [torch.ones_like(o) for o in bench._outputs(out)])
        return 0.5, 1.0

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4000.0)
    monkeypatch.setattr(bench_shapes, "SHAPES", {"moe_experts_gpt_oss": [("T6,H16,I16,E4,k2", (6, 16, 16, 4, 2))]})
    monkeypatch.setenv("POLYKERNEL_IMPL", "torch")
    rows, _ = bench.run(
        ["moe_experts_gpt_oss"], False, torch.float32, device="cpu", console=make_console(io.StringIO(), force_terminal=False)
    )
    assert {"transformers grouped_mm", "transformers eager", "eager reference", "polykernel:torch"} <= {r["impl"] for r in rows}
    fwd = next(r for r in rows if r["impl"] == "transformers eager" and r["mode"] == "fwd")
    assert math.isclose(fwd["TFLOP/s"], 6 * 12 * 16 * 16 / 0.5e-3 / 1e12)
    assert all(r["error"] == "" for r in rows), [r["error"] for r in rows if r["error"]]


def test_option_rows_pass_their_options(monkeypatch):
    # a row named in bench.OPTIONS (CE with softcap) calls every contender with those options
    torch = pytest.importorskip("torch")
    import polykernel

    seen = []
    real = polykernel.cross_entropy

    def spy(*args, **kwargs):
        seen.append(kwargs.get("softcap"))
        return real(*args, **kwargs)

    monkeypatch.setattr(polykernel, "cross_entropy", spy)
    monkeypatch.setattr(bench, "measure", lambda fn, *a, **kw: (fn(), (0.5, 1.0))[1])
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4000.0)
    monkeypatch.setattr(bench_shapes, "SHAPES", {"cross_entropy": [("8x64,softcap30", (8, 64))]})
    monkeypatch.setitem(bench.OPTIONS, ("cross_entropy", "8x64,softcap30"), {"softcap": 30.0})
    rows, _ = bench.run(["cross_entropy"], False, torch.float32, device="cpu", console=make_console(io.StringIO(), force_terminal=False))
    assert rows and seen and set(seen) == {30.0}
    assert "softcap" in bench.OPTIONS[("cross_entropy", "8192x256000,softcap30")]
    assert ("fused_linear_cross_entropy", "N8192,H2304,V256000,softcap30,z1e-4") in bench.OPTIONS


@pytest.mark.parametrize("name", ["fused_linear_dpo_loss", "fused_linear_grpo_loss"])
def test_preference_loss_rows_are_rated_by_the_head_gemms(monkeypatch, name):
    # the bookkeeping only (measure replaced): a row per contender, TFLOP/s from ops/_preference.py's flops
    torch = pytest.importorskip("torch")

    def fake_measure(fn, grad_inputs, backward, graph=False, warmup=25, rep=100):
        out = fn()
        if backward:
            torch.autograd.grad(bench._outputs(out), grad_inputs, [torch.ones_like(o) for o in bench._outputs(out)])
        return 0.5, 1.0

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4000.0)
    monkeypatch.setattr(bench_shapes, "SHAPES", {name: [("R2,T3,H8,V40", (2, 3, 8, 40))]})
    monkeypatch.setenv("POLYKERNEL_IMPL", "torch")  # (the interpreter's Triton is not what this checks)
    rows, _ = bench.run([name], False, torch.float32, device="cpu", console=make_console(io.StringIO(), force_terminal=False))
    assert all(r["error"] == "" for r in rows), [r["error"] for r in rows if r["error"]]
    fwd = next(r for r in rows if r["impl"] == "polykernel:torch" and r["mode"] == "fwd")
    bwd = next(r for r in rows if r["impl"] == "polykernel:torch" and r["mode"] == "fwd+bwd")
    assert math.isclose(fwd["TFLOP/s"], 2 * 6 * 8 * 40 / 0.5e-3 / 1e12) and math.isclose(bwd["TFLOP/s"], 3 * fwd["TFLOP/s"])


def test_an_op_without_bench_shapes_is_a_clear_error(monkeypatch):
    # README shapes first; else the op file's Op(bench_shapes=...); else an error naming the op
    assert bench.shapes_for("softmax") == bench.SHAPES["softmax"]
    monkeypatch.setattr(bench_shapes, "SHAPES", {})
    with pytest.raises(ValueError, match=r"activation\.softmax: no bench shapes \(declare them in its op file"):
        bench.cases_for("softmax", sweep=False)
