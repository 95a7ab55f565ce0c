"""Which Triton kernels, at which specializations, the MoE GPU tests would compile on a GPU:
counted on the CPU, without running a kernel.

Every distinct (kernel, specialization) is one compile per process on a fresh machine (0.1-3 s).
Triton's key for a kernel is its constexprs and launch options (here: the keywords of
``_launch.launch``), each tensor argument's dtype and whether its address is 16-byte aligned, and
each int's type (i32/i64), whether it is 1 (then a constant) and whether it divides by 16
(``triton._C.libtriton.native_specialize_impl``, what ``JITFunction.run`` calls). No MoE kernel
sets ``do_not_specialize`` (or ``..._on_alignment``).

Method: each GPU test of tests/ops/test_moe_{paths,experts,experts_gpt_oss,router}.py is replayed
here on CPU tensors, with the same cases (tests/_moe_helpers.py, the ops' own cases) and the same
impl-side calls as ``polykernel.testing.check_parity`` (fresh leaf copies, the public op with
``impl="triton"``, one ``autograd.grad`` of every leaf), with:

- ``launch`` in the MoE modules replaced by a recorder that does not run the kernel (outputs
  stay ``torch.empty``: no host decision of these impls reads a value, other than the CPU's index
  range check, which sees the real index);
- the GPU's host decisions: ``_grouped.plan``/``_meta`` as off the interpreter (GPU tiles, warps,
  stages, no bf16 upcast), ``_grouped_mm.takes`` as for a CUDA tensor (MODE "auto": the
  grouped_mm path for bf16/fp16), ``torch._grouped_mm``'s probe passing for bf16 and fp16 (with
  ``--fp16-no-grouped-mm``: refusing fp16), ``torch._grouped_mm`` itself replaced by an empty output of its shape
  (contiguous, as CUDA's for the 16-byte-multiple sizes the path takes);
- a tensor counted as aligned when ``storage_offset() * element_size() % 16 == 0`` (the CUDA
  caching allocator aligns every allocation to 512 bytes; CPU allocations differ).

Not replayed: the torch impl and the float64 references (no Triton kernels), Liger's kernels
(Liger is not runnable on this CPU). ``--self-check`` compares the emulation's launches with the
interpreter's real runs; ``--compile`` compiles every pair for sm_90 (Triton's ptxas, no GPU) and
times it; ``--before`` models the tests before benchmarks/results/cpu-2026-12-03-moe-compiles/
(run from a checkout of that tree). ~1 min; ~5 min with ``--compile``.

    PYTHONPATH=src python benchmarks/host/moe_gpu_compiles.py --compile --json OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

if __name__ == "__main__" and "--compile-worker" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton impl runnable on the CPU

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

import _moe_helpers as moe  # noqa: E402
import polykernel  # noqa: E402
from polykernel import _compat  # noqa: E402
from polykernel.backends import _moe_experts  # noqa: E402
from polykernel.backends.triton import _grouped, _grouped_mm  # noqa: E402
from polykernel.backends.triton import moe_experts as tr_experts  # noqa: E402
from polykernel.backends.triton import moe_experts_gpt_oss as tr_oss  # noqa: E402
from polykernel.ops import moe_experts as op_experts  # noqa: E402
from polykernel.ops import moe_experts_gpt_oss as op_oss  # noqa: E402
from polykernel.testing import fresh, refusal, runnable_impls  # noqa: E402

OPS = {"moe_experts": op_experts, "moe_experts_gpt_oss": op_oss}
MODULES = (_grouped, _grouped_mm, tr_experts, tr_oss)  # every module that launches an MoE kernel
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SUBPROCESS = "bad-index script (triton; 2 processes, bad = 4 and -1)"


# -- the key Triton compiles on ------------------------------------------------------------------------
def _arg_key(a: Any) -> tuple[Any, ...]:
    if isinstance(a, torch.Tensor):
        ty = native_specialize_impl(BaseBackend, a, False, True, True)[0]
        return (ty, "D" if (a.storage_offset() * a.element_size()) % 16 == 0 else "")
    return tuple(native_specialize_impl(BaseBackend, a, False, True, True))


def _kernel_name(kernel: Any) -> str:
    fn = getattr(kernel, "fn", kernel)
    return f"{fn.__module__}.{fn.__name__}"


def _no_positional_constexpr(kernel: Any, n: int) -> None:
    import inspect

    fn = getattr(kernel, "fn", kernel)
    params = list(inspect.signature(fn).parameters.values())[:n]
    bad = [p.name for p in params if "constexpr" in str(p.annotation)]
    assert not bad, f"{_kernel_name(kernel)}: constexpr passed positionally: {bad}"


class Recorder:
    """Every launch's (case label, pair): the pair a JSON string of [kernel, meta, argument keys]."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.label = "?"

    def launch(self, kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
        _no_positional_constexpr(kernel, len(args))
        pair = [_kernel_name(kernel), sorted(meta.items()), [list(_arg_key(a)) for a in args]]
        self.calls.append((self.label, json.dumps(pair)))


class _GpuEnv:
    """``polykernel.env`` as ``_grouped`` reads it on a GPU: not the interpreter."""

    def __getattr__(self, name: str) -> Any:
        import polykernel.env as env

        return getattr(env, name)

    @staticmethod
    def triton_interpret() -> bool:
        return False


def _fake_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
    """torch._grouped_mm's output, empty: [M, K] x [E, K, N] -> [M, N]; [M, S] x [S, N] -> [E, M, N]."""
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[2])
    elif a.dim() == 2 and b.dim() == 2:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    else:
        raise NotImplementedError(f"grouped_mm {tuple(a.shape)} x {tuple(b.shape)}")
    return torch.empty(shape, dtype=a.dtype, device=a.device)


