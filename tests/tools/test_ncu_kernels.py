"""benchmarks/kernels/ncu_kernels.py on the CPU: ncu's raw CSV parsed, kernels attributed to cases by NVTX
range, the report's arithmetic, the case list (no peer imported), and the parent's handling of ncu
(missing, no counter access, an unknown metric, success) through a stand-in ``ncu`` script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "ncu_kernels.py"


def _load():
    return load_benchmark("ncu_kernels")


nk = _load()

# ncu --import REPORT --csv --page raw --print-units base, written by hand in its documented shape:
# ncu's own lines, a header (ID, process, the two NVTX columns, kernel name, launch tuples, metric
# names), a units row, then one row per kernel. Case 0 is the 2 GiB copy (1 ms), case 1 an
# rms_norm forward of two kernels, profiled twice; the last kernel ran outside every case's range.
NVTX = "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
NVTX2 = "Id:Domain:Start/Stop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
CSV = textwrap.dedent(
    f'''\
    ==PROF== Connected to process 4242 (/usr/bin/python3.12)
    "ID","Process ID","Process Name","Host Name","{NVTX}","{NVTX2}","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum","launch__block_size","launch__grid_size","launch__registers_per_thread","launch__shared_mem_per_block_dynamic","launch__shared_mem_per_block_static","launch__waves_per_multiprocessor","lts__t_sector_hit_rate.pct","sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active"
    "","","","","","","","","","","","","","byte","byte","%","nsecond","","","register/thread","byte/block","byte/block","","%","%","%"
    "0","4242","python3.12","127.0.0.1","1  ""<default domain>:ncucase-000-0:none:none:none:none:none:none""","","void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 2>>(int, T2, T3)","1","7","(128, 1, 1)","(4194304, 1, 1)","0","9.0","2,147,483,648","2,147,483,648","91.2","1,000,000","128","4194304","16","0","0","248.24","0.5","12.3","85.1"
    "1","4242","python3.12","127.0.0.1","1  ""<default domain>:ncucase-000-1:none:none:none:none:none:none""","","void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 2>>(int, T2, T3)","1","7","(128, 1, 1)","(4194304, 1, 1)","0","9.0","2,147,483,648","2,147,483,648","91.0","1,000,000","128","4194304","16","0","0","248.24","0.5","12.3","85.0"
    "2","4242","python3.12","127.0.0.1","1  ""<default domain>:ncucase-001-0:none:none:none:none:none:none""","","_rms_norm_fwd_kernel","1","7","(256, 1, 1)","(16384, 1, 1)","0","9.0","150,000,000","134,217,728","84.0","70,000","256","16384","32","0","16","7.76","1.2","20.0","70.0"
    "3","4242","python3.12","127.0.0.1","1  ""<default domain>:ncucase-001-0:none:none:none:none:none:none""","","_colsum_kernel","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0","8,192","0","0.1","3,000","128","132","24","1024","0","1.00","n/a","1.0","10.0"
    "4","4242","python3.12","127.0.0.1","1  ""<default domain>:ncucase-001-1:none:none:none:none:none:none""","","_rms_norm_fwd_kernel","1","7","(256, 1, 1)","(16384, 1, 1)","0","9.0","150,000,000","134,217,728","82.0","72,000","256","16384","32","0","16","7.76","1.4","20.0","72.0"
    "5","4242","python3.12","127.0.0.1","1  ""<default domain>:ncucase-001-1:none:none:none:none:none:none""","","_colsum_kernel","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0","8,192","0","0.1","3,000","128","132","24","1024","0","1.00","n/a","1.0","10.0"
    "6","4242","python3.12","127.0.0.1","","","stray_kernel","1","7","(32, 1, 1)","(1, 1, 1)","0","9.0","0","0","0","1,500","32","1","8","0","0","0.01","0","0","3"
    ==PROF== Disconnected from process 4242
    '''
)
IDEAL_RMS = 2 * 16384 * 4096 * 2 + 4096 * 2  # rms_norm bytes_moved, 16384x4096 bf16 forward
RECORDS = [
    {"id": 0, "op": "copy", "label": "2GiB", "mode": "fwd", "impl": "torch", "name": "copy/2GiB/fwd/torch", "ideal_bytes": 2**32},
    {"id": 1, "op": "rms_norm", "label": "16384x4096", "mode": "fwd", "impl": "triton", "name": "rms_norm/16384x4096/fwd/triton", "ideal_bytes": IDEAL_RMS},
    {"id": 2, "op": "softmax", "label": "8192x32768", "mode": "fwd", "impl": "quack", "name": "softmax/8192x32768/fwd/quack", "skipped": "no quack impl registered for softmax"},
]  # fmt: skip


def test_parse_raw_csv_reads_kernels_in_base_units():
    kernels = nk.parse_raw_csv(CSV)
    assert [k["id"] for k in kernels] == list(range(7))
    k = kernels[2]
    assert k["kernel"] == "_rms_norm_fwd_kernel" and k["grid"] == "(16384, 1, 1)" and k["block"] == "(256, 1, 1)"
    assert k["metrics"][nk.TIME] == pytest.approx(70e-6)  # nanoseconds to seconds
    assert k["metrics"][nk.READ] == 150_000_000 and k["metrics"][nk.WRITE] == 134_217_728  # thousands separators
    assert k["metrics"][nk.SMEM_STATIC] == 16 and k["metrics"][nk.OCCUPANCY] == 70.0
    assert kernels[3]["metrics"][nk.L2_HIT] is None  # n/a
    assert "ncucase-001-0" in k["nvtx"] and kernels[6]["nvtx"].strip() == ""
    assert nk.parse_raw_csv("==PROF== no kernels were profiled\n") == []


def test_units_and_names():
    assert nk.to_base("1.5", "usecond") == pytest.approx(1.5e-6)
    assert nk.to_base("2", "Mbyte") == 2e6 and nk.to_base("3", "Kbyte/block") == 3e3
    assert nk.to_base("1,024", "register/thread") == 1024 and nk.to_base("n/a", "%") is None
    assert nk.short_name("void at::native::vectorized_elementwise_kernel<4, F<float>, A>(int, T2, T3)") == (
        "at::native::vectorized_elementwise_kernel"
    )
    assert nk.short_name("k" * 100, width=10) == "k" * 9 + "…"


def test_attribute_by_nvtx_range():
    by_call, loose, how = nk.attribute(nk.parse_raw_csv(CSV))
    assert how == "NVTX ranges"
    assert sorted(by_call) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [k["kernel"] for k in by_call[(1, 1)]] == ["_rms_norm_fwd_kernel", "_colsum_kernel"]
    assert [k["kernel"] for k in loose] == ["stray_kernel"]


# Without NVTX columns: each call starts with the marker kernel, whose program count is
# case * 64 + call + 1 (here case 3, calls 0 and 1; then case 4, call 0); a kernel before any marker
# belongs to no case.
CSV_MARKERS = textwrap.dedent(
    """\
    "ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","gpu__time_duration.sum","launch__grid_size"
    "","","","","","","","","","","","nsecond",""
    "0","1","python3","h","early_kernel","1","7","(32, 1, 1)","(1, 1, 1)","0","9.0","1,000","1"
    "1","1","python3","h","ncu_case_marker","1","7","(32, 1, 1)","(193, 1, 1)","0","9.0","1,000","193"
    "2","1","python3","h","softmax_fwd","1","7","(256, 1, 1)","(8192, 1, 1)","0","9.0","90,000","8192"
    "3","1","python3","h","ncu_case_marker","1","7","(32, 1, 1)","(194, 1, 1)","0","9.0","1,000","194"
    "4","1","python3","h","softmax_fwd","1","7","(256, 1, 1)","(8192, 1, 1)","0","9.0","91,000","8192"
    "5","1","python3","h","ncu_case_marker","1","7","(32, 1, 1)","(257, 1, 1)","0","9.0","1,000",""
    "6","1","python3","h","softmax_bwd","1","7","(256, 1, 1)","(8192, 1, 1)","0","9.0","99,000","8192"
    "7","1","python3","h","reduce","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","2,000","132"
    """
)


def test_attribute_by_marker_kernels_without_nvtx_columns():
    kernels = nk.parse_raw_csv(CSV_MARKERS)
    assert len(kernels) == 8 and all(k["nvtx"] == "" for k in kernels)
    by_call, loose, how = nk.attribute(kernels)
    assert how == "marker kernels" and sorted(by_call) == [(3, 0), (3, 1), (4, 0)]
    assert [k["id"] for k in by_call[(3, 1)]] == [4]
    assert [k["kernel"] for k in by_call[(4, 0)]] == ["softmax_bwd", "reduce"]  # marker count from the Grid Size tuple
    assert [k["kernel"] for k in loose] == ["early_kernel"]


def test_marker_kernel_launches_its_programs(monkeypatch):
    import torch

    monkeypatch.setattr(nk, "_marker_kernel", None)
    nk.mark(1, 2, device="cpu")  # Triton's interpreter here: 64 + 2 + 1 programs, each storing 1
    kernel, buf = nk._marker_kernel
    assert kernel.__name__ == nk.MARKER and buf.tolist() == [1] and buf.dtype == torch.int32


def test_report_arithmetic():
    report = nk.build_report(RECORDS, nk.parse_raw_csv(CSV), {"device": "NVIDIA H200"})
    copy_tbps = 2**32 / 1e-3 / 1e12  # 4 GiB moved in 1 ms
    assert report["meta"]["copy_TBps"] == pytest.approx(copy_tbps)
    copy, rms, skipped = report["cases"]
    assert copy["us"] == pytest.approx(1000) and copy["x_copy_time"] == pytest.approx(1.0)
    assert copy["verdict"].startswith("at copy speed")

    dram = 150_000_000 + 134_217_728 + 8_192  # one call: both kernels
    us = (73.0 + 75.0) / 2  # mean over the two calls
    bw = copy_tbps * 1e6  # bytes per µs
    assert rms["n_kernels"] == 2 and rms["us"] == pytest.approx(us)
    assert rms["dram_bytes"] == pytest.approx(dram)
    assert rms["bytes_over_ideal_pct"] == pytest.approx(100 * (dram / IDEAL_RMS - 1))
    assert rms["TBps_ideal"] == pytest.approx(IDEAL_RMS / (us * 1e-6) / 1e12)
    assert rms["TBps_dram"] == pytest.approx(dram / (us * 1e-6) / 1e12)
    assert rms["us_at_copy"] == pytest.approx(IDEAL_RMS / bw)
    assert rms["us_extra_bytes"] == pytest.approx((dram - IDEAL_RMS) / bw)
    assert rms["us_below_copy"] == pytest.approx(us - dram / bw)
    # the split adds up: ideal at copy + extra bytes + below copy = the measured time
    assert rms["us_at_copy"] + rms["us_extra_bytes"] + rms["us_below_copy"] == pytest.approx(us)
    assert rms["us_small_kernels"] == pytest.approx(3.0)  # _colsum moves < 5% of the bytes
    assert rms["target_TBps"] == 3.95
    main, small = rms["kernels"]
    assert main["us"] == pytest.approx(71.0) and main["occupancy_pct"] == pytest.approx(71.0)  # means over calls
    assert main["dram_TBps"] == pytest.approx((150_000_000 + 134_217_728) / 71e-6 / 1e12)
    assert main["smem_bytes"] == 16 and main["registers"] == 32 and small["l2_hit_pct"] is None
    assert "extra bytes" in rms["verdict"] and "below copy bandwidth" in rms["verdict"] and "7.76 waves" in rms["verdict"]
    assert "us" not in skipped and skipped["skipped"].startswith("no quack")
    assert [k["kernel"] for k in report["unattributed"]] == ["stray_kernel"]

    md = nk.markdown(report)
    assert "rms_norm/16384x4096/fwd/triton" in md and "cache-control all" in md and "4.29 TB/s" in md
    assert "no quack impl registered for softmax" in md and "stray_kernel" in md
    json.dumps(report)  # serialisable as written


def test_calls_with_different_kernels_list_the_first_and_say_so():
    kernels = nk.parse_raw_csv(CSV)
    kernels = [k for k in kernels if k["id"] != 5]  # the second call lost its small kernel
    report = nk.build_report(RECORDS, kernels, {})
    rms = report["cases"][1]
    assert rms["n_kernels"] == 2 and "different kernels" in rms["note"]
    assert rms["us"] == pytest.approx((73.0 + 72.0) / 2)  # totals still per call


def test_cases_build_on_cpu_without_peers():
    names = [c.name for c in nk.build_cases()]
    assert names[0] == "copy/2GiB/fwd/torch" and len(names) == len(set(names))
    assert "rms_norm/16384x4096/fwd/quack" in names and "rope/q4x32x4096x128,k8/fwd+bwd/triton" in names
    assert not any(n.startswith("fused_linear") for n in names)  # optional: asked for by name
    assert [c.name for c in nk.build_cases(patterns=["fused_linear*"])][1:] == [
        "fused_linear_cross_entropy/N8192,H4096,V128256/fwd+bwd/triton"
    ]
    assert {c.impl for c in nk.build_cases(quick=True)[1:]} == {"triton"}
    assert {c.op for c in nk.build_cases(only=["softmax", ""])} == {"copy", "softmax"}
    # every case's shape is a bench shape, and on this CPU machine its verdict comes without
    # importing a peer (in a fresh process: other tests may have imported one here)
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(SCRIPT.parent)!r})
        import ncu_kernels as nk
        for c in nk.build_cases(only=["rms_norm", "softmax", "cross_entropy", "layer_norm", "rope", "fused_add_rms_norm",
                                      "fused_linear_cross_entropy"]):
            if c.op != "copy":
                nk.shape_of(c.op, c.label)
            print(c.name, "|", nk.skip_reason(c, "cpu", torch.bfloat16))
        peers = sorted(m for m in sys.modules if m.split(".")[0] in ("quack", "liger_kernel", "cutlass", "cuda"))
        print("PEERS", peers)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" | ") for line in out.stdout.splitlines() if " | " in line)
    assert lines["softmax/8192x32768/fwd/quack"] == "no quack impl registered for softmax"
    for peer in ("quack", "liger", "cute_dsl"):  # (Triton may run here, in its interpreter)
        assert lines[f"rms_norm/16384x4096/fwd/{peer}"] == "needs a CUDA device"
    assert lines["rms_norm/16384x4096/fwd/torch"] == "None" and lines["copy/2GiB/fwd/torch"] == "None"
    assert "PEERS []" in out.stdout


def test_child_runs_the_cases_and_records_them_on_cpu(tmp_path, monkeypatch):
    # The child's own steps (inputs, warm-up, marker, calls, ideal bytes, skips) with the CUDA
    # profiler calls left out; the torch impl at the real shape, peers refused on this machine.
    monkeypatch.setattr(nk, "_marker_kernel", None)
    cases = [
        nk.Case("rms_norm", "16384x4096", "fwd", "torch"),
        nk.Case("rms_norm", "16384x4096", "fwd", "quack"),
        nk.Case("softmax", "8192x32768", "fwd", "quack"),
    ]
    manifest, result = tmp_path / "cases.json", tmp_path / "records.json"
    manifest.write_text(json.dumps([{"id": 7 + i, **nk.asdict(c)} for i, c in enumerate(cases)]))
    assert nk.main(["--child", str(manifest), "--child-result", str(result), "--child-device", "cpu", "--calls", "1"]) == 0
    done = json.loads(result.read_text())
    assert done["meta"]["device"] == "cpu"
    torch_rec, quack_rec, softmax_rec = done["records"]
    assert torch_rec["id"] == 7 and "error" not in torch_rec and "skipped" not in torch_rec
    assert torch_rec["ideal_bytes"] == IDEAL_RMS and torch_rec["name"] == "rms_norm/16384x4096/fwd/torch"
    assert quack_rec["skipped"] == "needs a CUDA device"
    assert softmax_rec["id"] == 9 and softmax_rec["skipped"] == "no quack impl registered for softmax"


# A stand-in for ncu: --version, --query-metrics, a profile run (writes the child's records and a
# report file, or fails as FAKE_NCU_MODE says) and --import (prints the canned CSV).
FAKE_NCU = """\
import json, os, sys
args = sys.argv[1:]
mode = os.environ["FAKE_NCU_MODE"]
with open(os.environ["FAKE_NCU_CALLS"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if args == ["--version"]:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\\nVersion 2025.3.1.0 (build 1)")
elif args == ["--query-metrics"]:
    print("Device NVIDIA H200 (GH100)\\n" + "\\n".join(n.split(".")[0] + "  some description" for n in json.loads(os.environ["FAKE_NCU_LISTED"])))
elif "--import" in args:
    sys.stdout.write(open(os.environ["FAKE_NCU_CSV"]).read())
elif mode == "perm":
    print("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters")
    sys.exit(1)
else:
    metrics = args[args.index("--metrics") + 1].split(",")
    if mode == "badmetric" and "sm__throughput.avg.pct_of_peak_sustained_elapsed" in metrics:
        print("==ERROR== Failed to find metric sm__throughput.avg.pct_of_peak_sustained_elapsed")
        sys.exit(1)
    cases = json.load(open(args[args.index("--child") + 1]))
    records = json.loads(os.environ["FAKE_NCU_RECORDS"])[: len(cases)]
    with open(args[args.index("--child-result") + 1], "w") as f:
        json.dump({"meta": {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6"}, "records": records}, f)
    open(args[args.index("--export") + 1], "w").write("report")
"""


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch):
    ncu = tmp_path / "ncu"
    ncu.write_text(f"#!{sys.executable}\n" + FAKE_NCU)
    ncu.chmod(0o755)
    (tmp_path / "raw.csv").write_text(CSV)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_NCU_CSV", str(tmp_path / "raw.csv"))
    monkeypatch.setenv("FAKE_NCU_CALLS", str(calls))
    monkeypatch.setenv("FAKE_NCU_RECORDS", json.dumps(RECORDS))
    listed = [m for m in nk.METRICS if m != nk.L2_HIT]  # this "GPU" lacks the L2 hit rate
    monkeypatch.setenv("FAKE_NCU_LISTED", json.dumps(listed))
    return ncu, lambda: [json.loads(line) for line in calls.read_text().splitlines()]


def _main(tmp_path, ncu, mode, monkeypatch, *extra):
    monkeypatch.setenv("FAKE_NCU_MODE", mode)
    out = tmp_path / "out"
    code = nk.main(["--out", str(out), "--ncu", str(ncu), "--only", "rms_norm", *extra])
    return code, json.loads((out / "ncu_kernels.json").read_text()), (out / "ncu_kernels.md").read_text()


def test_main_profiles_through_ncu_and_writes_the_report(tmp_path, fake_ncu, monkeypatch, capsys):
    ncu, calls = fake_ncu
    code, report, md = _main(tmp_path, ncu, "ok", monkeypatch)
    assert code == 0 and report["meta"]["device"] == "NVIDIA H200" and report["meta"]["ncu_version"].startswith("Version 2025")
    assert report["meta"]["dropped_metrics"] == {nk.L2_HIT: "not listed by ncu --query-metrics on this GPU"}
    profile = next(c for c in calls() if "--export" in c)
    for flag, value in (("--clock-control", "none"), ("--profile-from-start", "off"), ("--calls", "2")):
        assert profile[profile.index(flag) + 1] == value
    assert "--nvtx" in profile and nk.L2_HIT not in profile[profile.index("--metrics") + 1]
    assert profile[profile.index("--child") - 1] == str(SCRIPT)
    rms = next(c for c in report["cases"] if c["op"] == "rms_norm")
    assert rms["n_kernels"] == 2 and rms["TBps_ideal"] > 0
    assert "## rms_norm/16384x4096/fwd/triton" in md
    # the stand-in wrote records for the first three cases only: the others say so
    assert any(c.get("error", "").startswith("no record: the child stopped") for c in report["cases"])


def test_main_without_counter_access_records_the_error(tmp_path, fake_ncu, monkeypatch, capsys):
    ncu, _ = fake_ncu
    code, report, md = _main(tmp_path, ncu, "perm", monkeypatch)
    assert code == 0 and "ERR_NVGPUCTRPERM" in report["meta"]["error"] and "ERR_NVGPUCTRPERM" in md
    assert report["cases"] == []


def test_main_drops_a_metric_ncu_rejects_and_retries(tmp_path, fake_ncu, monkeypatch, capsys):
    ncu, calls = fake_ncu
    code, report, _ = _main(tmp_path, ncu, "badmetric", monkeypatch)
    assert code == 0 and nk.SM_PCT in report["meta"]["dropped_metrics"]
    assert len([c for c in calls() if "--export" in c]) == 2 and nk.SM_PCT not in report["meta"]["metrics_used"]
    assert any("us" in c for c in report["cases"])


def test_main_without_ncu_says_so(tmp_path, monkeypatch, capsys):
    code, report, md = _main(tmp_path, tmp_path / "no-such-ncu", "ok", monkeypatch)
    assert code == 0 and "not found" in report["meta"]["error"] and "not found" in md


@pytest.mark.parametrize("unit", ["nsecond", "nsec", "ns"])
def test_durations_in_any_ncu_spelling_become_seconds(unit):
    # ncu 2025.3 prints "ns" in the units row with --print-units base (first H200 run: read as seconds)
    assert nk.to_base("1,500", unit) == pytest.approx(1.5e-6)
