"""Triton's interpreter (the CPU suite's) runs a kernel as Python: it does not check what the
compiler checks, such as a name bound in both branches of an ``if`` with two types. On
2026-12-03 the H200 refused ``rope_kv_write``'s kernel for exactly that while every CPU test
passed. Here the kernels run through Triton's frontend (Python AST to TTIR) for sm_90, which
needs no GPU."""

import pytest

triton = pytest.importorskip("triton")


def _compile(jobs: list, tmp_path, kept: str) -> list[str]:
    """Run ``jobs`` ((module, kernel name, signature, constexprs) each) through the frontend in a
    process without the interpreter (in one that has run interpreted kernels, Triton's
    ``tl`` builtins may still be the interpreter's); the lines of the kernels that fail. The jobs
    that compile are kept in the cache folder's file ``kept`` (one per caller), by a hash of all
    that their compile reads, and not compiled again while that is unchanged
    (_triton_frontend_jobs.py says what the hash holds)."""
    import os
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    from polykernel.tuning.json_store import cache_dir

    pytest.importorskip("triton.backends.nvidia.compiler")
    path = tmp_path / "compile.pkl"
    passed = (cache_dir() or Path.home() / ".cache" / "polykernel") / "triton-frontend" / kept
    path.write_bytes(pickle.dumps({"jobs": jobs, "errors": [], "passed": str(passed)}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).parents[2] / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    here = Path(__file__).with_name("_triton_frontend_jobs.py")
    run = subprocess.run([sys.executable, str(here), "compile", str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and f"compiled {len(jobs)}" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    return [line for line in run.stdout.splitlines() if line.startswith("FAILED")]


ROPE_KV_DTYPES = ("bf16", "fp16", "fp32")


@pytest.fixture(scope="module")
def rope_kv_write_failures(tmp_path_factory) -> dict[str, list[str]]:
    """``rope_kv_write``'s kernel with each of ROPE_KV_DTYPES through the frontend, in one process
    (a process per dtype spent most of its time importing); the FAILED lines of each dtype."""
    import inspect

    from polykernel.backends.triton import rope_kv_write

    names = list(inspect.signature(rope_kv_write._rope_kv_kernel.fn).parameters)
    const = {"HALF": 32, "BLOCK_H": 8, "BLOCK_D": 32}
    pointers = ("QKV", "COS", "SIN", "QO", "KC", "VC")
    jobs = []
    for dtype in ROPE_KV_DTYPES:
        sig = {n: "constexpr" if n in const else ("*i64" if n == "CUM" else f"*{dtype}" if n in pointers else "i64") for n in names}
        jobs.append((rope_kv_write.__name__, "_rope_kv_kernel", sig, {(names.index(n),): v for n, v in const.items()}))
    failed = _compile(jobs, tmp_path_factory.mktemp("rope_kv_write"), "rope_kv_write.txt")
    # each line names its job's signature, whose pointer types give the dtype
    return {dtype: [line for line in failed if f"'QKV': '*{dtype}'" in line] for dtype in ROPE_KV_DTYPES} | {
        "unattributed": [line for line in failed if not any(f"'QKV': '*{d}'" in line for d in ROPE_KV_DTYPES)]
    }


@pytest.mark.parametrize("dtype", ROPE_KV_DTYPES)
def test_rope_kv_write_kernel_compiles_for_sm90(dtype, rope_kv_write_failures):
    assert rope_kv_write_failures[dtype] == [] and rope_kv_write_failures["unattributed"] == []


def test_every_kernel_the_ops_launch_compiles_for_sm90(tmp_path):
    # Every (kernel, signature, constexprs) that the ops' triton impls launch on their cases,
    # every float dtype, forward and backward (_triton_frontend_jobs.py says how), through the
    # frontend. Two processes: the launches are recorded under the interpreter without running,
    # then compiled without it.
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia.compiler")
    here = Path(__file__).with_name("_triton_frontend_jobs.py")
    src = str(Path(__file__).parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    jobs = tmp_path / "jobs.pkl"
    run = subprocess.run(
        [sys.executable, str(here), "collect", str(jobs)], env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    import pickle

    recorded = pickle.loads(jobs.read_bytes())
    assert not recorded["errors"], "\n".join(recorded["errors"][:20])
    names = {name for _, name, _, _ in recorded["jobs"]}
    reached = {"_rms_fwd_kernel"} | ({"_act_bwd_kernel", "_combine_kernel"} if recorded["grouped_mm"] else set())
    assert reached <= names, sorted(names)  # the sweep reaches them (the hybrid MoE path's only with torch._grouped_mm)
    assert _compile(recorded["jobs"], tmp_path, "ops.txt") == []
