"""A tuned decision's callable: the impl measured for the call's size bucket, chosen per call.

Decisions are memoized per argument class (dtypes, last dim, options: no row count), while the
store keys entries by bucketed sizes (:mod:`polykernel.tuning.key`). A tuned decision therefore
runs a :class:`BySize`: per call, the tensor arguments' element counts (one C call each; the class
fixes their last dims) find the slot in a dict; a count met for the first time is bucketed as the
store's key writes it (:func:`polykernel.tuning.key.tensor_class`), and a bucket met for the first
time asks :func:`polykernel.tuning.lookup` with the call's real arguments (which measures in mode
``on`` where measuring is allowed, reads the store otherwise). A bucket the store has nothing for
runs the class's static choice. Untuned decisions never get one: no per-call cost.

Two calls of one bucket share its slot even where the store would tell them apart: a strided and
a contiguous tensor of one size, and 1-d tensors (targets, positions), whose exact length the
store keys but whose length is bucketed here, so that a serving loop measures once per power of
two of tokens rather than once per prompt length (its first length's entry serves the bucket).
A decision that needs gradients also keys its buckets on which tensors require grad (the store's
``:grad``): a weight that starts training after a frozen phase is measured, and checked, anew.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..core.hit_guard import picker
from . import key as tuning_key

if TYPE_CHECKING:
    from ..core.protocols import OpLike

__all__ = ["BySize"]

# Past this many element counts per decision (a server meets every prompt length) the count ->
# slot dict starts again: a count met again then costs its bucket's text (~µs), never a lookup.
MAX_COUNTS = 4096


class Plain:
    """An impl that runs as it is (``fn``), under its name: what a slot holds when no first-call
    check is due (the decision's own choice, which the decision's checks cover)."""

    __slots__ = ("fn", "impl")

    def __init__(self, impl: str, fn: Any) -> None:
        self.impl, self.fn = impl, fn


class Slot:
    """One bucket's choice: ``run``, an object whose ``fn`` runs the impl (a shadow decision for
    it while its first-call checks are due, which then puts the impl itself there), and ``impl``;
    ``label``: the bucket as the store's key writes its tensors; ``tuned``: the store named it."""

    __slots__ = ("impl", "label", "run", "tuned")

    def __init__(self, run: Any, label: str, tuned: bool) -> None:
        self.run, self.impl, self.label, self.tuned = run, run.impl, label, tuned


