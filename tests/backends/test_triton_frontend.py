"""Triton's interpreter (the CPU suite's) runs a kernel as Python: it does not check what the
compiler checks, such as a name bound in both branches of an ``if`` with two types. On
2026-12-03 the H200 refused ``rope_kv_write``'s kernel for exactly that while every CPU test
passed. Here the kernels run through Triton's frontend (Python AST to TTIR) for sm_90, which
needs no GPU."""

import pytest

triton = pytest.importorskip("triton")


def _frontend(kernel, types: dict[str, str], constexprs: dict[str, int]) -> str:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):  # TRITON_INTERPRET=1 (the CPU suite) wraps it
        kernel = JITFunction(kernel.fn)
    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    target = GPUTarget("cuda", 90, 32)
    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i64") for n in names}
    src = ASTSource(kernel, sig, {(names.index(n),): v for n, v in constexprs.items()})
    backend = nvidia.CUDABackend(target)
    opts = backend.parse_options({})
    ctx = ir.context()
    ir.load_dialects(ctx)
    return str(src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_rope_kv_write_kernel_compiles_for_sm90(dtype):
    from polykernel.backends.triton.rope_kv_write import _rope_kv_kernel

    types = {n: f"*{dtype}" for n in ("QKV", "COS", "SIN", "QO", "KC", "VC")} | {"CUM": "*i64"}
    assert "tt.func" in _frontend(_rope_kv_kernel, types, {"HALF": 32, "BLOCK_H": 8, "BLOCK_D": 32})


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
    assert {"_rms_fwd_kernel", "_act_bwd_kernel", "_combine_kernel"} <= names, sorted(names)  # the sweep reaches them
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, str(here), "compile", str(jobs)], env=env, capture_output=True, text=True, timeout=600)
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert run.returncode == 0 and not failed, "\n".join(failed[:20]) + run.stderr[-2000:]
    assert f"compiled {len(recorded['jobs'])}" in run.stdout
