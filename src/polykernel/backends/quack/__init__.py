"""QuACK 0.6.5 (``quack``, CuTeDSL kernels) as polykernel impls: one thin adapter per op.

Importing this package does not import ``quack`` or ``cutlass``: each op module does, and the
dispatcher imports an op module only when its impl is selected. The predicates in :mod:`._gates`
(torch- and QuACK-free) say where QuACK computes something else or refuses a case.

Not registered: QuACK's chunked linear cross-entropy (``quack.linear_cross_entropy``) fails on the
H200 stack (torch 2.11, CuTeDSL 4.x) with a CuTeDSL epilogue ContextVar error; its LayerNorm
(``layernorm_fwd``/``layernorm_bwd``, no autograd wrapper, fp32 weight and bias only) and its rotary
embedding (``apply_rotary_emb``: [B, T, H, D] layout, half-width cos/sin) are not adapted yet.
Its softmax failed parity on the H200 and is not registered either (why: :mod:`.manifest`).
"""

from ...spec import CapabilityRequirement
from ..declare import KERNEL_DTYPES, Backend

# Rank 50: behind Triton, ahead of Liger; an op's measured rank_for rule may put it first.
QUACK = Backend(
    "quack",
    modules=("quack", "cutlass"),
    capabilities=CapabilityRequirement.cuda(min_sm=90),
    dtypes=KERNEL_DTYPES,
    rank=50,
    description="QuACK 0.6.5 (CuTeDSL kernels, sm_90+) through thin adapters",
)
