"""The ops the ``cutile`` backend implements, and its impl row for each (torch-free; see
:mod:`polykernel.backends`)."""

from . import CUTILE, _gates

IMPLS = {
    "norm.rms_norm": CUTILE.impl(
        rank=40,
        description="one tile per row block (chunked beyond 8192); persistent backward, dW from per-block partials (deterministic)",
        predicate=_gates.rms_norm,
    ),
}
