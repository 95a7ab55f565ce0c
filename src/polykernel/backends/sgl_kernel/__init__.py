"""sgl-kernel (SGLang's ahead-of-time kernel wheel, ``sglang-kernel`` on the index, module
``sgl_kernel``) as polykernel impls: one thin adapter per op.

Importing this package does not import ``sgl_kernel``: each op module does, and the dispatcher
imports an op module only when its impl is selected. The adapters call the AOT library's
registered ops (``torch.ops.sgl_kernel.*``, their schemas are the library's contract) rather than
``sgl_kernel``'s Python wrappers, which hand the norms to FlashInfer whenever FlashInfer is
importable: so this backend measures sgl-kernel's own kernels. The predicates in :mod:`._gates`
say where they compute something else or refuse a case.

The wheel is built for one torch (sglang-kernel 0.4.4-0.4.6: torch 2.11, CUDA 13; later ones pin
newer torch): a mismatch fails the import, which the dispatcher reports as the reason. Ops:
rms_norm (forward only), fused_add_rms_norm_, silu_and_mul, gelu_and_mul, rotary_embedding_ (fp32
only). Staging it on the H200: ``benchmarks/stage_serving_peers.sh``.
"""

from ...spec import CapabilityRequirement
from ..declare import Backend

SGL_KERNEL = Backend(
    "sgl_kernel",
    modules=("sgl_kernel",),
    capabilities=CapabilityRequirement.cuda(min_sm=80),
    dtypes=("bfloat16", "float16"),  # what its norms take as FlashInfer's; rotary is fp32 only (its row)
    rank=75,
    description="sgl-kernel (SGLang's AOT CUDA kernels, torch.ops.sgl_kernel) through thin adapters",
)
