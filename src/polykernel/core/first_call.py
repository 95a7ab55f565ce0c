"""Checks on the first call of each decision: the impl's outputs, and its backward's faults.

A decision's callable starts as :func:`checked`'s wrapper. Its first successful call compares
the outputs' shapes and dtypes with the op's reference evaluated on meta tensors (no data, no
kernel): an impl that returns the wrong shape raises :class:`ImplOutputError`, which the
dispatcher's fault policy treats like any runtime fault (fall back with one warning, or raise
under ``POLYKERNEL_STRICT=1`` and for a forced impl). It also tags the impl's autograd Function
so that an exception raised later in its backward carries a note naming the op and the impl.
Before the impl's first call, ``POLYKERNEL_VERIFY`` (default ``first`` on CUDA) compares it once
with the op's torch impl on copies of the inputs (:mod:`polykernel.core.verify`). Then the wrapper
puts the impl itself back on the decision: later calls cost nothing extra.

    >>> import polykernel, torch
    >>> y = polykernel.softmax(torch.randn(2, 8))   # first call: outputs checked once
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import PolykernelError
from . import verify

if TYPE_CHECKING:
    from .protocols import DecisionLike

__all__ = ["ImplOutputError", "checked"]

_lock = threading.Lock()


class ImplOutputError(PolykernelError, RuntimeError):
    """An impl returned outputs whose shapes or dtypes differ from the op's reference."""


def checked(decision: DecisionLike) -> Callable[..., Any]:
    """The callable for a new decision: the impl, behind a check of its first outputs (and,
    with ``POLYKERNEL_VERIFY``, a comparison with the torch impl: :mod:`polykernel.core.verify`)."""
    raw = decision.fn
    mode = verify.mode(decision)  # read once per decision; a bad value raises here, before any launch

    def first_call(*args: Any) -> Any:
        decision.ran = True  # (a DTensor route's record_route keeps the record of a decision that ran)
        if mode != "off":  # a mismatch raises ImplVerificationError: a fault, as below
            verify.verify(decision, raw, args)
        out = raw(*args)
        why = _mismatch(decision.op, args, out)
        if why is not None:  # handed to Decision.on_fault by the op's call path
            raise ImplOutputError(f"{decision.op.id}: impl {decision.impl!r} returned {why}")
        _tag_backward(out, f"impl {decision.impl!r} of {decision.op.id}")
        if mode != "always":
            decision.fn = raw  # checked: later calls go straight to the impl
        return out

    functools.update_wrapper(first_call, raw)  # attributes callers read off an impl stay visible
    return first_call


def _mismatch(op: Any, args: tuple[Any, ...], out: Any) -> str | None:
    """Why ``out`` cannot be the op's result for ``args`` (shapes, dtypes, count), else None."""
    import torch

    wants = _expected(op, args)
    if wants is None:
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if len(outs) != len(wants):
        return f"{len(outs)} outputs, the reference {len(wants)}"
    for i, (o, w) in enumerate(zip(outs, wants)):
        if w is None:
            continue
        if not isinstance(o, torch.Tensor):
            return f"{type(o).__name__} as output {i}, not a tensor"
        shape, dtype = w
        if tuple(o.shape) != shape or o.dtype != dtype:
            return (
                f"output {i} of shape {tuple(o.shape)} and dtype {str(o.dtype).removeprefix('torch.')}; "
                f"the reference's is {shape}, {str(dtype).removeprefix('torch.')}"
            )
    return None


def _expected(op: Any, args: tuple[Any, ...]) -> list[tuple[tuple[int, ...], Any] | None] | None:
    """Per output of the op on ``args``: ``(shape, dtype)``, or None for a non-tensor output.
    None when nothing can be said. The op's declared ``outputs`` when it has them (cheap); else
    its reference on meta tensors, which imports ``torch._dynamo`` (torch's Python meta kernels
    sit behind ``torch._disable_dynamo``), so built-in ops declare theirs."""
    import torch

    outputs = getattr(op, "outputs", None)
    try:
        if outputs is not None:
            return [None if w is None else (tuple(w[0]), w[1]) for w in outputs(*args)]  # None: not a tensor (rope's absent key)
        with torch.no_grad():
            meta = tuple(torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a for a in args)
            want = op.reference(*meta)
    except Exception:  # a reference that cannot run on meta tensors: nothing to compare with
        return None
    wants = want if isinstance(want, (tuple, list)) else (want,)
    return [(tuple(w.shape), w.dtype) if isinstance(w, torch.Tensor) else None for w in wants]


def _tag_backward(out: Any, label: str) -> None:
    """Make the impl's autograd Function name ``label`` in any exception its backward raises.

    A Function class shared by several ops or impls lists all of them. PyTorch's own autograd
    nodes (an impl built from torch ops) are left alone: their errors name the torch op."""
    for o in out if isinstance(out, (tuple, list)) else (out,):
        cls = getattr(getattr(o, "grad_fn", None), "_forward_cls", None)
        if cls is None:
            continue
        with _lock:
            labels = cls.__dict__.get("_polykernel_impls")
            if labels is None:
                labels = cls._polykernel_impls = []
                _wrap_backward(cls, labels)
            if label not in labels:
                labels.append(label)


def _wrap_backward(cls: type, labels: list[str]) -> None:
    original = cls.__dict__.get("backward")
    if original is None:
        return
    fn = original.__func__ if isinstance(original, staticmethod) else original

    def backward(ctx: Any, *grads: Any) -> Any:
        try:
            return fn(ctx, *grads)
        except Exception as exc:
            note = f"polykernel: raised in the backward of {' or '.join(labels)}"
            if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
                exc.add_note(note)
            raise

    backward.__wrapped__ = fn  # type: ignore[attr-defined]
    cls.backward = staticmethod(backward)  # type: ignore[method-assign]
