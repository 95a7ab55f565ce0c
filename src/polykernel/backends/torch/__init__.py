"""PyTorch impls (``torch``): every op's fallback, eligible everywhere, in any floating dtype.

Eager torch ops, in fp32 math as each op's reference states; one module per op. The dispatcher
hands these impls tensor subclasses too (a DTensor, a wrapper): torch dispatches them itself.
"""

from ..declare import Backend

TORCH = Backend("torch", rank=100, description="eager PyTorch: runs on any device and dtype; the fallback of every op")
