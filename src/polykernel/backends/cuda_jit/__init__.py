"""Hand-written CUDA C++ kernels, JIT-compiled by torch's extension loader (``cuda_jit`` impls).

``csrc/``: the kernels (``rms_norm.cuh``, pure CUDA) and their torch launcher (``binding.cu``),
built once per torch/Python/source version by ``torch.utils.cpp_extension.load_inline`` into the
polykernel cache (``$POLYKERNEL_CACHE_DIR`` or the user cache dir, ``cuda_jit/``), under a file
lock so that parallel processes build it once (:mod:`._build`). Ops: rms_norm, fused_add_rms_norm
and the serving ``fused_add_rms_norm_`` (forward: one block per row, 128-bit loads, warp-shuffle
sums, fp32 math). Forward only: with a gradient wanted, the dispatcher takes the next impl
(explain: "has no backward").

Importing this package imports neither torch nor ``torch.utils.cpp_extension``; :mod:`._gates`
(torch-free) says where it cannot run: no nvcc, no ninja, a row length the vectors do not tile.
"""

from ...spec import CapabilityRequirement
from ..declare import KERNEL_DTYPES, Backend

# Rank 45: behind Triton (10) and the CuTeDSL/cuTile kernels until measured on the H200
# (benchmarks/kernels/providers.py); by name, or where measured selection picks it.
CUDA_JIT = Backend(
    "cuda_jit",
    capabilities=CapabilityRequirement.cuda(min_sm=80),
    dtypes=KERNEL_DTYPES,
    rank=45,
    description="hand-written CUDA C++ kernels (sm_80+), JIT-compiled once by torch's extension loader (nvcc, ninja)",
)
