"""cuTile (``cuda-tile``, NVIDIA's tile-level Python DSL) impls: one kernel file per op.

Importing this package imports neither ``cuda.tile`` nor torch: each op module does, and the
dispatcher imports an op module only when its impl is selected. :mod:`._gates` holds the
torch-free gates: the arch window of the tileiras 13.4 compiler (sm_80 to sm_121), and a probe
that compiles one tiny kernel for the device's arch, once per process and arch, the first time a
cuTile impl is considered, so ``explain`` can say ``tileiras not found`` or
``tileiras failed: <first line>`` instead of failing at the first launch.

Ops: swiglu, geglu (fwd+bwd, :mod:`.glu`), rms_norm (fwd+bwd), rope (fwd+bwd, any q/k strides),
softmax (fwd). Kernels are JIT-compiled by cuTile on the first launch per signature (dtypes,
ranks, constants) and cached by it, in memory and on disk.
"""

from ...spec import CapabilityRequirement
from ..declare import KERNEL_DTYPES, Backend
from ._gates import MAX_SM, MIN_SM, MODULES

# Rank 40, behind Triton: it ties or trails Triton on every op measured
# (benchmarks/results/h200-2026-11-30-cutile.json), so it runs by name. Each op's predicate probes
# the tileiras compiler once per process and arch (explain shows why it cannot run: `tileiras not
# found`, `tileiras failed: ...`).
CUTILE = Backend(
    "cutile",
    modules=MODULES,
    capabilities=CapabilityRequirement.cuda(min_sm=MIN_SM, max_sm=MAX_SM),
    dtypes=KERNEL_DTYPES,
    rank=40,
    description="cuTile kernels (cuda-tile), JIT-compiled by tileiras for sm_80 to sm_121",
)