def _takes_on_a_gpu(hidden, tensors, inter, gate_up, down) -> bool:
    """``_grouped_mm.takes`` for the same call on a CUDA tensor (its ``hidden.is_cuda`` true)."""
    mode = _grouped_mm.MODE
    if mode == "kernels" or _grouped_mm._transforms_active() or not _moe_experts.plain(tensors):
        return False
    if mode == "auto" and hidden.dtype not in (torch.bfloat16, torch.float16):
        return False
    if hidden.shape[0] == 0:
        return False
    return _moe_experts.refusal(hidden, inter, gate_up, down) is None


# --fp16-no-grouped-mm: count as if torch._grouped_mm failed its probe for fp16 on the GPU (then
# fp16 runs our kernels for every case, as fp32 does)
PROBE_REFUSES: tuple[torch.dtype, ...] = ()
# --before: the GPU tests as they were before these counts (commit bb9c736's tests/), run from a
# checkout of that tree with this script copied in
BEFORE = False


def _probe_on_a_gpu(device: torch.device, dtype: torch.dtype) -> str | None:
    return "refused (--fp16-no-grouped-mm)" if dtype in PROBE_REFUSES else None


@contextlib.contextmanager
def gpu_emulation(rec: Recorder) -> Iterator[None]:
    saved = [(m, "launch", m.launch) for m in MODULES]
    saved += [(_grouped, "env", _grouped.env), (_compat, "grouped_mm", _compat.grouped_mm)]
    saved += [(_grouped_mm, "takes", _grouped_mm.takes), (_moe_experts, "_probe", _moe_experts._probe)]
    saved += [(_grouped_mm, "MODE", _grouped_mm.MODE)]
    try:
        for m in MODULES:
            m.launch = rec.launch
        _grouped.env = _GpuEnv()
        _compat.grouped_mm = _fake_grouped_mm
        _grouped_mm.takes = _takes_on_a_gpu
        _moe_experts._probe = _probe_on_a_gpu  # assumed: torch._grouped_mm runs bf16 and fp16 on the H200
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


# -- the tests' calls -----------------------------------------------------------------------------------
def parity(rec: Recorder, name: str, dtype: torch.dtype, cases: list, impls: list[str] | None, tag: str = "") -> None:
    """``check_parity``'s calls of the triton impl (the torch impl and the references run no Triton)."""
    public = getattr(polykernel, name)
    names = impls if impls is not None else runnable_impls(name, "cuda", dtype)
    if "triton" not in names:
        return
    for case in cases:
        if impls is None and refusal(name, "triton", case) is not None:
            continue
        rec.label = tag + case.label
        args = [fresh(a) for a in case.args]
        out = public(*args, impl="triton", **case.kwargs)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if leaves and out.requires_grad:
            cot = (2 * torch.rand_like(out, dtype=torch.float32) - 1).to(out.dtype)
            torch.autograd.grad([out], leaves, [cot], allow_unused=True)
        del args, out, leaves


def forward_only(rec: Recorder, name: str, label: str, args: tuple, times: int = 1) -> None:
    rec.label = label
    for _ in range(times):
        getattr(polykernel, name)(*args, impl="triton")


def grad_once(rec: Recorder, name: str, label: str, args: tuple) -> None:
    rec.label = label
    out = getattr(polykernel, name)(*args, impl="triton")
    torch.autograd.grad(out, [a for a in args if a.requires_grad], torch.randn_like(out))


