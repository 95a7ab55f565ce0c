"""The ops the ``triton`` backend implements, and its impl row for each (torch-free; see
:mod:`polykernel.backends`)."""

from . import TRITON

IMPLS = {
    "norm.rms_norm": TRITON.impl(
        rank=10, description="one row per program (chunked for long rows); dW from per-program partials (deterministic)"
    ),
}
