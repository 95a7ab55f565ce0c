"""Why kernels miss their GPU-time targets (issues 8 and 11), from Nsight Compute's hardware counters.

    PYTHONPATH=src python3 benchmarks/kernels/ncu_kernels.py --out DIR [--only rms_norm,softmax] [--cases 'softmax/*/fwd/*'] [--quick]

One ``ncu`` run profiles every case (op, shape, fwd or fwd+bwd, impl; bf16) in one child process:
the child builds each case's inputs, warms it up (Triton/CuTeDSL compiles) outside the profiled
range, then brackets ``--calls`` calls (default 2) with ``cudaProfilerStart/Stop``
(``ncu --profile-from-start off``), each call in its own NVTX range ``ncucase-<case>-<call>``
(``ncu --nvtx``), so every profiled kernel is attributed to its case and call. Autograd runs the
backward on the calling thread during those calls (NVTX ranges are per thread). Each call also
starts with a tiny marker kernel whose program count encodes case and call: should ncu's CSV lack
the NVTX columns, the kernels are attributed by launch order after the markers. ``--isolate``
profiles each case in its own ``ncu`` run instead (slower: one Python start and one set of
compiles per case).

Per kernel: time, DRAM bytes read and written, DRAM and SM throughput (% of peak), achieved
occupancy, registers, shared memory, grid, block, waves, L2 hit rate. Per case: the sum over its
kernels (one call's mean), against the op's fewest bytes (each op file's ``bytes_moved``) and a
2 GiB copy kernel profiled in the same run (the ceiling; ``Tensor.copy_`` itself is a cudaMemcpy,
which ncu does not profile: its bandwidth is timed by events, outside the profiled ranges). The excess over "ideal bytes at
copy bandwidth" is split into extra bytes (DRAM traffic above the ideal: re-reads missing L2) and
time below copy bandwidth on the bytes actually moved (latency, occupancy, tails, small kernels).

Nsight Compute's defaults stay: ``--cache-control all`` (L2 flushed before each kernel: cold-L2
streaming, close to ``do_bench``'s flush) and kernel replay (kernels serialized: no overlap, no
launch gaps). Clocks are left alone (``--clock-control none``). ``ncu`` is looked up on the PATH,
then under /opt/nvidia/nsight-compute/*/ and /usr/local/cuda*/bin/ (or ``--ncu PATH``).

Writes ``DIR/ncu_kernels.json``, ``DIR/ncu_kernels.md``, ``DIR/ncu_kernels.csv`` (ncu's raw page)
and ``DIR/ncu_log.txt``. Without ``ncu``, or where it cannot read counters, the error goes into
the JSON and Markdown and the script exits 0. About 2-3 minutes on an H200 (``--quick``: about 1).

Rows as they are measured (issue 35): not through ``polykernel.tools.rows.RowFile``. The counters
come from ncu's report, which exists only once its run ends; a cut run has no counters to keep.
What is kept: the child writes its record per case as it goes (which cases ran, skipped, failed),
and with ``--isolate`` (one ncu run per case) the report and Markdown are rewritten after each
case, ``meta.complete`` false until the last. An estimate is printed first.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import glob
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from polykernel.tools.rows import announce

# -- what is profiled --------------------------------------------------------------------------

TIME = "gpu__time_duration.sum"
READ = "dram__bytes_read.sum"
WRITE = "dram__bytes_write.sum"
DRAM_PCT = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
L2_HIT = "lts__t_sector_hit_rate.pct"
REGS = "launch__registers_per_thread"
SMEM_DYN = "launch__shared_mem_per_block_dynamic"
SMEM_STATIC = "launch__shared_mem_per_block_static"
GRID = "launch__grid_size"
BLOCK = "launch__block_size"
WAVES = "launch__waves_per_multiprocessor"
# Short on purpose: every counter metric may cost a replay pass; launch__* ones are free.
METRICS = [TIME, READ, WRITE, DRAM_PCT, SM_PCT, OCCUPANCY, L2_HIT, REGS, SMEM_DYN, SMEM_STATIC, GRID, BLOCK, WAVES]

NVTX_PREFIX = "ncucase"
MARKER = "ncu_case_marker"  # the marker kernel's name (see mark)
MARKER_STRIDE = 64  # marker programs = case * 64 + call + 1: at most 63 calls
_NVTX_RE = re.compile(NVTX_PREFIX + r"-(\d+)-(\d+)")
COPY_BYTES = 2 * 2**31  # the 2 GiB copy: read + written


@dataclass(frozen=True)
class Case:
    """One profiled call: ``op`` (a polykernel op, or ``copy``), a shape label from
    ``polykernel.tools.bench.SHAPES``, ``fwd`` or ``fwd+bwd``, and an impl name (``impl=`` of the call)."""

    op: str
    label: str
    mode: str
    impl: str

    @property
    def name(self) -> str:
        """``rms_norm/16384x4096/fwd/triton``: what ``--cases`` patterns match."""
        return f"{self.op}/{self.label}/{self.mode}/{self.impl}"


COPY = Case("copy", "2GiB", "fwd", "torch")
# (op, shape label, modes, impls). Impls not registered or not runnable on the machine are skipped
# (with the reason); the peers are optional there.
DEFAULT: list[tuple[str, str, tuple[str, ...], tuple[str, ...]]] = [
    ("rms_norm", "16384x4096", ("fwd",), ("triton", "quack", "liger", "cute_dsl", "torch")),
    ("rms_norm", "2048x65536", ("fwd",), ("triton", "quack", "cute_dsl")),
    ("softmax", "8192x32768", ("fwd", "fwd+bwd"), ("triton", "quack", "cute_dsl", "liger")),
    ("cross_entropy", "8192x128256", ("fwd+bwd",), ("triton", "quack", "cute_dsl", "liger")),
    ("layer_norm", "16384x4096", ("fwd", "fwd+bwd"), ("triton", "cute_dsl", "torch")),
    ("rope", "q4x32x4096x128,k8", ("fwd", "fwd+bwd"), ("triton",)),
    ("fused_add_rms_norm", "16384x4096", ("fwd+bwd",), ("triton",)),
]
# Selected only by --only or --cases: dozens of GEMM kernels per call (each replayed by ncu).
OPTIONAL: list[tuple[str, str, tuple[str, ...], tuple[str, ...]]] = [
    ("rms_norm", "16384x4096", ("fwd+bwd",), ("triton", "quack", "cute_dsl")),
    ("fused_linear_cross_entropy", "N8192,H4096,V128256", ("fwd+bwd",), ("triton",)),
]
QUICK_IMPLS = ("triton",)

# GPU-time targets of issues 8 and 11 (bf16, H200): (op, shape label, mode) -> (TB/s, ms); one is None.
TARGETS: dict[tuple[str, str, str], tuple[float | None, float | None]] = {
    ("rms_norm", "16384x4096", "fwd"): (3.95, None),
    ("rms_norm", "2048x65536", "fwd"): (3.95, None),
    ("rms_norm", "16384x4096", "fwd+bwd"): (3.5, None),
    ("softmax", "8192x32768", "fwd"): (4.1, None),
    ("softmax", "8192x32768", "fwd+bwd"): (4.0, None),
    ("cross_entropy", "8192x128256", "fwd+bwd"): (None, 1.3),
    ("layer_norm", "16384x4096", "fwd"): (3.9, None),
    ("layer_norm", "16384x4096", "fwd+bwd"): (3.4, None),
    ("rope", "q4x32x4096x128,k8", "fwd"): (3.9, None),
    ("rope", "q4x32x4096x128,k8", "fwd+bwd"): (3.85, None),
    ("fused_add_rms_norm", "16384x4096", "fwd+bwd"): (3.55, None),
    ("fused_linear_cross_entropy", "N8192,H4096,V128256", "fwd+bwd"): (None, 36.0),
}


def build_cases(only: Iterable[str] = (), patterns: Iterable[str] = (), quick: bool = False) -> list[Case]:
    """The cases to profile, the copy first. No filter: the default list. ``only`` (op names) and
    ``patterns`` (``fnmatch`` on :attr:`Case.name`) select from the default and optional lists.
    ``quick``: our Triton impls only. Nothing is imported (no torch, no peer).

    >>> [c.name for c in build_cases(only=["rope"])]
    ['copy/2GiB/fwd/torch', 'rope/q4x32x4096x128,k8/fwd/triton', 'rope/q4x32x4096x128,k8/fwd+bwd/triton']
    """
    only, patterns = [o for o in only if o], [p for p in patterns if p]
    table = DEFAULT + OPTIONAL if (only or patterns) else DEFAULT
    cases = [Case(op, label, mode, impl) for op, label, modes, impls in table for mode in modes for impl in impls]
    if only:
        cases = [c for c in cases if c.op in only]
    if patterns:
        cases = [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    if quick:
        cases = [c for c in cases if c.impl in QUICK_IMPLS]
    return [COPY, *dict.fromkeys(cases)]


def shape_of(op: str, label: str) -> tuple[int, ...]:
    """The example shape behind a label of ``polykernel.tools.bench.SHAPES`` (the README's shapes)."""
    from polykernel.tools.bench import SHAPES

    for lab, shape in SHAPES[op]:
        if lab == label:
            return shape
    raise KeyError(f"{op}: no bench shape labelled {label!r}")


def skip_reason(case: Case, device: str, dtype: Any) -> str | None:
    """Why ``case.impl`` cannot run here (not registered for the op, or polykernel's verdict:
    device, arch, modules, dtype), or None. Uses ``polykernel.explain``, which imports no peer."""
    if case.op == "copy":
        return None
    import polykernel

    rows = {r["name"]: r for r in polykernel.explain(case.op, device=device, dtype=dtype).impls}
    if case.impl not in rows:
        return f"no {case.impl} impl registered for {case.op}"
    return None if rows[case.impl]["runnable"] else rows[case.impl]["reason"]


# -- the child: runs the cases under ncu ---------------------------------------------------------


def _case_step(case: Case, device: str = "cuda") -> tuple[Callable[[], Any], int]:
    """(one call of the case, the op's ideal bytes for it) on fresh inputs; the first call
    (which compiles) is made by the caller."""
    import torch

    if case.op == "copy":
        src = torch.randn(2**30, dtype=torch.bfloat16, device=device)  # 2 GiB
        dst = torch.empty_like(src)
        # A copy kernel: Tensor.copy_ of contiguous same-dtype tensors is a cudaMemcpy, which ncu
        # does not profile (its bandwidth is measured apart, by events: meta memcpy_TBps).
        return (lambda: torch.mul(src, 1, out=dst)), COPY_BYTES

    import polykernel
    from polykernel.core import registry
    from polykernel.tools.bench import _step

    op = registry.get_op(case.op)
    backward = case.mode == "fwd+bwd"
    example = op.example(shape_of(case.op, case.label), torch.bfloat16, device, backward)
    args, kwargs = example.args, example.kwargs
    public = getattr(polykernel, op.name)
    grad_inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    # _step's forward+backward builds its cotangents from a first call: that call compiles.
    step = _step(lambda: public(*args, impl=case.impl, **kwargs), grad_inputs, backward)
    return step, op.bytes_moved(*args, backward=backward, **kwargs)


def run_child(manifest: Path, result: Path, calls: int, deadline: float, device: str = "cuda") -> int:
    """Profile each case of ``manifest`` (warm-up outside the profiled range); write a record per
    case to ``result`` after each one (a time-out keeps what was done). ``device="cpu"`` runs the
    same steps without the CUDA profiler calls (a smoke test of the bookkeeping)."""
    import torch
    import triton

    from polykernel.errors import ImplNotAvailableError

    entries = json.loads(manifest.read_text())  # [{"id": global case number, **Case fields}]
    cuda = device == "cuda"
    name = torch.cuda.get_device_name() if cuda else device
    meta: dict[str, Any] = {"device": name, "torch": torch.__version__, "triton": triton.__version__}
    try:  # the issues' copy figure: Tensor.copy_ (a cudaMemcpy) timed by events, outside ncu's ranges
        from polykernel.tools.bench import copy_bandwidth

        meta["memcpy_TBps"] = copy_bandwidth() / 1e3 if cuda else None
    except Exception as exc:
        meta["memcpy_TBps_error"] = f"{type(exc).__name__}: {exc}"[:200]
    records: list[dict[str, Any]] = []
    for entry in entries:
        i, case = entry["id"], Case(**{k: v for k, v in entry.items() if k != "id"})
        rec: dict[str, Any] = {"id": i, **asdict(case), "name": case.name, "calls": calls}
        t0 = time.time()
        try:
            if time.time() > deadline:
                raise TimeoutError("skipped: the run's time budget is spent (raise --timeout)")
            reason = skip_reason(case, device, torch.bfloat16)
            if reason:
                rec["skipped"] = reason
            else:
                _profile_case(case, i, calls, rec, device)
        except ImplNotAvailableError as exc:  # a per-call predicate refused these arguments
            rec["skipped"] = str(exc)[:400]
        except Exception as exc:  # one failing impl is recorded; the others still run
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        rec["seconds"] = round(time.time() - t0, 2)
        records.append(rec)
        result.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        print(f"[ncu_kernels] {case.name}: " + rec.get("error", rec.get("skipped", "profiled")), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    return 0


_marker_kernel: Any = None


def mark(index: int, call: int, device: str = "cuda") -> None:
    """Launch the marker kernel with ``index * 64 + call + 1`` programs: in launch order, it tells
    which case and call the kernels after it belong to, should ncu's CSV lack the NVTX ranges."""
    global _marker_kernel
    if _marker_kernel is None:
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def ncu_case_marker(ptr):
            tl.store(ptr + tl.program_id(0) * 0, 1)

        _marker_kernel = (ncu_case_marker, torch.zeros(1, dtype=torch.int32, device=device))
    kernel, buf = _marker_kernel
    kernel[(index * MARKER_STRIDE + call + 1,)](buf)


def _profile_case(case: Case, index: int, calls: int, rec: dict[str, Any], device: str = "cuda") -> None:
    import torch

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    # The backward on this thread: autograd's device threads would launch outside our NVTX range.
    with torch.autograd.set_multithreading_enabled(False):
        step, rec["ideal_bytes"] = _case_step(case, device)
        step()
        step()  # compiled, caches and allocator warm
        mark(index, 0, device)
        sync()
        if cuda:
            torch.cuda.profiler.start()
        try:
            for call in range(calls):
                if cuda:
                    torch.cuda.nvtx.range_push(f"{NVTX_PREFIX}-{index:03d}-{call}")
                try:
                    mark(index, call, device)
                    step()
                finally:
                    if cuda:
                        torch.cuda.nvtx.range_pop()
            sync()
        finally:
            if cuda:
                torch.cuda.profiler.stop()
    del step


# -- the parent: runs ncu, reads its CSV ---------------------------------------------------------

_NO_COUNTERS = ("ERR_NVGPUCTRPERM", "LibraryNotLoaded", "permission to access NVIDIA GPU Performance Counters", "ERR_NVGPUCTRDIS")


def find_ncu(explicit: str | None = None) -> str | None:
    """``ncu`` from ``--ncu``, the PATH, or the newest Nsight Compute / CUDA install found."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("ncu")
    if found:
        return found
    candidates = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")) + sorted(glob.glob("/usr/local/cuda*/bin/ncu"))
    return next((c for c in reversed(candidates) if os.access(c, os.X_OK)), None)


def _ncu_env(tmp: Path) -> dict[str, str]:
    """ncu deploys section files under $HOME; a read-only HOME gives empty CSVs, so use a temp one."""
    env = os.environ.copy()
    home = env.get("HOME", "")
    if not home or not os.access(home, os.W_OK):
        env["HOME"] = str(tmp / "home")
        os.makedirs(env["HOME"], exist_ok=True)
    return env


def _run(cmd: list[str], timeout: float, env: dict[str, str]) -> tuple[int, str]:
    """(return code, stdout+stderr) of ``cmd``; on time-out its whole process group (ncu and the
    child it launched) is killed and the code is 124."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, (out or "") + f"\n[ncu_kernels] timed out after {timeout:.0f} s"


def check_metrics(ncu: str, metrics: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(metrics to use, dropped metric -> why) from ``ncu --query-metrics`` on this GPU. A metric
    whose base name the query does not list is dropped; launch__* metrics (launch statistics, not
    always listed) and the time and DRAM bytes (the report's core) are kept. If the query fails,
    every metric is kept (a failing profile then names the bad ones: see :func:`metric_errors`)."""
    try:
        code, text = _run([ncu, "--query-metrics"], 60, env)
    except OSError:
        return metrics, {}
    listed = set(re.findall(r"\b[a-z0-9]+__[a-z0-9_]+", text))
    if code != 0 or "dram__bytes_read" not in listed:  # not a usable listing
        return metrics, {}
    keep, dropped = [], {}
    for m in metrics:
        if m.startswith("launch__") or m in (TIME, READ, WRITE) or m.split(".")[0] in listed:
            keep.append(m)
        else:
            dropped[m] = "not listed by ncu --query-metrics on this GPU"
    return keep, dropped


def metric_errors(text: str, metrics: list[str]) -> list[str]:
    """Our metrics that ncu's error lines name (an unknown or unsupported metric)."""
    lines = [ln for ln in text.splitlines() if "==ERROR==" in ln or ("rror" in ln and "metric" in ln.lower())]
    return [m for m in metrics if any(m in ln or m.split(".")[0] in ln for ln in lines)]


def ncu_command(ncu: str, metrics: list[str], report: Path, child: list[str]) -> list[str]:
    return [
        ncu, "--clock-control", "none", "--profile-from-start", "off", "--nvtx",
        "--target-processes", "application-only", "--metrics", ",".join(metrics),
        "--export", str(report), "--force-overwrite", *child,
    ]  # fmt: skip


def import_command(ncu: str, report: Path) -> list[str]:
    return [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base", "--print-kernel-base", "function"]


def parse_raw_csv(text: str) -> list[dict[str, Any]]:
    """Kernels from ncu's raw page as CSV: a header row (``"ID"``, ..., ``"Kernel Name"``, the NVTX
    columns, metric names), a units row, then one row per kernel. Lines before the header (ncu's
    ``==PROF==`` messages) are skipped. Each kernel: ``id``, ``kernel`` (full name), ``nvtx`` (the
    NVTX columns joined), ``grid``/``block`` (the launch tuples) and ``metrics`` (name -> value in
    base units, seconds and bytes; None where ncu gave n/a)."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if r and r[0].strip() == "ID" and "Kernel Name" in r), None)
    if start is None:
        return []
    header = [h.strip() for h in rows[start]]
    units = rows[start + 1] if len(rows) > start + 1 and not rows[start + 1][0].strip().isdigit() else [""] * len(header)
    nvtx_cols = [i for i, h in enumerate(header) if "_Range" in h or h.lower().startswith("nvtx")]
    metric_cols = [i for i, h in enumerate(header) if "__" in h]
    kernels = []
    for r in rows[start + 1 :]:
        if len(r) != len(header) or not r[0].strip().isdigit():
            continue
        get = dict(zip(header, r))
        kernels.append(
            {
                "id": int(r[0]),
                "kernel": get["Kernel Name"],
                "nvtx": " ".join(r[i] for i in nvtx_cols),
                "grid": get.get("Grid Size", ""),
                "block": get.get("Block Size", ""),
                "metrics": {header[i]: to_base(r[i], units[i] if i < len(units) else "") for i in metric_cols},
            }
        )
    return kernels


_SCALE = {"": 1.0, "n": 1e-9, "u": 1e-6, "m": 1e-3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def to_base(value: str, unit: str) -> float | None:
    """A raw-page value in base units: seconds for ``[n|u|m]second``, bytes for ``[K|M|G]byte``
    (ncu's prefixes are decimal); other units as printed. ``n/a`` and empty give None.

    >>> to_base("1,500", "nsecond"), to_base("1,500", "ns"), to_base("2", "Mbyte"), to_base("87.5", "%"), to_base("n/a", "")
    (1.5e-06, 1.5e-06, 2000000.0, 87.5, None)
    """
    try:
        number = float(value.strip().replace(",", ""))
    except ValueError:
        return None
    # ncu 2025 prints "ns"/"byte" with --print-units base; older releases "nsecond"
    m = re.match(r"^([numKMGT]?)(second|sec|s|byte|B)(?![A-Za-z])", unit.strip())
    return number * _SCALE[m.group(1)] if m else number


def attribute(kernels: list[dict[str, Any]]) -> tuple[dict[tuple[int, int], list[dict[str, Any]]], list[dict[str, Any]], str]:
    """((case id, call) -> its kernels in launch order, kernels of no case, how): by the
    ``ncucase-<case>-<call>`` NVTX ranges, or, where the CSV has none, by the marker kernel each
    call starts with (its program count encodes case and call). Markers belong to no case."""
    ordered = sorted(kernels, key=lambda k: k["id"])
    by_call: dict[tuple[int, int], list[dict[str, Any]]] = {}
    loose = []
    if any(_NVTX_RE.search(k["nvtx"]) for k in ordered):
        for k in ordered:
            hits = _NVTX_RE.findall(k["nvtx"])
            if MARKER in k["kernel"]:
                continue
            if hits:
                case, call = hits[-1]  # the innermost range
                by_call.setdefault((int(case), int(call)), []).append(k)
            else:
                loose.append(k)
        return by_call, loose, "NVTX ranges"
    current = None
    for k in ordered:
        if MARKER in k["kernel"]:
            n = _programs(k)
            current = None if n is None else divmod(int(n) - 1, MARKER_STRIDE)
        elif current is not None:
            by_call.setdefault(current, []).append(k)
        else:
            loose.append(k)
    return by_call, loose, "marker kernels"


def _programs(k: dict[str, Any]) -> float | None:
    """A kernel's number of programs (blocks): launch__grid_size, else the Grid Size tuple."""
    n = k["metrics"].get(GRID)
    if n is None and k["grid"]:
        dims = [int(d) for d in re.findall(r"\d+", k["grid"])]
        n = dims[0] * dims[1] * dims[2] if len(dims) == 3 else None
    return n


# -- the report ---------------------------------------------------------------------------------


def short_name(name: str, width: int = 64) -> str:
    """A kernel name without ``void``, template arguments or parameters, cut to ``width``.

    >>> short_name("void at::native::elementwise_kernel<128, 4, at::native::Foo<float>>(int, float)")
    'at::native::elementwise_kernel'
    """
    out, depth = [], 0
    for ch in re.sub(r"^void\s+", "", name.strip()):
        if ch == "(" and depth == 0:
            break
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    text = "".join(out).strip() or name.strip()
    return text if len(text) <= width else text[: width - 1] + "…"


def _m(k: dict[str, Any], metric: str) -> float | None:
    return k["metrics"].get(metric)


def kernel_view(k: dict[str, Any]) -> dict[str, Any]:
    """One kernel's figures for the report (times in µs, bytes in bytes, TB/s over DRAM bytes)."""
    t = _m(k, TIME)
    read, write = _m(k, READ), _m(k, WRITE)
    dram = None if read is None or write is None else read + write
    smem = [v for v in (_m(k, SMEM_DYN), _m(k, SMEM_STATIC)) if v is not None]
    grid = k["grid"] or (f"{_m(k, GRID):.0f}" if _m(k, GRID) is not None else "")
    block = k["block"] or (f"{_m(k, BLOCK):.0f}" if _m(k, BLOCK) is not None else "")
    return {
        "kernel": short_name(k["kernel"]),
        "us": None if t is None else t * 1e6,
        "dram_read": read,
        "dram_write": write,
        "dram_TBps": None if dram is None or not t else dram / t / 1e12,
        "dram_pct": _m(k, DRAM_PCT),
        "sm_pct": _m(k, SM_PCT),
        "occupancy_pct": _m(k, OCCUPANCY),
        "l2_hit_pct": _m(k, L2_HIT),
        "registers": _m(k, REGS),
        "smem_bytes": sum(smem) if smem else None,
        "grid": grid,
        "block": block,
        "waves": _m(k, WAVES),
    }


def _mean_views(calls: list[list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], str]:
    """Per-kernel views averaged over the calls (kernels matched by position) when every call ran
    the same kernels; else the first call's, with a note."""
    views = [[kernel_view(k) for k in c] for c in calls]
    if len({tuple(v["kernel"] for v in c) for c in views}) != 1:
        return views[0], "the calls ran different kernels: the first call's are listed"
    out = []
    for pos in range(len(views[0])):
        row = dict(views[0][pos])
        for key in ("us", "dram_read", "dram_write", "dram_pct", "sm_pct", "occupancy_pct", "l2_hit_pct"):
            vals = [c[pos][key] for c in views]
            row[key] = None if any(v is None for v in vals) else sum(vals) / len(vals)
        if row["dram_TBps"] is not None and row["us"]:  # mean bytes over mean time
            row["dram_TBps"] = (row["dram_read"] + row["dram_write"]) / row["us"] / 1e6
        out.append(row)
    return out, ""


def summarize_case(rec: dict[str, Any], calls: list[list[dict[str, Any]]], copy_TBps: float | None) -> dict[str, Any]:
    """A case's kernels (mean over calls) and totals against its ideal bytes and the copy:

    - ``us``: sum of its kernels' times (one call); ``dram_bytes``: read + written;
    - ``bytes_over_ideal_pct``: DRAM bytes above the op's ``bytes_moved``;
    - ``TBps_ideal``: ideal bytes / time (what the issues' targets count); ``TBps_dram``: DRAM bytes / time;
    - ``us_at_copy``: ideal bytes at the copy's bandwidth; the excess over it splits into
      ``us_extra_bytes`` (DRAM bytes above ideal, at copy bandwidth) and ``us_below_copy`` (the rest:
      the bytes moved, slower than the copy moves them);
    - ``us_small_kernels``: time of the kernels moving < 5% of the case's DRAM bytes.
    """
    kernels, note = _mean_views(calls)
    out: dict[str, Any] = {"kernels": kernels, "n_kernels": len(kernels)}
    if note:
        out["note"] = note
    if any(k["us"] is None for k in kernels):
        out["note"] = (note + "; " if note else "") + "a kernel has no duration"
        return out
    n = len(calls)
    us = sum(sum(kernel_view(k)["us"] for k in c) for c in calls) / n
    views = [kernel_view(k) for c in calls for k in c]
    have_bytes = all(v["dram_read"] is not None and v["dram_write"] is not None for v in views)
    ideal = rec.get("ideal_bytes")
    out["us"] = us
    if have_bytes:
        out["dram_read"] = sum(v["dram_read"] for v in views) / n
        out["dram_write"] = sum(v["dram_write"] for v in views) / n
        out["dram_bytes"] = out["dram_read"] + out["dram_write"]
        out["TBps_dram"] = out["dram_bytes"] / (us * 1e-6) / 1e12 if us else None
        big = 0.05 * out["dram_bytes"]
        out["us_small_kernels"] = sum(k["us"] for k in kernels if (k["dram_read"] or 0) + (k["dram_write"] or 0) < big)
    if ideal:
        out["ideal_bytes"] = ideal
        out["TBps_ideal"] = ideal / (us * 1e-6) / 1e12 if us else None
        if have_bytes:
            out["bytes_over_ideal_pct"] = 100 * (out["dram_bytes"] / ideal - 1)
        if copy_TBps:
            bw = copy_TBps * 1e12 / 1e6  # bytes per µs
            out["us_at_copy"] = ideal / bw
            out["x_copy_time"] = us / out["us_at_copy"]
            if have_bytes:
                out["us_extra_bytes"] = max(0.0, out["dram_bytes"] - ideal) / bw
                out["us_below_copy"] = us - max(out["dram_bytes"], ideal) / bw
    out["verdict"] = verdict(out)
    return out


def verdict(s: dict[str, Any]) -> str:
    """Where the time over "ideal bytes at copy bandwidth" goes, in one line."""
    if "us_at_copy" not in s or "us_extra_bytes" not in s:
        return ""
    excess = s["us"] - s["us_at_copy"]
    if excess <= 0.03 * s["us_at_copy"]:
        return f"at copy speed ({s['x_copy_time']:.2f}× the copy's time)"
    parts = []
    if s["us_extra_bytes"] > 0.01 * s["us"]:
        parts.append(f"extra bytes {s['us_extra_bytes']:.1f} µs (DRAM {1 + s['bytes_over_ideal_pct'] / 100:.2f}× ideal)")
    if s["us_below_copy"] > 0.01 * s["us"]:
        main = max(s["kernels"], key=lambda k: k["us"])
        why = [f"main kernel {main['dram_TBps']:.2f} TB/s" if main["dram_TBps"] is not None else "main kernel"]
        if main["occupancy_pct"] is not None:
            why.append(f"occupancy {main['occupancy_pct']:.0f}%")
        if main["waves"] is not None:
            why.append(f"{main['waves']:.2f} waves")
        parts.append(f"below copy bandwidth {s['us_below_copy']:.1f} µs ({', '.join(why)})")
    if s["n_kernels"] > 1 and s.get("us_small_kernels", 0) > 0.01 * s["us"]:
        parts.append(f"{s['n_kernels']} kernels, the small ones {s['us_small_kernels']:.1f} µs")
    return f"+{excess:.1f} µs over copy: " + "; ".join(parts or ["spread thin"])


def build_report(records: list[dict[str, Any]], kernels: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON report: per case its record, kernels and totals; the copy's bandwidth first."""
    by_call, loose, how = attribute(kernels)

    def calls_of(rec: dict[str, Any]) -> list[list[dict[str, Any]]]:
        return [by_call[key] for key in sorted(k for k in by_call if k[0] == rec["id"])]

    copy_TBps = None
    copy = next((r for r in records if r["op"] == "copy"), None)
    if copy is not None and calls_of(copy):
        s = summarize_case(copy, calls_of(copy), None)
        copy_TBps = s.get("TBps_ideal")
    cases = []
    for rec in records:
        entry = {k: v for k, v in rec.items() if k != "id"}
        calls = calls_of(rec)
        if calls:
            entry.update(summarize_case(rec, calls, copy_TBps))
            target = TARGETS.get((rec["op"], rec["label"], rec["mode"]))
            if target:
                entry["target_TBps"], entry["target_ms"] = target
        elif not rec.get("error") and not rec.get("skipped"):
            entry["error"] = "no profiled kernel attributed to this case (see ncu_log.txt)"
        cases.append(entry)
    return {
        "meta": {**meta, "copy_TBps": copy_TBps, "attributed_by": how},
        "cases": cases,
        "unattributed": [kernel_view(k) | {"id": k["id"], "nvtx": k["nvtx"][:120]} for k in loose],
    }


def _f(v: Any, fmt: str = ".1f", scale: float = 1.0) -> str:
    return "" if v is None else format(v * scale, fmt)


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: header and notes, one summary table, a kernel table per case."""
    meta = report["meta"]
    out = [f"# Nsight Compute per kernel: {meta.get('device', '?')}, bf16", ""]
    if meta.get("error"):
        return "\n".join([*out, f"**Not profiled:** {meta['error']}", ""])
    copy = meta.get("copy_TBps")
    out += [
        f"- ncu {meta.get('ncu_version', '?')} ({meta.get('ncu', '?')}), torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}; "
        f"{meta.get('calls', '?')} calls per case, the figures are one call's mean; {meta.get('seconds', '?')} s.",
        "- `--clock-control none` (clocks as they run), `--cache-control all` (ncu's default: L2 flushed before each "
        "kernel, i.e. cold-L2 streaming like `do_bench`'s flush), kernel replay: kernels run one at a time, so a "
        "case's time is the sum of its kernels, without launch gaps or overlap (CUDA-graph times add ~1-2 µs per kernel).",
        f"- Copy ceiling: a 2 GiB copy kernel (`torch.mul(src, 1, out=dst)`, profiled here) **{_f(copy, '.2f')} TB/s** "
        f"(read + written); `Tensor.copy_` of the same (a cudaMemcpy, which ncu does not profile; CUDA events, "
        f"L2 flushed by `do_bench`): {_f(meta.get('memcpy_TBps'), '.2f')} TB/s. "
        f"Kernels attributed to cases by {meta.get('attributed_by', '?')}.",
        "- ideal = the op's fewest bytes (`bytes_moved`); TB/s ideal = ideal / time (what the targets count); "
        "excess over *ideal at copy bandwidth* = extra bytes (DRAM above ideal: re-reads that miss L2) + "
        "below copy bandwidth (bytes moved slower than the copy moves them: latency, occupancy, tails, small kernels).",
    ]
    if meta.get("dropped_metrics"):
        out.append("- Dropped metrics: " + "; ".join(f"`{m}` ({why})" for m, why in meta["dropped_metrics"].items()))
    out += [
        "",
        "| case | kernels | µs | target | TB/s ideal | ideal MB | DRAM MB (R+W) | over ideal | TB/s DRAM | µs at copy | × copy | where the time goes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cases"]:
        if "us" not in c:
            continue
        target = f"≥ {c['target_TBps']}" if c.get("target_TBps") else (f"≤ {c['target_ms'] * 1e3:.0f} µs" if c.get("target_ms") else "")
        dram = f"{_f(c.get('dram_read'), '.0f', 1e-6)}+{_f(c.get('dram_write'), '.0f', 1e-6)}" if "dram_read" in c else ""
        out.append(
            f"| {c['name']} | {c['n_kernels']} | {_f(c['us'])} | {target} | {_f(c.get('TBps_ideal'), '.2f')} | "
            f"{_f(c.get('ideal_bytes'), '.0f', 1e-6)} | {dram} | {_f(c.get('bytes_over_ideal_pct'), '+.1f')}% | "
            f"{_f(c.get('TBps_dram'), '.2f')} | {_f(c.get('us_at_copy'))} | {_f(c.get('x_copy_time'), '.2f')} | {c.get('verdict', '')} |"
        )
    failed = [c for c in report["cases"] if "us" not in c]
    if failed:
        out += ["", "## Not profiled", ""]
        out += [f"- {c['name']}: {c.get('skipped') or c.get('error') or c.get('note', '?')}" for c in failed]
    for c in report["cases"]:
        if not c.get("kernels"):
            continue
        out += ["", f"## {c['name']}", ""]
        if c.get("note"):
            out += [f"_{c['note']}_", ""]
        out += [
            "| kernel | µs | DRAM read MB | write MB | TB/s | DRAM % | SM % | occupancy % | regs | smem KiB | grid | block | waves | L2 hit % |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for k in c["kernels"]:
            out.append(
                f"| `{k['kernel']}` | {_f(k['us'])} | {_f(k['dram_read'], '.1f', 1e-6)} | {_f(k['dram_write'], '.1f', 1e-6)} | "
                f"{_f(k['dram_TBps'], '.2f')} | {_f(k['dram_pct'])} | {_f(k['sm_pct'])} | {_f(k['occupancy_pct'])} | "
                f"{_f(k['registers'], '.0f')} | {_f(k['smem_bytes'], '.1f', 1 / 1024)} | {k['grid']} | {k['block']} | "
                f"{_f(k['waves'], '.2f')} | {_f(k['l2_hit_pct'])} |"
            )
    if report.get("unattributed"):
        out += ["", f"## {len(report['unattributed'])} kernels attributed to no case (`--isolate` profiles one case per run)", ""]
        out += [f"- `{k['kernel']}` {_f(k['us'])} µs, NVTX `{k['nvtx']}`" for k in report["unattributed"][:20]]
    return "\n".join(out) + "\n"


# -- main ---------------------------------------------------------------------------------------


def _write(out: Path, report: dict[str, Any]) -> None:
    (out / "ncu_kernels.json").write_text(json.dumps(report, indent=1))
    (out / "ncu_kernels.md").write_text(markdown(report))


def _fail(out: Path, meta: dict[str, Any], error: str) -> int:
    """Record why nothing was profiled and exit 0 (the rest of a GPU batch goes on)."""
    meta["error"] = error
    _write(out, {"meta": meta, "cases": [], "unattributed": []})
    print(f"ncu_kernels: not profiled: {error}\nwrote {out / 'ncu_kernels.md'}", file=sys.stderr)
    return 0


def _profile(
    ncu: str, metrics: list[str], cases: list[Case], ids: list[int], a: argparse.Namespace, tmp: Path, tag: str, timeout: float
) -> tuple[int, str, list[dict[str, Any]], str, dict[str, Any]]:
    """One ncu run over ``cases`` (numbered ``ids``): (return code, log, child records, raw CSV,
    the child's device and versions)."""
    manifest, result, report = tmp / f"cases{tag}.json", tmp / f"records{tag}.json", tmp / f"report{tag}.ncu-rep"
    manifest.write_text(json.dumps([{"id": i, **asdict(c)} for i, c in zip(ids, cases)]))
    result.unlink(missing_ok=True)
    child = [sys.executable, os.path.abspath(__file__), "--child", str(manifest), "--child-result", str(result)]
    child += ["--calls", str(a.calls), "--deadline", str(time.time() + max(30.0, timeout - 40))]
    env = _ncu_env(tmp)
    code, log = _run(ncu_command(ncu, metrics, report, child), timeout, env)
    done = json.loads(result.read_text()) if result.exists() else {}
    records, meta = done.get("records", []), done.get("meta", {})
    raw = ""
    if report.exists():
        icode, raw = _run(import_command(ncu, report), 120, env)
        if icode != 0:
            log += f"\n[ncu_kernels] import failed ({icode}):\n{raw[-2000:]}"
            raw = ""
        if a.keep_report:
            shutil.copy(report, Path(a.out) / f"ncu_kernels{tag}.ncu-rep")
    return code, log, records, raw, meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "ncu"), help="directory for ncu_kernels.json/.md/.csv and ncu_log.txt")
    p.add_argument("--only", default="", help="comma-separated ops (selects from the default and optional cases)")
    p.add_argument("--cases", default="", help="comma-separated fnmatch patterns on op/shape/mode/impl, e.g. 'softmax/*/fwd/*'")
    p.add_argument("--quick", action="store_true", help="our Triton impls only, one call per case")
    p.add_argument("--calls", type=int, default=None, help="profiled calls per case (default 2; --quick 1)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds for the whole ncu run (each, with --isolate)")
    p.add_argument("--isolate", action="store_true", help="one ncu run per case (slower: a Python start and compiles per case)")
    p.add_argument("--ncu", default=None, help="path of the ncu binary")
    p.add_argument("--keep-report", action="store_true", help="also copy ncu's .ncu-rep file(s) to --out")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-result", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    p.add_argument("--child-device", default="cuda", help=argparse.SUPPRESS)  # cpu: the tests' smoke run
    a = p.parse_args(argv)
    a.calls = a.calls or (1 if a.quick else 2)
    if not 1 <= a.calls < MARKER_STRIDE:
        p.error(f"--calls must be between 1 and {MARKER_STRIDE - 1}")
    if a.child:
        return run_child(Path(a.child), Path(a.child_result), a.calls, a.deadline, a.child_device)

    cases = build_cases(a.only.split(","), a.cases.split(","), a.quick)
    if a.list:
        print("\n".join(c.name for c in cases))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # The parent stays off the GPU (no CUDA context next to the profiled one): the child reports
    # the device and versions.
    meta: dict[str, Any] = {"calls": a.calls, "metrics": METRICS, "cases_requested": [c.name for c in cases]}
    ncu = find_ncu(a.ncu)
    if ncu is None:
        return _fail(
            out, meta, "ncu (Nsight Compute) not found on the PATH nor under /opt/nvidia/nsight-compute/*/ or /usr/local/cuda*/bin/"
        )
    meta["ncu"] = ncu
    per_case = 20 if a.isolate else 3 if a.quick else 5  # --isolate: a Python start and compiles per case
    announce(len(cases), per_case_s=per_case, what="cases", path=str(out / "ncu_kernels.json"), extra_s=30)
    with tempfile.TemporaryDirectory(prefix="ncu_kernels_") as tmp_name:
        tmp = Path(tmp_name)
        env = _ncu_env(tmp)
        meta["ncu_version"] = (_run([ncu, "--version"], 30, env)[1].strip().splitlines() or ["?"])[-1]
        metrics, dropped = check_metrics(ncu, METRICS, env)
        runs = [(cases, list(range(len(cases))), "")] if not a.isolate else [([c], [i], f"-{i:03d}") for i, c in enumerate(cases)]
        records: list[dict[str, Any]] = []
        kernels: list[dict[str, Any]] = []
        logs, raws = [], []
        for group, ids, tag in runs:
            code, log, recs, raw, child_meta = _profile(ncu, metrics, group, ids, a, tmp, tag, a.timeout)
            meta.update(child_meta)
            if code != 0 and not raw:
                if any(s in log for s in _NO_COUNTERS):
                    (out / "ncu_log.txt").write_text(log[-200_000:])
                    return _fail(out, meta, "ncu cannot read the GPU's performance counters: " + _first_error(log))
                bad = [m for m in metric_errors(log, metrics) if m != TIME]
                if bad:  # drop the metrics ncu named and try once more
                    dropped.update({m: "named in ncu's error output" for m in bad})
                    metrics = [m for m in metrics if m not in bad]
                    code, log, recs, raw, child_meta = _profile(ncu, metrics, group, ids, a, tmp, tag, a.timeout)
                    meta.update(child_meta)
            logs.append(f"$ {' '.join(ncu_command(ncu, metrics, Path('REPORT'), ['CHILD']))}  (exit {code})\n{log}")
            raws.append(raw)
            seen = {r["id"] for r in recs}
            records += recs
            records += [
                {"id": i, **asdict(c), "name": c.name, "error": f"no record: the child stopped (ncu exit {code}: {_first_error(log)})"}
                for i, c in zip(ids, group)
                if i not in seen
            ]
            kernels += parse_raw_csv(raw)
            if a.isolate and kernels and len(records) < len(cases):  # the cases so far, in case the run is cut
                _write(out, build_report(records, kernels, {**meta, "complete": False}))
    (out / "ncu_log.txt").write_text("\n".join(logs)[-500_000:])
    (out / "ncu_kernels.csv").write_text("\n".join(raws))
    meta.update(metrics_used=metrics, dropped_metrics=dropped, seconds=round(time.time() - t0, 1), complete=True)
    if not kernels:
        return _fail(out, meta, "ncu profiled no kernel: " + _first_error("\n".join(logs)))
    report = build_report(records, kernels, meta)
    _write(out, report)
    print(markdown(report).split("\n## ")[0])  # the summary table; per-kernel tables in the file
    print(f"wrote {out / 'ncu_kernels.md'} and .json in {meta['seconds']} s", file=sys.stderr)
    return 0


def _first_error(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if "ERR" in ln or "rror" in ln]
    return (lines[0] if lines else log.strip().splitlines()[-1] if log.strip() else "no output")[:300]


if __name__ == "__main__":
    raise SystemExit(main())
