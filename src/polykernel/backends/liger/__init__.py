"""Liger-Kernel 0.8.5 (``liger_kernel``) as polykernel impls: one thin adapter per op.

Importing this package does not import ``liger_kernel``: each op module does, and the dispatcher
imports an op module only when its impl is selected. The predicates in :mod:`._gates` (torch- and
Liger-free) say where Liger computes something else than the op's contract or refuses a case.

Each adapter calls Liger's default Triton path (``liger_kernel.ops.<op>`` submodules, never the
``liger_kernel.ops`` namespace that ``LIGER_KERNEL_IMPL`` may swap), and keeps our contract where
Liger's memory tricks would break it: Liger writes gradients into its inputs (logits, gate/up,
dY, q/k); the adapters hand it private copies where the caller's tensors would be overwritten.
"""

from ...spec import CapabilityRequirement
from ..declare import KERNEL_DTYPES, Backend

# Rank 60: behind our Triton kernels, which tie or beat Liger (per op, in the op files).
LIGER = Backend(
    "liger",
    modules=("liger_kernel", "triton"),
    capabilities=CapabilityRequirement.CUDA,
    dtypes=KERNEL_DTYPES,
    rank=60,
    description="Liger-Kernel 0.8.5 (Triton) through thin adapters that keep the op's contract",
)
