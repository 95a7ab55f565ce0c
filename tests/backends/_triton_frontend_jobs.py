"""The two halves of ``test_triton_frontend``'s sweep, each run in its own process:

- ``collect OUT``: under Triton's interpreter, call every op's triton impl on the op's cases
  (every float dtype it takes, forward and backward; the MoE ops on both of their paths) with
  each kernel launch recorded and *not run* (the host code runs as it would; the outputs are
  left unwritten, which is why this runs apart from the other tests). Writes the distinct
  (kernel, signature, constexprs) launched to OUT (pickle).
- ``compile JOBS``: without the interpreter, run each through Triton's frontend (Python AST to
  TTIR) for sm_90, which needs no GPU; print one line per kernel that does not compile.

  With ``"passed"`` in JOBS (a file's path), the jobs that compiled are kept there, each by a hash
  of everything its compile reads: Triton's own key of its compiler and frontend sources, the
  kernel's source with every jit function it calls and the globals it reads (``cache_key``, what
  Triton's own cache is keyed on), this file, the target and options, the signature and the
  constexprs. A job whose hash is there is not compiled again (a failure is never kept): a later
  run of the suite compiles only what changed (the ~1360 jobs take ~45 s on a CPU core).
"""

from __future__ import annotations

import functools
import importlib
import os
import pickle
import sys


def _signature(jit, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    import torch

    names = [p.name for p in jit.params]
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    types = {
        torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
        torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
        torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
    }  # fmt: skip
    sig: dict = {}
    const: dict = {}
    for i, p in enumerate(jit.params):
        v = bound[p.name] if p.name in bound else p.default
        if p.is_constexpr or v is None:
            sig[p.name] = "constexpr"
            const[(i,)] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + types[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{jit.fn.__name__}: argument {p.name} of type {type(v).__name__}")
    return sig, const


def collect(out: str) -> None:
    import torch
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from polykernel import _compat
    from polykernel.backends.triton import _grouped_mm
    from polykernel.core.registry import REGISTRY
    from polykernel.testing import _public_fn, fresh, runnable_impls

    launches: dict[int, tuple] = {}

    def record(self, *args, **kwargs):  # the launch is recorded, not run
        launches.setdefault(id(self.fn), (self.fn, []))[1].append((args, kwargs))

    InterpretedFunction.run = record
    errors = []
    for mode in ("auto", "grouped_mm"):
        _grouped_mm.MODE = mode
        for op_id in REGISTRY.all_op_ids():
            if mode != "auto" and "moe" not in op_id:
                continue
            op = REGISTRY.get_op(op_id)
            fn = _public_fn(op)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                if "triton" not in runnable_impls(op_id, "cpu", dtype):
                    continue
                for case in op.cases("cpu", dtype):
                    try:
                        out_ = fn(*[fresh(a) for a in case.args], impl="triton", **case.kwargs)
                        outs = out_ if isinstance(out_, tuple) else (out_,)
                        need = [o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
                        if need:
                            torch.autograd.backward(need)
                    except Exception as exc:  # reported; the kernels launched before it still count
                        errors.append(f"{op_id} {case.label} {dtype}: {type(exc).__name__}: {str(exc)[:200]}")
    jobs, seen = [], set()
    for fn, calls in launches.values():
        jit = JITFunction(fn)
        for args, kwargs in calls:
            sig, const = _signature(jit, args, kwargs)
            key = (fn.__module__, fn.__name__, tuple(sig.items()), tuple(sorted((k, repr(v)) for k, v in const.items())))
            if key not in seen:
                seen.add(key)
                jobs.append((fn.__module__, fn.__name__, sig, const))
    with open(out, "wb") as f:
        # The hybrid MoE path (and its kernels) runs only where torch._grouped_mm does: not under
        # POLYKERNEL_COMPAT_FALLBACKS=1, nor on a torch without it.
        pickle.dump({"jobs": jobs, "errors": errors, "grouped_mm": _compat.grouped_mm is not None}, f)


def compile_all(path: str) -> None:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    with open(path, "rb") as f:
        data = pickle.load(f)
    jobs, kept = data["jobs"], data.get("passed")
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    opts = backend.parse_options({})
    passed = _read_passed(kept) if kept else set()
    compiled = set()
    for module, name, sig, const in jobs:
        kernel = getattr(importlib.import_module(module), name)
        key = _job_key(kernel, target, opts, sig, const) if kept else None
        if key in passed:
            compiled.add(key)
            continue
        ctx = ir.context()
        ir.load_dialects(ctx)
        try:
            ASTSource(kernel, sig, const).make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
        except Exception as exc:
            last = [line for line in str(exc).splitlines() if line.strip()][-1:] or [type(exc).__name__]
            print(f"FAILED {module}.{name} {sig}: {last[0][:300]}", flush=True)
        else:
            compiled.add(key)
    if kept and compiled - passed:
        _write_passed(kept, compiled)
    print(f"compiled {len(jobs)} ({len(compiled & passed)} of them passed before, unchanged)", flush=True)


def _job_key(kernel, target, opts, sig: dict, const: dict) -> str:
    """What one job's compile reads, hashed (the module docstring lists it)."""
    import hashlib

    from triton.runtime.cache import triton_key

    source = kernel.cache_key  # computing it fills used_global_vals
    used = sorted((name, repr(val)) for (name, _), (val, _) in kernel.used_global_vals.items())
    parts = (
        triton_key(),
        _this_file_hash(),
        repr(target),
        repr(opts),
        source,
        repr(used),
        repr(sorted(sig.items())),
        repr(sorted(const.items(), key=repr)),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@functools.cache
def _this_file_hash() -> str:
    """This file's sha256, read once a process (every job's key holds it)."""
    import hashlib

    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _read_passed(path: str) -> set:
    try:
        with open(path) as f:
            return set(f.read().split())
    except OSError:
        return set()


def _write_passed(path: str, keys: set) -> None:
    """The jobs of this run that compiled (only those: a kernel edited since drops out), written
    whole and renamed into place (a run beside this one reads one file or the other)."""
    import tempfile

    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".passed-")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(sorted(keys)) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    if sys.argv[1] == "collect":
        assert os.environ.get("TRITON_INTERPRET") == "1"
        collect(sys.argv[2])
    else:
        assert os.environ.get("TRITON_INTERPRET") != "1"
        compile_all(sys.argv[2])
