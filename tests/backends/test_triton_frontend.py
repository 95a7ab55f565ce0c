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
