"""PyTorch impls (``torch``): every op's fallback, eligible everywhere, in any floating dtype.

Eager torch ops, in fp32 math as each op's reference states; one module per op. The dispatcher
hands these impls tensor subclasses too (a DTensor, a wrapper): torch dispatches them itself.
"""

from ..declare import Backend

TORCH = Backend("torch", rank=100, description="eager PyTorch: runs on any device and dtype; the fallback of every op")


def __getattr__(name: str):
    # ``from polykernel.backends.torch import _linear_logps`` (benchmarks/kernels/preference_losses.py
    # sets its CHUNK_BYTES): the moved module itself, not a copy, so that the assignment takes effect.
    if name == "_linear_logps":
        from .. import _linear_logps

        return _linear_logps
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
