"""A benchmark cut at its time limit keeps the rows it measured (``polykernel.tools.rows``): each
row is written and printed as soon as it is measured, and the file parses at every moment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from polykernel.tools.rows import RowFile, announce, read_rows

SRC = Path(__file__).resolve().parents[2] / "src"

# `polykernel bench` end to end on the CPU: its timing and the CUDA checks faked, a pause per
# row so that the run is still going when the test kills it.
_BENCH = """
import functools, sys, time, torch
from polykernel.tools import bench, bench_shapes

def fake_measure(fn, grad_inputs, backward, graph=False, warmup=25, rep=100):
    time.sleep(0.3)
    return 1.0, 0.0

bench.measure = fake_measure
bench.copy_bandwidth = lambda: 4000.0
bench_shapes.SHAPES = {"rms_norm": [("64x256", (64, 256))], "softmax": [("32x128", (32, 128))], "layer_norm": [("64x256", (64, 256))]}
bench.run = functools.partial(bench.run, device="cpu")
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda *a: "NVIDIA Test"
sys.exit(bench.main(["rms_norm", "softmax", "layer_norm", "--no-compile", "--dtype", "float32", "--out", sys.argv[1]]))
"""


def test_a_bench_killed_mid_run_keeps_the_rows_it_measured(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "log", "w+")
    proc = subprocess.Popen([sys.executable, "-c", _BENCH, str(tmp_path)], stdout=log, stderr=subprocess.STDOUT, env=env)
    path, rows = None, []
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None and len(rows) < 3:
            time.sleep(0.05)
            files = list(tmp_path.glob("*-call.json"))
            if files:
                path = files[0]
                rows = read_rows(path)["rows"]  # whole at every moment: never half written
    finally:
        proc.kill()  # SIGKILL: nothing of the process runs after it
        proc.wait()
    log.seek(0)
    printed = log.read()
    assert path is not None and len(rows) >= 3, f"no rows written while it ran:\n{printed[-3000:]}"
    assert path.name == "test-" + time.strftime("%Y-%m-%d") + "-call.json"
    kept = read_rows(path)
    assert kept["complete"] is False and kept["device"] == "NVIDIA Test" and kept["copy_GBps"] == 4000.0
    total = 3 * 2 * 3  # ops x modes x at least the automatic, torch and eager rows
    assert 3 <= len(kept["rows"]) < total, "the kill came after the run ended: nothing was cut"
    assert all(r["ms"] == 1.0 and r["error"] == "" for r in kept["rows"])
    first = kept["rows"][0]
    assert f"{first['op']} {first['shape']} {first['mode']} {first['impl']}: 1.000 ms" in printed  # printed as measured
    assert "estimate:" in printed.split(first["op"] + " " + first["shape"])[0]  # the estimate comes first


def test_a_row_file_is_complete_only_once_finished(tmp_path):
    lines = []
    out = RowFile(tmp_path / "sub" / "r.json", {"device": "x"}, echo=lines.append)
    assert read_rows(out.path) == {"device": "x", "complete": False, "rows": []}  # there before the first row
    out.add({"case": "a", "ms": 1.5})
    out.header["rate"] = 2.0
    out.add({"case": "b", "ms": float("nan")}, line="b: nan")
    assert read_rows(out.path)["rows"][1]["case"] == "b" and read_rows(out.path)["complete"] is False
    out.finish(seconds=3)
    got = json.loads(Path(out.path).read_text())
    assert got["complete"] is True and got["rate"] == 2.0 and got["seconds"] == 3 and len(got["rows"]) == 2
    assert lines[:2] == ["case=a  ms=1.5", "b: nan"]
    assert not list((tmp_path / "sub").glob("*.tmp*"))  # the temporary file was renamed, not left
    assert announce(4, 30, "cases", print_=lines.append) == 120 and lines[-1].startswith("estimate: 4 cases x ~30 s = ~2.0 min")


def test_a_script_stopped_by_timeout_keeps_its_rows(tmp_path):
    # `timeout` sends SIGTERM: Python dies at once (no finally), the rows written so far stay
    script = f"""
import sys, time
sys.path.insert(0, {str(SRC)!r})
from polykernel.tools.rows import RowFile
out = RowFile(sys.argv[1], {{"what": "t"}})
for i in range(100):
    out.add({{"i": i}})
    time.sleep(0.05)
out.finish()
"""
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "r.json")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("i=0")  # printed at once, not when the run ends
    proc.send_signal(signal.SIGTERM)
    proc.wait()
    kept = read_rows(tmp_path / "r.json")
    assert kept["complete"] is False and 1 <= len(kept["rows"]) < 100
    assert [r["i"] for r in kept["rows"]] == list(range(len(kept["rows"])))
