"""Parameterless layers: Softmax, ReLUSquared, Sparsemax."""

from __future__ import annotations

import torch
from torch import nn

import polykernel

from ._common import _check_impl, _dim, _impl_repr


class _Parameterless(nn.Module):
    """A module with no parameters: only the op's ``impl=`` (ReLUSquared)."""

    def __init__(self, *, impl: str | None = None) -> None:
        super().__init__()
        self.impl = _check_impl(type(self).__name__, impl)

    def extra_repr(self) -> str:
        return _impl_repr(self.impl).removeprefix(", ")


class Softmax(nn.Module):
    """``torch.nn.Softmax(dim)`` (fp32 math, output in the input dtype); ``dim`` defaults to the
    last one (torch's ``dim=None``, a deprecated implicit choice, is refused: pass the dim).

    >>> import torch, polykernel.nn as pnn
    >>> pnn.Softmax()(torch.zeros(2, 4))
    tensor([[0.2500, 0.2500, 0.2500, 0.2500],
            [0.2500, 0.2500, 0.2500, 0.2500]])
    """

    def __init__(self, dim: int = -1, *, impl: str | None = None) -> None:
        super().__init__()
        if dim is None:  # torch picks 0 or 1 by x.dim() there (not the last dim for 3-d x)
            raise TypeError("Softmax: dim=None (torch's deprecated implicit dim) is not supported: pass the dim")
        self.dim = _dim(type(self).__name__, dim)
        self.impl = _check_impl(type(self).__name__, impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim in (-1, x.dim() - 1):
            return polykernel.softmax(x, impl=self.impl)
        # the op takes the last dim: move ours there and back (movedim checks the range)
        return polykernel.softmax(x.movedim(self.dim, -1), impl=self.impl).movedim(-1, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}" + _impl_repr(self.impl)


class ReLUSquared(_Parameterless):
    """``relu(x)²``, elementwise (fp32 math, output in the input dtype).

    >>> import torch, polykernel.nn as pnn
    >>> pnn.ReLUSquared()(torch.tensor([-1.0, 0.5, 2.0]))
    tensor([0.0000, 0.2500, 4.0000])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return polykernel.relu_squared(x, impl=self.impl)


class Sparsemax(nn.Module):
    """Sparsemax along ``dim``: a probability vector per row, with exact zeros (fp32 math).

    >>> import torch, polykernel.nn as pnn
    >>> pnn.Sparsemax()(torch.tensor([[1.0, 0.8, -1.0]]))
    tensor([[0.6000, 0.4000, 0.0000]])
    """

    def __init__(self, dim: int = -1, *, impl: str | None = None) -> None:
        super().__init__()
        self.dim = _dim(type(self).__name__, dim)
        self.impl = _check_impl(type(self).__name__, impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return polykernel.sparsemax(x, self.dim, impl=self.impl)

    def extra_repr(self) -> str:
        return f"dim={self.dim}" + _impl_repr(self.impl)