def bad_index_args(name: str) -> tuple:
    """The bad-index scripts' arguments (bf16, forward only), with a good index: the kernels'
    keys do not depend on the values, and on the CPU the public op rejects a bad one first."""
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    index = torch.tensor([[0, 1]] * 7 + [[1, 2]])
    weights = torch.rand(8, 2, dtype=torch.bfloat16)
    if name == "moe_experts":
        return (x, index, weights, torch.randn(4, 128, 64, dtype=torch.bfloat16), torch.randn(4, 64, 64, dtype=torch.bfloat16))
    params = [torch.randn(*s, dtype=torch.bfloat16) for s in ((4, 64, 128), (4, 128), (4, 64, 64), (4, 64))]
    return (x, index, weights, *params)


def graph_args(name: str) -> tuple:
    c = OPS[name].example((64, 128, 96, 8, 2), torch.bfloat16, "cpu")
    return tuple(a.detach() for a in c.args)


def gpu_tests() -> list[tuple[str, str, Callable[[Recorder], None]]]:
    """(file, test id, replay) for every GPU test, in pytest's order within each file."""
    out: list[tuple[str, str, Callable[[Recorder], None]]] = []

    def mode(m: str) -> None:
        _grouped_mm.MODE = m

    # test_moe_paths.py
    for dtype in (torch.bfloat16, torch.float16):
        for name in sorted(OPS):

            def forced(rec: Recorder, name=name, dtype=dtype) -> None:
                if BEFORE:  # the tree before these counts: MODE "auto" on every case, then "kernels"
                    mode("auto")
                    parity(rec, name, dtype, OPS[name].cases("cpu", dtype), ["triton"], "auto:")
                mode("kernels")
                parity(rec, name, dtype, moe.kernels_gpu_cases(OPS[name], dtype, "cpu"), ["triton"], "kernels:" if BEFORE else "")
                mode("auto")

            test = "test_gpu_each_path_matches_the_reference" if BEFORE else "test_gpu_our_kernels_on_the_routings_grouped_mm_takes"
            out.append(("test_moe_paths", f"{test}[{dtype}-{name}]", forced))
    for name in sorted(OPS):

        def model_shape(rec: Recorder, name=name) -> None:
            torch.manual_seed(0)
            c = OPS[name].example((1024, 512, 256, 64, 8), torch.bfloat16, "cpu", requires_grad=True)
            grad_once(rec, name, "1024x512x256-E64-k8", c.args)

        out.append(("test_moe_paths", f"test_gpu_grouped_mm_path_at_a_model_shape[{name}]", model_shape))

    # test_moe_experts.py and test_moe_experts_gpt_oss.py
    for name, file in (("moe_experts", "test_moe_experts"), ("moe_experts_gpt_oss", "test_moe_experts_gpt_oss")):
        for dtype in DTYPES:

            def large(rec: Recorder, name=name, dtype=dtype) -> None:  # moe.assert_gpu_parity's triton part
                cases = moe.gpu_cases(OPS[name], dtype, "cpu")
                parity(rec, name, dtype, cases if BEFORE else moe.triton_gpu_cases(OPS[name], cases, dtype), None)

            out.append((file, f"test_parity_gpu_large[{dtype}]", large))
        # the bad-index scripts: a process of its own per (impl, bad index), started together by
        # the fixture (SUBPROCESS: not the test process's compiles)
        out.append((file, SUBPROCESS, lambda rec, name=name: forward_only(rec, name, "8x64x64-E4-k2", bad_index_args(name))))
        graph = lambda rec, name=name: forward_only(rec, name, "64x128x96-E8-k2", graph_args(name), 2)  # eager, then captured
        out.append((file, "test_cuda_graph_replay_matches_eager[triton]", graph))
    # test_moe_router.py: the router has a torch impl only (no Triton kernel)
    return out


# -- the counts ----------------------------------------------------------------------------------------
def short(pair: str) -> str:
    return json.loads(pair)[0].rpartition(".")[2]


GEMMS = ("_gate_up_kernel", "_d_inner_kernel", "_scatter_kernel", "_dw_kernel")


