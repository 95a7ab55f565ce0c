"""FlashInfer (``flashinfer-python``) as polykernel impls: one thin adapter per op.

Importing this package does not import ``flashinfer``: each op module does, and the dispatcher
imports an op module only when its impl is selected. The predicates in :mod:`._gates` (torch- and
FlashInfer-free) say where FlashInfer computes something else than the op's contract or refuses a
case; the adapters hand its kernels only dense, 16-byte aligned tensors (:mod:`.._dense`).

FlashInfer JIT-compiles each kernel module with the CUDA toolkit (nvcc) on its first call and
caches it on disk: call an op once before capturing a CUDA graph, or build every module our
adapters use at once, in parallel: ``python -m polykernel.backends.flashinfer._prebuild``. Its norms run its CuTe DSL
kernels when ``nvidia-cutlass-dsl`` imports, else its CUDA ones (same math: fp32, one rounding).

Ops: rms_norm (forward only; ``casting="fp32"``, offset 0 or 1), fused_add_rms_norm_, silu_and_mul,
gelu_and_mul (erf; its tanh kernel is refused), rotary_embedding_ (with a key; fp32 cache). Staging it on the H200:
``benchmarks/stage_serving_peers.sh``.
"""

from ...spec import CapabilityRequirement
from ..declare import Backend

# Rank 70: behind our Triton kernels and the other peers until measured (per op, in the op files).
FLASHINFER = Backend(
    "flashinfer",
    modules=("flashinfer",),
    capabilities=CapabilityRequirement.cuda(min_sm=80),
    dtypes=("bfloat16", "float16"),  # its norm, activation and rope kernels dispatch on fp16/bf16 only
    rank=70,
    description="FlashInfer (JIT-compiled CUDA and CuTe DSL kernels) through thin adapters",
)
