"""The hot path's repeat test: one C call that says whether a call's tensors carry the metadata of
the call that last decided, so that its argument class (and with it the memoized decision) is the
same without building the class.

Building an argument class in Python reads ~10 tensor attributes (``x.device``, ``x.dtype``,
``x.shape``, ``requires_grad`` ...; ~45 ns each, ``device`` and ``shape`` also allocate) and then
compares the tuple with the last one: ~0.55 µs of a ~1 µs dispatch. PyTorch's ``TensorGuards``,
the C++ check behind torch.compile's tensor guards (``torch._C._dynamo.guards``; it needs no
``torch._dynamo`` import), compares each tensor's exact Python type, dispatch keys (device type,
layout, the inference-mode and other thread-local key state), dtype, device index,
``requires_grad``, number of dims and the sizes we pin with what it recorded: ~65 ns per tensor
(it refuses a tensor passed twice: such calls take the slow path). It is a private API: where it
is missing or refuses, :func:`build` returns None and the call builds its argument class in
Python, as correct as before and ~0.1 µs slower than before (the slow path's extra frames).

An op says per positional argument what its class holds (``Op(guard=...)``):

- :data:`LAST`: a tensor; its dtype, device, requires_grad and last dim;
- :data:`SHAPE`: a tensor; its dtype, device, requires_grad and whole shape;
- ``i`` (an int): a tensor whose shape must equal argument ``i``'s (the class holds that it
  does, e.g. ``up_matches``); its dtype, device and requires_grad. The hot path compares the two
  shapes on every call (the guard leaves them free, so a new sequence length still hits);
- :func:`dims` ``(d, ...)`` (a tuple, maybe empty): a tensor; its dtype, device, requires_grad and
  the sizes of dims ``d, ...``; the other sizes stay free. For shapes related across arguments (rope's q and k
  share B, T and D, their head counts are free): the class holds that the relations hold (one
  flag), and the guard pins every size a relation reads, so a repeat hits with no shape compared
  in Python; a new size (another T) takes the slow path once, which builds the class (a memo hit)
  and a guard for it;
- ``None``: not a tensor: an option the class holds as is (the hot path compares it with ==).

The guard pins more than the class (the exact type, the number of dims): a call it refuses only
takes the slow path, which decides exactly as before. It must never accept a call whose class
differs: ``tests/core/test_dispatch.py`` checks each field of each op.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _compat

LAST = "last"
SHAPE = "shape"

GuardSpec = Sequence["str | int | tuple[int, ...] | None"]


def dims(*pinned: int) -> tuple[int, ...]:
    """The guard kind of a tensor whose sizes at dims ``pinned`` (non-negative) the class depends
    on; its other sizes stay free (``dims(0, 2, 3)``: rope's q, whose head count may change;
    ``dims()``: an elementwise op's input, whose sizes the class does not hold)."""
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in pinned):
        raise ValueError(f"dims: expected non-negative dims, got {pinned}")
    return tuple(pinned)


# Only plain tensors are guarded: a subclass (DTensor, a wrapper) takes the slow path, where its
# own key and routing live (Op._subclass); TensorGuards would also read a wrapper's outer metadata.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


# TensorGuards, once it has passed a probe of the way we call it; else None (polykernel._compat).
_tensor_guards = _compat.tensor_guards


def available() -> bool:
    """Whether this torch has the guard (else ops build every call's class in Python)."""
    return _tensor_guards() is not None


def tensor_positions(spec: GuardSpec) -> tuple[int, ...]:
    """The positions the guard checks (every argument that is not an option), in order."""
    return tuple(i for i, kind in enumerate(spec) if kind is not None)


def relations(spec: GuardSpec) -> tuple[tuple[int, int], ...]:
    """(i, j): argument i's shape must equal argument j's."""
    return tuple((i, kind) for i, kind in enumerate(spec) if isinstance(kind, int) and not isinstance(kind, bool))


def build(spec: GuardSpec, args: Sequence[Any]) -> Callable[..., bool] | None:
    """``check(*tensors)`` for the spec's tensor positions: True when each has the metadata its
    counterpart in ``args`` has (an argument that is None in ``args`` must be None again).
    None when no guard can be built (a subclass, a non-tensor, no TensorGuards here)."""
    guards = _tensor_guards()
    if guards is None:
        return None
    tensors = [a for a in (args[i] for i in tensor_positions(spec)) if a is not None]
    if len({id(t) for t in tensors}) != len(tensors):  # one tensor twice (swiglu(x, x)): TensorGuards
        return None  # refuses aliased arguments, so such a guard would never pass
    present, sizes, missing = [], [], []
    try:
        for slot, i in enumerate(tensor_positions(spec)):
            kind, t = spec[i], args[i]
            if t is None:
                missing.append(slot)
                continue
            if type(t) not in _PLAIN:
                return None
            ndim = t.dim()
            if kind == LAST:
                sizes.append([None] * (ndim - 1) + [t.shape[-1]] if ndim else [])
            elif kind == SHAPE:
                sizes.append(list(t.shape))
            elif isinstance(kind, tuple):  # dims(...): those sizes pinned, the others free
                sizes.append([t.shape[d] if d in kind else None for d in range(ndim)])
            else:  # a shape relation: the sizes stay free, the hot path compares the two shapes
                if t.shape != args[kind].shape:
                    return None
                sizes.append([None] * ndim)
            present.append(t)
        check = guards(*present, dynamic_dims_sizes=sizes, dynamic_dims_strides=[[None] * t.dim() for t in present]).check
    except Exception:  # a refusal of this private API (its signature moved): no guard, no harm
        return None
    if missing:
        return _with_nones(check, len(tensor_positions(spec)), tuple(missing))
    return check


def picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``pick(args)``: the tuple of ``args`` at ``positions`` (itemgetter: no Python frame)."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    if positions:
        (i,) = positions
        return lambda args: (args[i],)
    return lambda args: ()


def _with_nones(guard: Callable[..., bool], n: int, missing: tuple[int, ...]) -> Callable[..., bool]:
    """A guard for a call that had None at some tensor positions (a LayerNorm without bias, a
    cross-entropy without class weights): those must be None again, the others go to ``guard``."""
    present = picker(tuple(i for i in range(n) if i not in missing))
    absent, nones = picker(missing), (None,) * len(missing)

    def check(*tensors: Any) -> bool:
        return absent(tensors) == nones and guard(*present(tensors))

    return check