def summarize(results: list[dict], seconds: dict[str, float] | None = None) -> dict:
    """Per test: its distinct pairs, those new in its process (file order), those no earlier file
    compiled (the plan runs the files one after the other on one machine: Triton's disk cache);
    per case: its pairs and those no other case of the file needs."""
    files: dict[str, list[dict]] = {}
    for r in results:
        files.setdefault(r["file"], []).append(r)
    plan_seen: set[str] = set()
    out: dict[str, Any] = {"files": {}}
    for file, tests in files.items():
        owners: dict[str, set[str]] = {}
        for t in tests:
            if t["test"] == SUBPROCESS:
                continue
            for label, pairs in t["cases"].items():
                for p in pairs:
                    owners.setdefault(p, set()).add(f"{t['test']}/{label}")
        seen: set[str] = set()
        rows = []
        for t in tests:
            pairs = {p for ps in t["cases"].values() for p in ps}
            row: dict[str, Any] = {"test": t["test"], "pairs": len(pairs), "gemm_pairs": sum(short(p) in GEMMS for p in pairs)}
            if t["test"] == SUBPROCESS:
                row["note"] = "each of its processes compiles these (at once, with the test process)"
            else:
                new = pairs - seen
                row.update(new=len(new), new_in_plan=len(new - plan_seen))
                seen |= pairs
                row["cases"] = {
                    label: {
                        "pairs": len(ps),
                        "only_here": sum(len(owners[p]) == 1 for p in ps),
                        "kernels_only_here": sorted({short(p) for p in ps if len(owners[p]) == 1}),
                    }
                    for label, ps in t["cases"].items()
                }
            if seconds:
                row["compile_s_here"] = round(sum(seconds.get(p, 0.0) for p in pairs), 1)
            rows.append(row)
        summary = {
            "in_process": len(seen),
            "gemm_in_process": sum(short(p) in GEMMS for p in seen),
            "new_in_plan": len(seen - plan_seen),
            "tests": rows,
        }
        if seconds:
            summary["compile_s_in_process"] = round(sum(seconds.get(p, 0.0) for p in seen), 1)
            summary["compile_s_new_in_plan"] = round(sum(seconds.get(p, 0.0) for p in seen - plan_seen), 1)
        out["files"][file] = summary
        plan_seen |= seen
    out["plan_distinct"] = len(plan_seen)
    return out


def table(summary: dict) -> str:
    lines = [
        "| file | test | pairs | of them GEMM kernels | new in the process | not compiled by an earlier file | sm_90 compile s here (this CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for file, f in summary["files"].items():
        for r in f["tests"]:
            lines.append(
                f"| {file} | {r['test']} | {r['pairs']} | {r['gemm_pairs']} | {r.get('new', '(own process)')} | {r.get('new_in_plan', '')} | {r.get('compile_s_here', '')} |"
            )
        s = f.get("compile_s_in_process", "")
        lines.append(
            f"| **{file}** | **file (one process)** | **{f['in_process']}** | **{f['gemm_in_process']}** | | **{f['new_in_plan']}** | **{s}** |"
        )
    return "\n".join(lines)


# -- compiling the recorded pairs for sm_90 (no GPU needed: Triton's ptxas) -----------------------------
def compile_times(pairs: list[str], cache: str | None = None) -> dict[str, float]:
    """Seconds to compile each pair for an H100/H200 (sm_90) from a cold cache, in a process without
    the interpreter (the kernels are JITFunctions there), one after the other as a test process would;
    ``cache``: a JSON file of earlier measurements, reused and extended."""
    known: dict[str, float] = {}
    if cache and os.path.exists(cache):
        with open(cache) as f:
            known = json.load(f)
    missing = [p for p in pairs if p not in known]
    if missing:
        known.update(_compile_times(missing))
        if cache:
            with open(cache, "w") as f:
                json.dump(known, f)
    return {p: known[p] for p in pairs}


def _compile_times(pairs: list[str]) -> dict[str, float]:
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "pairs.json")
        with open(src, "w") as f:
            json.dump(pairs, f)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = os.path.join(tmp, "cache")
        env["PYTHONPATH"] = os.path.join(ROOT, "src")
        out = subprocess.run([sys.executable, __file__, "--compile-worker", src], env=env, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])


def _compile_worker(path: str) -> None:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    with open(path) as f:
        pairs = json.load(f)
    times = {}
    for pair in pairs:
        name, meta, args = json.loads(pair)
        module, _, attr = name.rpartition(".")
        fn = getattr(importlib.import_module(module), attr)
        assert not fn.do_not_specialize and not fn.do_not_specialize_on_alignment, name
        meta = dict(meta)
        options = backend.parse_options({k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta})
        signature, constexprs, attrs = {}, {}, {}
        for i, p in enumerate(fn.params):
            if i < len(args):
                ty, spec = args[i]
                signature[p.name] = ty
                if ty == "constexpr":
                    constexprs[(i,)] = spec
                elif isinstance(spec, str):
                    attrs[(i,)] = backend.parse_attr(spec)
            else:
                signature[p.name] = "constexpr"
                constexprs[(i,)] = meta[p.name] if p.name in meta else p.default
        start = time.perf_counter()
        triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        times[pair] = round(time.perf_counter() - start, 3)
        print(f"{time.perf_counter() - start:6.2f} s {attr}", file=sys.stderr, flush=True)
    print(json.dumps(times))


