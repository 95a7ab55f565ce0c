"""The ops the ``cuda_jit`` backend (our CUDA C++ kernels, issue 25) implements, and its impl row
for each (torch-free; see :mod:`polykernel.backends`). Forward only; ranks until measured on the
H200 (benchmarks/kernels/providers.py): by name or measured selection."""

from . import CUDA_JIT, _gates

IMPLS = {
    "norm.rms_norm": CUDA_JIT.impl(
        rank=45,
        supports_backward=False,
        description="CUDA C++ (load_inline): one block per row, 128-bit vectors, warp-shuffle sums; forward only; N % (16 bytes) == 0",
        predicate=_gates.rms_norm,
    ),
    "norm.fused_add_rms_norm": CUDA_JIT.impl(
        rank=45,
        supports_backward=False,
        description="CUDA C++ (load_inline): add and norm in one pass, 128-bit vectors; forward only; N % (16 bytes) == 0",
        predicate=_gates.fused_add_rms_norm,
    ),
    "serving.fused_add_rms_norm_": CUDA_JIT.impl(
        rank=45,
        supports_backward=False,
        description="CUDA C++ (load_inline): add and norm in one pass, 128-bit vectors, y over x and s over residual; N % (16 bytes) == 0",
        predicate=_gates.fused_add_rms_norm_,
    ),
}
