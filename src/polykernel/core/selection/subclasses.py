"""Tensor-subclass arguments and inference tensors: calls decided under their own key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The pseudo subclass of a call whose autograd must save an inference tensor (made under
# torch.inference_mode, with another argument needing a gradient): torch's own ops can, an
# autograd.Function's save_for_backward cannot. Such calls are decided under their own key, where
# only the torch impl is eligible, so that a kernel's refusal never marks it broken for the class.
INFERENCE = "inference tensor"


def saves_inference_tensor(tensors: Sequence[Any]) -> bool:
    """Whether autograd must save one of ``tensors`` that is an inference tensor (grad mode on,
    one of them requires grad, one is an inference tensor). Off the hot path."""
    import torch

    present = [t for t in tensors if isinstance(t, torch.Tensor)]
    return torch.is_grad_enabled() and any(t.requires_grad for t in present) and any(t.is_inference() for t in present)


def subclass_name(args: Sequence[Any]) -> str | None:
    """The type name of the first tensor argument that is a tensor subclass, else None.

    ``torch.Tensor`` and ``torch.nn.Parameter`` are plain; anything else that is a tensor (a
    DTensor, a ``__torch_dispatch__`` wrapper, a ``__torch_function__`` subclass, and FakeTensor
    or FunctionalTensor when a tracer hands them to the eager path) is a subclass. Tensors in
    lists and tuples count too. Off the hot path: :meth:`Op.call` checks types cheaply first.
    """
    import torch

    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
                return type(a).__name__
        elif isinstance(a, (list, tuple)):
            inner = subclass_name(a)
            if inner is not None:
                return inner
    return None