def self_check() -> None:
    """The emulation launches the same kernels, in the same order, as the interpreter running them
    for real (each path forced, the op's CPU cases): no host decision reads a skipped kernel's output."""
    for name, op in OPS.items():
        for mode in ("kernels", "grouped_mm"):
            for dtype in (torch.float32, torch.bfloat16):
                cases = op.cases("cpu", dtype)
                emulated = Recorder()
                with gpu_emulation(emulated):
                    _grouped_mm.MODE = mode
                    parity(emulated, name, dtype, cases, ["triton"])
                real: list[tuple[str, str]] = []
                rec = Recorder()

                def run(kernel: Any, grid: tuple[int, ...], *args: Any, rec=rec, real=real, **meta: Any) -> Any:
                    real.append((rec.label, _kernel_name(kernel)))
                    return kernel[grid](*args, **meta)

                saved = [(m, m.launch) for m in MODULES]
                try:
                    for m in MODULES:
                        m.launch = run
                    _grouped_mm.MODE = mode
                    parity(rec, name, dtype, cases, ["triton"])
                finally:
                    _grouped_mm.MODE = "auto"
                    for m, f in saved:
                        m.launch = f
                same = [(label, json.loads(p)[0]) for label, p in emulated.calls] == real
                print(f"{name} {mode} {dtype}: {len(real)} launches, the same sequence: {same}", file=sys.stderr)
                assert same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the records and the counts here")
    ap.add_argument("-k", default="", help="only the tests whose id contains this")
    ap.add_argument("--compile", action="store_true", help="also compile every pair for sm_90 and time it")
    ap.add_argument("--compile-cache", help="a JSON file of compile times to reuse and extend")
    ap.add_argument("--fp16-no-grouped-mm", action="store_true", help="as if torch._grouped_mm refused fp16 on the GPU")
    ap.add_argument("--before", action="store_true", help="model the tests of the tree before these counts")
    ap.add_argument("--self-check", action="store_true", help="check the emulation against the interpreter's real runs")
    ap.add_argument("--compile-worker", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    global PROBE_REFUSES, BEFORE
    PROBE_REFUSES = (torch.float16,) if ns.fp16_no_grouped_mm else ()
    BEFORE = ns.before
    if ns.self_check:
        return self_check()
    if ns.compile_worker:
        return _compile_worker(ns.compile_worker)
    results = []
    for file, test, replay in gpu_tests():
        if ns.k not in f"{file}::{test}":
            continue
        rec = Recorder()
        start = time.perf_counter()
        torch.manual_seed(0)
        with gpu_emulation(rec):
            replay(rec)
        by_case: dict[str, list[str]] = {}
        for label, pair in rec.calls:
            if pair not in by_case.setdefault(label, []):
                by_case[label].append(pair)
        results.append({"file": file, "test": test, "launches": len(rec.calls), "cases": by_case})
        n = len({p for _, p in rec.calls})
        print(
            f"{file}::{test}: {len(rec.calls)} launches, {n} distinct pairs ({time.perf_counter() - start:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    seconds = None
    if ns.compile:
        every = sorted({p for r in results for ps in r["cases"].values() for p in ps})
        seconds = compile_times(every, ns.compile_cache)
    summary = summarize(results, seconds)
    print(table(summary))
    if ns.json:
        every = sorted({p for r in results for ps in r["cases"].values() for p in ps})
        index = {p: i for i, p in enumerate(every)}
        pairs = []
        for p in every:
            kernel, meta, args = json.loads(p)
            pairs.append({"kernel": kernel, "meta": dict(meta), "args": args, "compile_s": seconds[p] if seconds else None})
        tests = [{**r, "cases": {label: [index[p] for p in ps] for label, ps in r["cases"].items()}} for r in results]
        with open(ns.json, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "triton": __import__("triton").__version__,
                    "options": {"before": ns.before, "fp16_no_grouped_mm": ns.fp16_no_grouped_mm},
                    "summary": summary,
                    "pairs": pairs,  # args: Triton's (type, specialization) per positional argument
                    "tests": tests,  # cases: label -> indices into pairs
                },
                f,
                separators=(",", ":"),
            )


if __name__ == "__main__":
    main()
