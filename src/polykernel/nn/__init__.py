"""``torch.nn`` modules over polykernel's ops: drop-in layers whose kernels the dispatcher picks.

Every module takes ``impl=`` (``None``: the dispatcher's choice for each call, i.e. scope, env,
``set_impl``, tuning, then rank) and passes it to the op on every call, so a module can be pinned
to one impl (strict: an impl that cannot run raises ``ImplNotAvailableError``)::

    >>> import torch, polykernel.nn as pnn
    >>> norm = pnn.RMSNorm(64)
    >>> norm(torch.randn(2, 5, 64)).shape
    torch.Size([2, 5, 64])
    >>> mlp = pnn.SwiGLU(64, 172, impl="torch")  # pinned to the torch impl
    >>> mlp(torch.randn(2, 5, 64)).shape
    torch.Size([2, 5, 64])

Parameter names follow PyTorch and Hugging Face (``weight``, ``bias``; ``gate_proj``, ``up_proj``,
``down_proj``), so state dicts load across.

The package, one module a family of layer: ``norms``, ``glu``, ``moe``, ``activations``,
``rope``, ``cross_entropy``, ``distillation``, ``preference`` (and ``_common``, the ``impl=``
check they share).
"""

from .activations import ReLUSquared, Softmax, Sparsemax
from .cross_entropy import CrossEntropyLoss, FusedLinearCrossEntropyLoss
from .distillation import FusedLinearJSDLoss, JSDLoss, KLDivLoss, TVDLoss
from .glu import GEGLU, SwiGLU
from .moe import MoEExperts
from .norms import DyT, GroupNorm, LayerNorm, PolyNorm, RMSNorm
from .preference import (
    FusedLinearCPOLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearKTOLoss,
    FusedLinearORPOLoss,
    FusedLinearSimPOLoss,
)
from .rope import RotaryEmbedding

__all__ = [
    "GEGLU",
    "CrossEntropyLoss",
    "DyT",
    "FusedLinearCPOLoss",
    "FusedLinearCrossEntropyLoss",
    "FusedLinearDPOLoss",
    "FusedLinearGRPOLoss",
    "FusedLinearJSDLoss",
    "FusedLinearKTOLoss",
    "FusedLinearORPOLoss",
    "FusedLinearSimPOLoss",
    "GroupNorm",
    "JSDLoss",
    "KLDivLoss",
    "LayerNorm",
    "MoEExperts",
    "PolyNorm",
    "RMSNorm",
    "ReLUSquared",
    "RotaryEmbedding",
    "Softmax",
    "Sparsemax",
    "SwiGLU",
    "TVDLoss",
]
