"""The op's torch reference under ``torch.compile(dynamic=True)`` (``torch_compile`` impls).

Inductor fuses the reference's fp32 math into one generated kernel (Triton on CUDA, C++ on the
CPU); autograd runs through the compiled function (AOTAutograd compiles the backward). One
compiled function per op, and the first call of each argument class pays its compile (seconds),
so the backend ranks behind every other impl: auto never picks it, ``impl="torch_compile"`` or
measured selection (which charges the compile, :mod:`polykernel.tuning.measure`) does.

Importing this package imports neither ``torch._inductor`` nor torch: the op modules do, when an
impl is selected. The gates (:mod:`._gates`) say where Inductor cannot compile (no C++ compiler,
no Triton, an outer ``torch.compile`` trace, a CUDA-graph capture of a class not compiled yet).
"""

from ...spec import CapabilityRequirement
from ..declare import KERNEL_DTYPES, Backend
from ._gates import MODULES

# Rank 110, behind the torch impl (100): a one-off call never pays a compile unless asked to.
TORCH_COMPILE = Backend(
    "torch_compile",
    modules=MODULES,
    capabilities=(CapabilityRequirement.CUDA, CapabilityRequirement.CPU),
    dtypes=KERNEL_DTYPES,  # float64 stays with the torch impl: nothing to gain from a compile
    rank=110,
    description="the op's torch reference under torch.compile(dynamic=True), compiled once per process and argument class",
)
