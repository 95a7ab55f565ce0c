"""The :class:`Op` object: one op's identity, semantics hooks and its per-call hot path.

An op module (``polykernel/ops/<name>.py``) builds one ``Op`` and a public function that validates
its arguments, computes the op's *argument class* (the small tuple that decisions are memoized
on) and calls :meth:`Op.call`. Everything slow (resolution order, explain records, fallbacks)
lives in :mod:`polykernel.dispatch` and runs once per new key.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from . import dispatch as _dispatch
from . import registry
from .spec import KernelSpec


@dataclass(frozen=True)
class Tol:
    """``|out - ref| <= atol + rtol * |ref|`` elementwise (``torch.testing.assert_close``)."""

    atol: float
    rtol: float


# Unit roundoff u (half an ulp at 1) of each dtype: a correctly rounded result is within u·|exact|.
UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}
# Half the smallest subnormal: the absolute floor of one rounding to the dtype.
TINY: dict[torch.dtype, float] = {torch.float64: 2.0**-1075, torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}

# A sum of n terms rounded in any order (sequential, pairwise, blocked, tree, split across
# programs) is within about λ·√n·u of the exact sum, relative to the magnitude of what is summed,
# except with probability ≤ 2·exp(-λ²/2) per sum (Higham & Mary, "A new approach to probabilistic
# rounding error analysis", SISC 2019). λ = 6: ~3e-8 per sum. The worst case, n·u, would be
# 1.6% at n = 256K in fp32: too loose to catch a kernel that drops a block of a row.
SUM_LAMBDA = 6.0


@dataclass(frozen=True)
class ErrorModel:
    """How far one output (or gradient) may be from the exact result, in units of roundoff.

    For a tensor of dtype ``d`` computed in ``c`` = fp32 (fp64 for fp64 inputs), whose longest
    sum has ``n`` terms, against the exact (float64) result::

        |out - exact| <= rel·|exact| + abs·scale      (scale: max |exact| over the tensor,
        rel = rounds·u(d) + (ops + λ·√n·sum_rel)·u(c)  unless the op's model gives one)
        abs = rounds_abs·u(inter) + (cancel + λ·√n·sum_abs)·u(c)

    - ``rounds``: roundings to ``d`` on the way (1: the result; 2 when the semantics round an
      intermediate too, e.g. ``casting="llama"``);
    - ``ops``: roundings of the elementwise math in ``c`` (an approximate exp or rsqrt ~2 each);
    - ``sum_rel``: sums whose error stays relative to each element (sums of positive terms: the
      norms' mean of squares, softmax's sum of exps);
    - ``cancel``, ``sum_abs``: errors relative to the magnitude of what is combined rather than to
      each element, where terms cancel (dW = Σ dy·x̂ over rows, dx's mean(g·x̂), p - onehot);
    - ``rounds_abs``: roundings of an intermediate whose error reaches the result through such a
      combination (fused_add_rms_norm's rounded sum, the linear cross-entropy's logits), in
      units of ``u(inter)``: the intermediate's dtype, ``d`` unless given.

    Each rounding (``rounds``, ``rounds_abs``) is also off by up to half the smallest subnormal of
    its dtype in absolute terms (fp16 x̂ below 6e-5, say); ``floor`` adds what the op's model
    derives from that where such errors are summed (tiny fp16 logit gradients over many rows).
    """

    rounds: float = 1.0
    ops: float = 4.0
    sum_rel: float = 0.0
    cancel: float = 0.0
    sum_abs: float = 0.0
    rounds_abs: float = 0.0
    n: int = 1
    scale: float | None = None
    inter: torch.dtype | None = None
    floor: float = 0.0

    def tol(self, dtype: torch.dtype, scale: float, rounding: float = 1.0) -> Tol:
        """Tolerance for one tensor of ``dtype``; ``scale`` = max |exact| unless the model has
        its own. ``rounding`` = 2 where conversions to ``dtype`` truncate instead of rounding
        to nearest (Triton's CPU interpreter does this for bf16): one ulp instead of half."""
        u_d = UNIT_ROUNDOFF[dtype] * rounding
        u_i = UNIT_ROUNDOFF[self.inter or dtype] * rounding
        u_c = UNIT_ROUNDOFF[torch.promote_types(dtype, torch.float32)]
        growth = SUM_LAMBDA * max(self.n, 1) ** 0.5
        rel = self.rounds * u_d + (self.ops + growth * self.sum_rel) * u_c
        abs_ = self.rounds_abs * u_i + (self.cancel + growth * self.sum_abs) * u_c
        tiny = (max(self.rounds, 1.0) * TINY[dtype] + self.rounds_abs * TINY[self.inter or dtype]) * rounding
        return Tol(atol=abs_ * (scale if self.scale is None else self.scale) + tiny + self.floor, rtol=rel)


@dataclass(frozen=True)
class Bounds:
    """An op's error model for one call: one :class:`ErrorModel` per output (the last one
    repeats) and one per positional argument that takes a gradient."""

    outputs: tuple[ErrorModel, ...]
    grads: dict[int, ErrorModel] = field(default_factory=dict)

    def output(self, i: int) -> ErrorModel:
        return self.outputs[min(i, len(self.outputs) - 1)]


def rows_and_len(x: torch.Tensor) -> tuple[int, int]:
    """(rows, n) of a tensor reduced over its last dim."""
    n = x.shape[-1] if x.dim() else 1
    return (x.numel() // n if n else 0), n


@dataclass(frozen=True)
class Case:
    """One parity case: positional args, keyword args and a label for test ids."""

    label: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class ArgClass:
    """Named, read-only view of an argument-class tuple, handed to spec predicates."""

    __slots__ = ("_fields", "_values")

    def __init__(self, fields: Sequence[str], values: Sequence[Any]) -> None:
        self._fields = tuple(fields)
        self._values = tuple(values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[self._fields.index(name)]
        except ValueError:
            raise AttributeError(name) from None

    def as_dict(self) -> dict[str, Any]:
        return dict(zip(self._fields, self._values))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.as_dict().items())
        return f"ArgClass({inner})"


_deterministic = torch.are_deterministic_algorithms_enabled
_compiling = torch.compiler.is_compiling


_CPU = torch.device("cpu")


def _capturing(device: torch.device) -> bool:
    # `device != _CPU` first: ~20 ns, while `device.type` alone costs ~250 ns on the hot path.
    return device != _CPU and device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# -- the tensor-subclass guard ---------------------------------------------------------------
# An impl that reads raw memory (Triton, CuTe, peers) must never be handed a tensor subclass: a
# DTensor has no storage of its own, a wrapper subclass's memory is not what it stands for. The
# hot path asks, only when the memoized impl reads raw memory, whether every tensor argument is a
# plain torch.Tensor or nn.Parameter; the op's tensor positions come from its reference's
# signature, and the check is generated code (~25 ns per tensor; a loop or map costs ~3x more).

_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter, type(None)})


def _mentions_tensor(tp: Any) -> bool:
    if isinstance(tp, type) and issubclass(tp, torch.Tensor):
        return True
    return any(_mentions_tensor(a) for a in typing.get_args(tp))


def _tensor_positions(reference: Callable[..., Any]) -> tuple[int, ...]:
    """Positional parameters of ``reference`` that may hold a tensor (annotated so, or not
    annotated and without a non-None default)."""
    try:
        hints = typing.get_type_hints(reference)
    except Exception:  # unresolvable annotations: every parameter without a scalar default
        hints = {}
    out = []
    for i, p in enumerate(inspect.signature(reference).parameters.values()):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        tp = hints.get(p.name)
        if tp is not None:
            if _mentions_tensor(tp):
                out.append(i)
        elif p.default is p.empty or p.default is None:
            out.append(i)
    return tuple(out)


def plain_check(reference: Callable[..., Any]) -> Callable[[tuple[Any, ...]], bool]:
    """``check(args)``: True when the arguments at the reference's tensor positions are plain
    tensors (or None). False sends the call to the slow path, which looks at every argument
    (:func:`polykernel.dispatch.subclass_name`), so a false alarm only costs time."""
    positions = _tensor_positions(reference)
    if not positions:
        return lambda args: True
    body = " and ".join(f"type(a[{i}]) in P" for i in positions)
    namespace: dict[str, Any] = {"P": _PLAIN}
    exec(f"def check(a):\n    try:\n        return {body}\n    except IndexError:\n        return False\n", namespace)
    return namespace["check"]


class Op:
    """An op: id, argument-class fields, reference, error model, examples and parity cases.

    ``fields`` names the entries of the argument-class tuple; it always starts with
    ``"device"``, ``"dtype"``, ``"needs_grad"``. ``default_key(device, dtype)`` builds a tuple
    for ``explain``/``available_impls`` when no arguments are given (unknown sizes are None).

    ``validate`` (optional) lets the public function skip validation on the hot path: when the
    argument class holds everything validity depends on (dtypes, devices, the sizes that are
    checked, scalar options), the op validates once per new class, on the memo miss, and a
    public function may pass ``argkey=None`` when it could not even build the class (a non-tensor
    argument, say) so that ``validate`` raises the proper error.
    """

    def __init__(
        self,
        id: str,
        *,
        fields: Sequence[str],
        key: Callable[..., tuple[Any, ...]],
        default_key: Callable[[torch.device, torch.dtype], tuple[Any, ...]],
        reference: Callable[..., Any],
        error_model: Callable[..., Bounds],
        dtypes: Sequence[torch.dtype],
        cases: Callable[[torch.device, torch.dtype], list[Case]],
        example: Callable[..., Case],
        bytes_moved: Callable[..., int] | None = None,
        impls: Sequence[KernelSpec] = (),
        validate: Callable[..., None] | None = None,
    ) -> None:
        if tuple(fields[:3]) != ("device", "dtype", "needs_grad"):
            raise ValueError("Op fields must start with device, dtype, needs_grad")
        self.id = id
        self.name = id.rpartition(".")[2]
        self.fields = tuple(fields)
        self.key = key
        self.default_key = default_key
        self.reference = reference
        self.error_model = error_model
        self.dtypes = tuple(dtypes)
        self.cases = cases
        self.example = example
        self.bytes_moved = bytes_moved
        self.validate = validate
        self._memo: dict[tuple[Any, ...], Any] = {}
        self._plain = plain_check(reference)
        registry._add_op(self)
        for spec in impls:
            registry.register_impl(spec)

    def __repr__(self) -> str:
        return f"Op({self.id!r})"

    # -- hot path -------------------------------------------------------------------------
    # Kept to a few dict/attribute operations: the target is <= 1 us over calling the impl.
    def call(self, impl: str | None, argkey: tuple[Any, ...] | None, *args: Any) -> Any:
        """Run the impl chosen for ``argkey`` on ``args`` (positional, in the impl's order)."""
        if argkey is None:  # the public function could not build the class: validate says why
            self._reject(args)
        if _compiling():  # under torch.compile: the op's torch.library custom op (no graph break)
            return self.custom_op(impl, *args)
        # The body of `run`, inlined: one more Python frame costs ~170 ns here, a sixth of the
        # budget. Keep the two in step (tests/test_compile.py checks that both use one memo key).
        key = (argkey, impl, _scope.get(), _deterministic(), _capturing(argkey[0]))
        try:
            decision = self._memo.get(key) or self._miss(key, args)
        except TypeError as exc:  # an unhashable option (eps=[1e-6]): validate names it
            if isinstance(impl, list):  # impl=["triton", "torch"]: the same as a tuple
                return self.call(tuple(impl), argkey, *args)
            self._reject(args, exc)
        if decision.raw and not self._plain(args):  # the impl reads raw memory: no subclasses
            decision = self._subclass(key, args, decision)
        try:
            return decision.fn(*args)
        except Exception as exc:  # handed to the fault policy, which re-raises what is not its own
            return decision.on_fault(exc, args)

    def run(self, impl: str | None, argkey: tuple[Any, ...], *args: Any) -> Any:
        """The eager path of :meth:`call` without its compile check: the custom op's real impl
        runs this (a compile may be in progress around it, e.g. inductor constant folding)."""
        key = (argkey, impl, _scope.get(), _deterministic(), _capturing(argkey[0]))
        try:
            decision = self._memo.get(key) or self._miss(key, args)
        except TypeError as exc:  # an unhashable option (eps=[1e-6]): validate names it
            if isinstance(impl, list):  # impl=["triton", "torch"]: the same as a tuple
                return self.run(tuple(impl), argkey, *args)
            self._reject(args, exc)
        if decision.raw and not self._plain(args):  # the impl reads raw memory: no subclasses
            decision = self._subclass(key, args, decision)
        try:
            return decision.fn(*args)
        except Exception as exc:  # handed to the fault policy, which re-raises what is not its own
            return decision.on_fault(exc, args)

    def _miss(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> Any:
        """First call for a key: validate once per argument class, then resolve and memoize."""
        if self.validate is not None:
            self.validate(*args)
        subclass = _dispatch.subclass_name(args)
        if subclass is not None:  # decided under its own key; the plain key stays unset
            key = (*key, subclass)
            return self._memo.get(key) or _dispatch.decide(self, key, args)
        return _dispatch.decide(self, key, args)

    def _subclass(self, key: tuple[Any, ...], args: tuple[Any, ...], decision: Any) -> Any:
        """Slow path of the guard: the memoized impl reads raw memory and an argument may be a
        tensor subclass. Such calls are decided under the key plus the subclass's type name,
        where only impls with ``accepts_subclasses`` are eligible (or a strict choice raises)."""
        subclass = _dispatch.subclass_name(args)
        if subclass is None:  # a false alarm (e.g. a list argument): the plain decision stands
            return decision
        key = (*key, subclass)
        return self._memo.get(key) or _dispatch.decide(self, key, args)

    def _reject(self, args: tuple[Any, ...], exc: Exception | None = None) -> NoReturn:
        """Raise validation's error for ``args``; else ``exc``, the error that brought us here."""
        if self.validate is not None:
            self.validate(*args)
        if exc is not None:
            raise exc
        raise AssertionError(f"{self.id}: arguments rejected without a reason")

    def custom_op(self, impl: str | None, *args: Any) -> Any:
        """Call this op's ``torch.ops.polykernel.<name>`` custom op (built on first use)."""
        from . import library

        return library.custom_op_for(self)(impl, *args)

    def clear(self) -> None:
        self._memo.clear()

    def arg_class(self, argkey: tuple[Any, ...]) -> ArgClass:
        return ArgClass(self.fields, argkey)


_scope = _dispatch._scope