class BySize:
    """Per size bucket, the impl that runs for a tuned decision (see the module docstring).

    ``load(name)``: the impl's callable when it is registered and runnable for the class (the
    selection layer's ``_load``), else None; ``static``: the class's static choice (name and
    callable), for buckets the store has nothing for; ``checked(name, fn)``: an object whose
    ``fn`` runs ``fn`` behind the first-call checks of a decision for ``name`` (an impl this
    decision has not run yet), then ``fn`` itself.
    """

    def __init__(
        self,
        op: OpLike,
        argkey: tuple[Any, ...],
        rows: Sequence[Any],
        capturing: bool,
        deterministic: bool,
        load: Callable[[str], Any],
        static: tuple[str, Any],
        checked: Callable[[str, Any], Any],
    ) -> None:
        self.op, self.argkey, self.rows = op, argkey, rows
        self.capturing, self.deterministic = capturing, deterministic
        self.grad = bool(argkey[2])  # needs_grad: which tensors require grad is part of a bucket
        self._load, self._checked = load, checked
        self.static = static
        self.slots: dict[tuple[str, ...], Slot] = {}  # bucket (as the store writes it) -> slot
        self.counts: dict[Any, Slot] = {}  # the tensors' element counts -> their bucket's slot
        self._runs: dict[str, Any] = {}  # impl name -> what runs it: checked once per decision
        self._sizes: Callable[[tuple[Any, ...]], tuple[int, ...]] | None = None
        self._lock = threading.Lock()

    # -- per call ---------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        try:
            slot = self.counts.get(self._sizes(args))  # type: ignore[misc]  # None at first: TypeError
        except Exception:  # the first call, or an argument that is not the tensor it was
            slot = None
        if slot is None:
            slot = self._met(args)
        return slot.run.fn(*args)

    def function(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        """:meth:`__call__` as a closure over the tensor positions of ``args`` (a call of this
        class has its tensors there) and the counts' lookup: no attribute reads per call."""
        self._sizes = _sizes_fn(args, self.grad)
        pick = picker([i for i, a in enumerate(args) if isinstance(a, torch.Tensor)])
        get, met, numel, grad = self.counts.get, self._met, torch.Tensor.numel, self.grad

        def choose(*a: Any) -> Any:
            try:  # _sizes_fn's key, inlined (a frame less); training adds which tensors require grad
                t = pick(a)
                slot = get((*map(numel, t), *[x.requires_grad for x in t]) if grad else tuple(map(numel, t)))
            except Exception:  # an argument that is not the tensor it was
                slot = None
            if slot is None:
                slot = met(a)
            return slot.run.fn(*a)

        choose.by_size = self  # type: ignore[attr-defined]
        return choose

    def slot(self, args: tuple[Any, ...]) -> Slot:
        """The slot a call with ``args`` runs, met now if it is new (a lookup). Off the hot path."""
        return self.slots.get(_bucket(args, self.grad)) or self._met(args)

    def slot_for(self, args: tuple[Any, ...]) -> Slot | None:
        """The slot a call with ``args`` runs (None before one met its bucket, or for arguments
        that have none). Off the hot path."""
        try:
            return self.slots.get(_bucket(args, self.grad))
        except Exception:
            return None

    def seed(self, args: tuple[Any, ...], impl: str, fn: Any) -> None:
        """The decision's own choice for its first call's bucket (already behind the decision's
        first-call checks): that bucket asks nothing more."""
        run = self._runs.setdefault(impl, Plain(impl, fn))
        self.slots[_bucket(args, self.grad)] = Slot(run, label(args, self.grad), True)

    # -- slow path: element counts, then a bucket, met for the first time -------------------

    def _met(self, args: tuple[Any, ...]) -> Slot:
        bucket = _bucket(args, self.grad)
        slot = self.slots.get(bucket)
        if slot is None:
            slot = self._new(bucket, args)
        if self._sizes is None:
            self._sizes = _sizes_fn(args, self.grad)
        try:
            counts = self._sizes(args)
        except Exception:  # not the tensors the first call had: the slow path each time
            return slot
        if len(self.counts) >= MAX_COUNTS:
            self.counts.clear()
        self.counts[counts] = slot
        return slot

    def _new(self, bucket: tuple[str, ...], args: tuple[Any, ...]) -> Slot:
        from . import lookup

        name = lookup(self.op, self.argkey, args, self.rows, self.capturing, True, self.deterministic)
        run = None if name is None else self._run(name)
        slot = Slot(run, label(args, self.grad), True) if run is not None else None
        if slot is None:  # nothing stored (or not runnable here): the class's static choice
            slot = Slot(self._run(*self.static), label(args, self.grad), False)
        with self._lock:  # a racing thread's slot for the same bucket is as good: keep the first
            slot = self.slots.setdefault(bucket, slot)
        return slot

    def _run(self, name: str, loaded: Any = None) -> Any:
        run = self._runs.get(name)
        if run is None:
            raw = loaded if loaded is not None else self._load(name)
            if raw is None:
                return None
            run = self._runs.setdefault(name, self._checked(name, raw))
        return run

    def label(self, args: tuple[Any, ...]) -> str:
        """The call's tensors as the store's key writes them (a fault's warning names the bucket)."""
        return label(args, self.grad)

    def record(self) -> dict[str, str]:
        """Bucket (the store key's tensors) -> impl, for ``decisions()``; a bucket the store had
        nothing for says ``(static)``."""
        return {s.label: s.impl if s.tuned else f"{s.impl} (static)" for s in list(self.slots.values())}


def label(args: tuple[Any, ...], grad: bool = False) -> str:
    """The call's tensors as the store's key writes them: ``"bfloat16[512x128], bfloat16[128]"``."""
    return ", ".join(tuning_key.tensor_class(a, grad) for a in args if isinstance(a, torch.Tensor))


def _bucket(args: tuple[Any, ...], grad: bool = False) -> tuple[str, ...]:
    """The call's size bucket: each tensor as :func:`polykernel.tuning.key.tensor_class` writes
    it, a 1-d tensor's length bucketed too (see the module docstring)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            text = tuning_key.tensor_class(a, grad)
            if a.dim() == 1:
                mark = ":grad" if grad and a.requires_grad else ""
                text = f"{str(a.dtype).removeprefix('torch.')}[~{tuning_key.bucket(int(a.shape[0]))}]{mark}"
            out.append(text)
    return tuple(out)


def _sizes_fn(args: tuple[Any, ...], grad: bool = False) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """``sizes(args)``: the element counts of the tensor arguments at the positions where this
    call has tensors (an argument there that is no tensor raises: the caller's miss); with
    ``grad``, then whether each requires grad (a frozen weight is another bucket)."""
    pick = picker([i for i, a in enumerate(args) if isinstance(a, torch.Tensor)])
    numel = torch.Tensor.numel
    if grad:

        def sizes_grad(a: tuple[Any, ...]) -> tuple[Any, ...]:
            tensors = pick(a)
            return (*map(numel, tensors), *[t.requires_grad for t in tensors])

        return sizes_grad

    def sizes(a: tuple[Any, ...]) -> tuple[int, ...]:
        return tuple(map(numel, pick(a)))

    return sizes
