"""The machinery that makes an op's writes into its arguments (``Op.writes``: the serving ops'
destinations) one of torch's in-place ops to autograd, whatever the impl: a kernel writing through
a raw pointer is invisible to it. :meth:`polykernel.core.op.Op.run` asks :func:`writable` before
the call and calls :func:`mark_written` after it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import OpArgumentError

_grad_enabled = torch.is_grad_enabled
_inference_mode = torch.is_inference_mode_enabled
_increment_version = torch.autograd.graph.increment_version


def mark_written(tensors: Sequence[torch.Tensor | None]) -> None:
    """Bump the version counter of each tensor an op wrote, as torch's in-place ops do, so that a
    backward which saved one of them before the write raises instead of using the new values. A
    torch impl's own in-place ops have bumped them already: a second bump is harmless (autograd
    compares versions for equality). Inference tensors have no counter; an optional destination
    left out (rotary_embedding_'s key) is None."""
    for t in tensors:
        if t is not None and not t.is_inference():
            _increment_version(t)


def writable(op_id: str, written: Sequence[tuple[int, str]], args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors a call writes (``written``: the (position, name) of each destination), after
    refusing, before anything is written, what torch's in-place ops refuse: an inference tensor
    outside inference mode (it has no version counter to bump), and a tensor that requires grad
    while grad mode is on (an in-place write of a leaf is an error in torch; the serving ops have
    no autograd to record one of a non-leaf)."""
    out = []
    for i, name in written:
        t = args[i] if i < len(args) else None
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_inference() and not _inference_mode():
            raise OpArgumentError(
                op_id,
                name,
                "is an inference tensor (made under torch.inference_mode()) and is written in place: "
                "Inplace update to inference tensor outside InferenceMode is not allowed "
                "(as in torch); call the op under torch.inference_mode(), or pass a clone() made outside it",
            )
        if t.requires_grad and _grad_enabled():
            leaf = "a leaf Variable that requires grad" if t.is_leaf else "a tensor that requires grad"
            raise OpArgumentError(
                op_id,
                name,
                f"is {leaf} and is written in place, which autograd cannot record here "
                "(call the op under torch.no_grad() or torch.inference_mode())",
            )
        out.append(t)
    return tuple(out)
