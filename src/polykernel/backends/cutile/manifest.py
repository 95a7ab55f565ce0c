"""The ops the ``cutile`` backend implements, and its impl row for each (torch-free; see
:mod:`polykernel.backends`)."""

from . import CUTILE, _gates

IMPLS = {
    "norm.rms_norm": CUTILE.impl(
        rank=40,
        description="one tile per row block (chunked beyond 8192); persistent backward, dW from per-block partials (deterministic)",
        predicate=_gates.rms_norm,
    ),
    "activation.geglu": CUTILE.impl(
        rank=40,
        description="one elementwise pass each way over [M, N] views (any strides); erf from an erfc fit (cuTile has no erf)",
        predicate=_gates.geglu,
    ),
    "activation.swiglu": CUTILE.impl(
        rank=40,
        description="one elementwise pass each way over [M, N] views (any strides); backward recomputes silu",
        predicate=_gates.swiglu,
    ),
    "activation.softmax": CUTILE.impl(
        rank=40,
        supports_backward=False,
        description="forward only: one tile per row block (chunked online max/sum beyond 8192)",
        predicate=_gates.softmax,
    ),
    "embedding.rope": CUTILE.impl(
        rank=40,
        description="gathers by element index (any D, any q/k strides); cos/sin loaded once per position tile for all heads",
        predicate=_gates.rope,  # (it refuses the options too)
    ),
}
