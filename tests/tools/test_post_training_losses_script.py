"""benchmarks/kernels/post_training_losses.py's CPU smoke run (``--tiny``), as the GPU plan runs the
script: its rows are written as measured, polykernel's own choice agrees with its torch impl and
with the plain loss, and Liger's row says why it did not run on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from _scripts import BENCHMARKS

SCRIPT = BENCHMARKS / "kernels" / "post_training_losses.py"
SRC = BENCHMARKS.parent / "src"


def test_tiny_run_writes_agreeing_rows(tmp_path):
    out = tmp_path / "rows.json"
    pythonpath = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath, "CUDA_VISIBLE_DEVICES": ""}  # a CPU run also on a GPU machine
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--only", "dpo,kl_div", "--impls", "auto,torch,liger,plain", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("estimate: 8 rows"), proc.stdout[:200]  # announced before measuring
    data = json.loads(out.read_text())
    assert data["complete"] and data["device"] == "cpu"
    rows = {(r["loss"], r["impl"]): r for r in data["rows"]}
    assert list(rows) == [(loss, impl) for loss in ("dpo", "kl_div") for impl in ("auto", "torch", "liger", "plain")]
    for loss in ("dpo", "kl_div"):
        for impl in ("auto", "torch", "plain"):
            row = rows[loss, impl]
            assert "error" not in row, row
            assert row["agrees"] and row["ms"] > 0 and row["peak_extra_mib"] is None, row
        assert abs(rows[loss, "auto"]["loss_value"] - rows[loss, "torch"]["loss_value"]) <= 1e-5 * abs(rows[loss, "torch"]["loss_value"])
        assert rows[loss, "liger"]["error"].startswith("skipped on CPU"), rows[loss, "liger"]
