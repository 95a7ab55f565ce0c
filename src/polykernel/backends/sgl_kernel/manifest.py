"""The ops the ``sgl_kernel`` backend implements, and its impl row for each (torch-free; see
:mod:`polykernel.backends`). Serving peer, forward only (no backward: passed by when a gradient is
wanted); unmeasured, so behind every other impl: by name or when measured selection picks it."""

from . import SGL_KERNEL, _gates

IMPLS = {
    "norm.rms_norm": SGL_KERNEL.impl(
        rank=75,
        supports_backward=False,
        description="sgl-kernel rmsnorm / gemma_rmsnorm (offset 0 or 1), forward only; casting='fp32', weight of x's dtype",
        predicate=_gates.rms_norm,
    ),
}
