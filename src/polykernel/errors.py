"""Exceptions polykernel raises. All name the op (and the argument or impl) they are about."""

from __future__ import annotations

from collections.abc import Sequence


class PolykernelError(Exception):
    """Base class of polykernel's own errors."""


class UnknownOpError(PolykernelError, KeyError):
    """An op id or bare name that polykernel does not know."""

    def __init__(self, op: str, known: Sequence[str]) -> None:
        self.op = op
        self.known = list(known)
        super().__init__(op)

    def __str__(self) -> str:
        bare = str(self.op).strip("'").rpartition(".")[2]  # an op id's family does not count
        return f"unknown op {self.op!r}{did_you_mean(bare, self.known)}; known ops: {', '.join(self.known)}"


class ImplNotAvailableError(PolykernelError, RuntimeError):
    """An impl that was asked for strictly is unknown for the op or cannot run here.

    ``reason`` says why (``'sm_90 < required sm_100'``, ``"module 'cutlass' not installed"``,
    ``'dtype float64 not supported'``, ``'needs a CUDA device'``); ``runnable`` lists the impls
    that would run for the same call.
    """

    def __init__(self, op: str, impl: str, reason: str, runnable: Sequence[str] = ()) -> None:
        self.op = op
        self.impl = impl
        self.reason = reason
        self.runnable = list(runnable)
        super().__init__(str(self))

    def __str__(self) -> str:
        would = ", ".join(self.runnable) if self.runnable else "none"
        return f"{self.op}: impl {self.impl!r} is not available: {self.reason} (would run here: {would})"


class OpArgumentError(PolykernelError, ValueError):
    """Bad input to an op, raised before any kernel launch. Names the op and the argument.

    ``OpArgumentError(op, arg, message)``; ``.op``, ``.arg`` and ``.message`` read them back.
    It has no ``__init__`` of its own, so that Dynamo can construct and catch one while tracing
    an op's validation under ``torch.compile(fullgraph=True)`` (see ``compile/library.py``).
    """

    @property
    def op(self) -> str:
        return self.args[0]

    @property
    def arg(self) -> str:
        return self.args[1]

    @property
    def message(self) -> str:
        return self.args[2] if len(self.args) > 2 else ""

    def __str__(self) -> str:
        if len(self.args) != 3:
            return super().__str__()
        return f"{self.args[0]}: argument {self.args[1]!r}: {self.args[2]}"


class OpTypeError(OpArgumentError, TypeError):
    """An argument of the wrong type or dtype (also a ``TypeError``)."""


def did_you_mean(name: str, valid: Sequence[str], longest: int = 200) -> str:
    """`` (did you mean 'rms_norm'?)`` for the valid name closest to a misspelt one, else ``""``
    (also for a name over ``longest`` characters: a pasted blob, not a typo)."""
    import difflib

    close = difflib.get_close_matches(name, list(valid), 1, 0.6) if len(name) <= longest else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a hostile or mistaken value may be huge).

    A tensor is described, never printed: its repr reads its values (a device sync), and under
    ``torch.compile`` there are none to read (Dynamo refused the repr, hiding the named error)."""
    if hasattr(value, "dtype") and hasattr(value, "shape") and type(value).__module__.partition(".")[0] == "torch":
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


class UnknownImplError(ImplNotAvailableError, ValueError):
    """A name that is not an impl of the op (a typo such as ``"tritonn"``, or an impl this op
    lacks), asked for strictly: ``impl=``, ``use_impl``/``set_impl`` with ``op=``,
    ``POLYKERNEL_IMPL_<OP>``. ``valid`` lists the op's impls. Also a ``ValueError``."""

    def __init__(self, op: str, impl: object, valid: Sequence[str], where: str = "", runnable: Sequence[str] | None = None) -> None:
        self.valid = list(valid)
        self.where = where
        self._runnable_known = runnable is not None
        name = str(impl) if len(str(impl)) <= 60 else f"{str(impl)[:57]}..."
        reason = (
            f"{where + ': ' if where else ''}no {shown(impl)} impl is registered for this op; its impls are: "
            f"{', '.join(self.valid) or 'none'}{did_you_mean(str(impl), self.valid)}"
        )
        super().__init__(op, name, reason, runnable or ())

    def __str__(self) -> str:
        if not getattr(self, "_runnable_known", True):
            return f"{self.op}: impl {self.impl!r} is not available: {self.reason}"
        return super().__str__()


class ImplVerificationError(PolykernelError, RuntimeError):
    """An impl's outputs or gradients on its first call for an argument class disagree with the
    op's torch impl (its reference, for an op without one) beyond the op's error model
    (``POLYKERNEL_VERIFY``, see :mod:`polykernel.core.verify`). ``what`` names the output or gradient; ``max_abs``,
    ``max_rel``, ``ratio`` (worst error over its tolerance), ``atol`` and ``rtol`` are the
    measured error and the tolerance, None where the mismatch is not numeric (shape, NaN)."""

    def __init__(
        self,
        op: str,
        impl: str,
        what: str,
        detail: str,
        *,
        max_abs: float | None = None,
        max_rel: float | None = None,
        ratio: float | None = None,
        atol: float | None = None,
        rtol: float | None = None,
        against: str = "the torch impl",
    ) -> None:
        self.op = op
        self.impl = impl
        self.what = what
        self.detail = detail
        self.max_abs, self.max_rel, self.ratio, self.atol, self.rtol = max_abs, max_rel, ratio, atol, rtol
        super().__init__(
            f"{op}: impl {impl!r} disagrees with {against} on {what}: {detail} (checked once per argument class: POLYKERNEL_VERIFY)"
        )


# The optional extras of pyproject.toml that an import of ours needs: extra -> (the module it
# provides, its requirement there). tests/test_packaging.py checks them against pyproject.toml.
EXTRAS: dict[str, tuple[str, str]] = {
    "transformers": ("transformers", "transformers>=4.45"),
    "trl": ("trl", "trl>=1.16,<1.17"),
    "plot": ("matplotlib", "matplotlib>=3.7"),
    "liger": ("liger_kernel", "liger-kernel>=0.8.5,<0.9"),
}


class MissingExtraError(PolykernelError, ModuleNotFoundError):
    """An optional package that a feature needs is not installed; the message is the command
    that installs it (polykernel is not on PyPI: ``polykernel[extra]`` cannot be installed)."""


def missing_extra(what: str, extra: str) -> MissingExtraError:
    """The error for ``what`` (a module or a command) when the package of ``extra`` is missing."""
    module, requirement = EXTRAS[extra]
    return MissingExtraError(
        f"{what}: {module} is not installed; install it with: pip install '{requirement}' "
        f"(or, in a clone of polykernel: pip install -e '.[{extra}]')",
        name=module,
    )
