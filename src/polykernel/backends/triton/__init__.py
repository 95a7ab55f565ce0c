"""Our Triton kernels (``triton``): one module per op, kernel -> host launcher -> registered impl.

CUDA devices (and the CPU through ``TRITON_INTERPRET=1``), fp32/bf16/fp16. Shared pieces: row
configs (:mod:`._rows`), launch paths (:mod:`._launch`, :mod:`._native`), autograd glue.
"""

from ...spec import CapabilityRequirement
from ..declare import KERNEL_DTYPES, Backend

TRITON = Backend(
    "triton",
    modules=("triton",),
    capabilities=CapabilityRequirement.CUDA,
    dtypes=KERNEL_DTYPES,
    rank=10,
    description="our Triton kernels; CUDA, or the CPU under TRITON_INTERPRET=1",
)
