"""benchmarks/models/families.py and vision_families.py: between them every family that
``integrations.transformers.patch`` supports (a new family fails here until it has its benchmark
rows), each at its ~1B shape; and CPU smoke runs (``--tiny``) of the families added last and of the
two vision families, as the GPU plan runs the scripts: rows written as measured, polykernel's first
loss equal to plain's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from _scripts import BENCHMARKS, load_benchmark
from polykernel.backends import _fused_linear_cross_entropy as flce
from polykernel.integrations.transformers import SUPPORTED_MODEL_TYPES

SRC = BENCHMARKS.parent / "src"
families = load_benchmark("families")
vision_families = load_benchmark("vision_families")

# the text families families.py gained after its first version: each run here in --tiny mode
NEW_TEXT_FAMILIES = ("qwen2", "gemma", "olmo2")


def _is_vision(model_type: str) -> bool:
    from transformers import AutoConfig

    return hasattr(AutoConfig.for_model(model_type), "vision_config")


def test_the_scripts_cover_every_supported_family():
    vision = {t for t in SUPPORTED_MODEL_TYPES if _is_vision(t)}
    text = set(SUPPORTED_MODEL_TYPES) - vision
    assert vision == {"qwen2_vl", "qwen2_5_vl"}
    missing = sorted(text - set(families.FAMILIES))
    assert not missing, f"benchmarks/models/families.py's FAMILIES lacks {missing}: add each at a ~1B shape"
    assert set(vision_families.FAMILIES) == vision
    assert set(families.FAMILIES) <= set(SUPPORTED_MODEL_TYPES), "a family polykernel does not patch"
    assert set(NEW_TEXT_FAMILIES) <= set(families.FAMILIES)


def test_every_family_is_about_1b():
    # the full-size configs, built on the meta device (no memory, no init): ~1B parameters each
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    sizes = {}
    with torch.device("meta"):
        for family in families.FAMILIES:
            model = AutoModelForCausalLM.from_config(families.config_for(family, tiny=False))
            sizes[family] = sum(p.numel() for p in model.parameters())
        for family in vision_families.FAMILIES:
            model = AutoModelForImageTextToText.from_config(vision_families.config_for(family, tiny=False))
            sizes[family] = sum(p.numel() for p in model.parameters())
    outside = {f: f"{n / 1e9:.2f}B" for f, n in sizes.items() if not 0.7e9 <= n <= 3e9}
    assert not outside, outside


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_every_full_size_config_runs_a_step_on_the_meta_device(family):
    # the GPU run's first step at the full widths, its shapes only (two layers, one short sequence,
    # no memory): a config the model cannot run (2026-12-06: deepseek_v3 with BASE's 8 KV heads, MLA
    # giving every head its own keys) fails here, not on the device
    import torch
    from transformers import AutoModelForCausalLM

    config = families.config_for(family, tiny=False)
    config.num_hidden_layers = 2
    if family == "deepseek_v3":
        config.first_k_dense_replace = 1  # one dense layer, one MoE layer
    with torch.device("meta"):  # bf16 as on the GPU (transformers' grouped_mm MoE takes no float32)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        ids = torch.zeros(1, 16, dtype=torch.long)
        out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, 16, config.vocab_size)
    out.loss.backward()


def _run(script: str, tmp_path, *args: str) -> tuple[str, dict]:
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(BENCHMARKS / "models" / script), "--tiny", "--steps", "1", "--warmup", "1", "--json", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def _check_plain_and_polykernel(rows: dict) -> None:
    plain, pk = rows["plain"], rows["polykernel"]
    assert "error" not in plain and "error" not in pk, (plain, pk)
    assert plain["device"] == "cpu" and plain["tokens_per_second"] > 0 and plain["peak_memory_bytes"] is None
    assert math.isclose(pk["first_loss"], plain["first_loss"], rel_tol=1e-4), (pk["first_loss"], plain["first_loss"])
    assert pk["patched"] and pk["ops"]


@pytest.mark.parametrize("family", NEW_TEXT_FAMILIES)
def test_new_text_family_tiny_run(family, tmp_path):
    stdout, data = _run("families.py", tmp_path, "--families", family, "--variants", "plain,polykernel", "--profile", "3")
    assert stdout.startswith("estimate: 2 runs"), stdout[:200]  # announced before measuring
    assert data["complete"]
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == ["plain", "polykernel"] and {r["family"] for r in data["rows"]} == {family}
    assert all(r["wall_s"] > 0 for r in data["rows"]) and "s)\n" in stdout  # each process's time, kept and printed
    for r in data["rows"]:  # --profile: the step's three ops of most time (a CPU has no kernels), kept and printed
        assert len(r["kernels"]) == 3 and r["kernels"][0]["us"] >= r["kernels"][-1]["us"] > 0, r["kernels"]
        assert f"x  {r['kernels'][0]['name']}" in stdout
    _check_plain_and_polykernel(rows)
    # no --flce-chunk-mib: the library's own budget, set in the polykernel run and recorded (the
    # default half of test_flce_chunk_budget_is_set_in_each_run_and_recorded, on these runs)
    assert data["setup"]["flce_chunk_mib"] == rows["polykernel"]["flce_chunk_mib"] == flce.CHUNK_BYTES / 2**20
    (summary,) = data["summary"]
    assert summary["family"] == family and abs(summary["polykernel_loss_minus_plain"]) < 1e-3


def test_flce_chunk_budget_is_set_in_each_run_and_recorded(tmp_path):
    # the A/B of the fused linear CE's chunk budget in a training step: each child process sets it
    # before its first step (read back from the library there), the setup records it; plain
    # unaffected. Without the option, the library's default is set and recorded: checked on
    # test_new_text_family_tiny_run's runs (one child process fewer here)
    _, data = _run("families.py", tmp_path, "--families", "llama", "--variants", "plain,polykernel", "--flce-chunk-mib", "1")
    rows = {r["variant"]: r for r in data["rows"]}
    assert data["setup"]["flce_chunk_mib"] == 1 and rows["polykernel"]["flce_chunk_mib"] == 1
    assert "flce_chunk_mib" not in rows["plain"]
    _check_plain_and_polykernel(rows)
    cmd = [sys.executable, str(BENCHMARKS / "models" / "families.py"), "--tiny", "--flce-chunk-mib", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert proc.returncode != 0 and "argument --flce-chunk-mib: must be a positive integer, not '0'" in proc.stderr


@pytest.mark.parametrize("family", list(vision_families.FAMILIES))
def test_vision_family_tiny_run(family, tmp_path):
    # an image in each row; Liger's VL patch, where it fails (on a CPU, or with this transformers), is the row's error
    stdout, data = _run("vision_families.py", tmp_path, "--families", family, "--variants", "plain,polykernel,liger")
    assert stdout.startswith("estimate: 3 runs"), stdout[:200]
    assert data["complete"] and data["setup"]["image_side"] == vision_families.TINY_IMAGE_SIDE
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == ["plain", "polykernel", "liger"]
    _check_plain_and_polykernel(rows)
    vision = vision_families.FAMILIES[family][5]["depth"]
    assert rows["polykernel"]["patched"]["rope"] == vision + families.TINY["num_hidden_layers"]  # the vision blocks' rotary too
    liger = rows["liger"]
    assert liger["error"] if "error" in liger else math.isclose(liger["first_loss"], rows["plain"]["first_loss"], rel_tol=1e-3)


def test_plot_families_reads_each_files_gpu_and_lets_the_last_file_win(tmp_path):
    plot_families = load_benchmark("plot_families")

    def rows(folder, gpu, runs):
        folder.mkdir()
        (folder / "gpu.csv").write_text(f"name, clocks.max.sm [MHz], memory.total [MiB]\n{gpu}, 1980 MHz, 81559 MiB\n")
        path = folder / "families.json"
        recs = [{"family": f, "variant": v, "tokens_per_second": t} for f, v, t in runs]
        path.write_text(json.dumps({"rows": [*recs, {"family": "x", "variant": "liger", "error": "timed out"}]}))
        return path

    old = rows(tmp_path / "a", "NVIDIA H200", [("llama", "plain", 100.0), ("llama", "polykernel", 150.0)])
    new = rows(tmp_path / "b", "NVIDIA H100 80GB HBM3", [("llama", "plain", 50.0), ("llama", "polykernel", 60.0), ("llama", "liger", 55.0)])
    table = plot_families.speedups([old, new])
    assert table == {"llama": {"gpu": "H100", "polykernel": pytest.approx(1.2), "liger": pytest.approx(1.1), "compile": None}}
    assert plot_families.speedups([new, old])["llama"] == {"gpu": "H200", "polykernel": 1.5, "liger": None, "compile": None}
    # a rerun of some variants (no plain row) fills them in against the plain row on the same GPU kind only
    rerun = rows(tmp_path / "c", "NVIDIA H100 80GB HBM3", [("llama", "compile", 70.0), ("qwen2", "compile", 9.0)])
    assert plot_families.speedups([old, new, rerun]) == {
        "llama": {"gpu": "H100", "polykernel": pytest.approx(1.2), "liger": pytest.approx(1.1), "compile": pytest.approx(1.4)}
    }
    assert plot_families.speedups([new, old, rerun])["llama"]["compile"] is None  # plain measured on the H200
    pytest.importorskip("matplotlib")
    png = tmp_path / "f.png"
    plot_families.plot(table, png, "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
