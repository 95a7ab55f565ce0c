"""The ops the ``torch`` backend implements, and its impl row for each (torch-free; see
:mod:`polykernel.backends`). Every op has a torch impl: the fallback, eligible everywhere."""

from . import TORCH

IMPLS = {
    "norm.rms_norm": TORCH.impl(rank=100, description="F.rms_norm (PyTorch's fused kernel) for casting='fp32', else the reference"),
}
