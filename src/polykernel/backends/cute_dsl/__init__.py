"""Our own CuTeDSL kernels (``cute_dsl`` impls, sm_90+): one module per op plus shared helpers.

Importing this package imports neither ``cutlass`` nor torch. The per-call predicates live in
:mod:`._gates` (torch- and CuTeDSL-free, so the op files can import them on any machine); the
DSL helpers every kernel shares (row reductions, tiled copies, the compile cache and the launch
path) live in :mod:`._common`, which imports ``cutlass`` and is loaded only when an impl is
selected. Each op module reads like the Triton ones: kernel -> host launcher -> registered impl.
"""

from ...spec import CapabilityRequirement
from ..declare import KERNEL_DTYPES, Backend

# Rank 40: behind Triton unless an op's measured rank_for rule puts a kernel first.
CUTE_DSL = Backend(
    "cute_dsl",
    modules=("cutlass", "tvm_ffi"),
    capabilities=CapabilityRequirement.cuda(min_sm=90),
    dtypes=KERNEL_DTYPES,
    rank=40,
    description="our CuTeDSL kernels (sm_90+): rows in registers, 128-bit vectors, cluster reductions",
)
