"""Kernel metadata: what an impl is, where it can run, how to load it.

This module is importable without torch (``import polykernel.spec`` works on a machine with no
torch at all), so registries, CLIs and docs tools can read impl metadata cheaply. The platform
types (:class:`PlatformInfo`, :class:`CapabilityRequirement`) live in :mod:`polykernel.platforms`
and are re-exported here; only :meth:`PlatformInfo.detect` touches torch, lazily, and it never
raises.

Example::

    >>> from polykernel.spec import CapabilityRequirement, PlatformInfo
    >>> hopper = PlatformInfo("cuda", 0, (9, 0), "NVIDIA H200")
    >>> CapabilityRequirement.cuda(min_sm=90).is_satisfied_by(hopper)
    True
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from . import env
from .platforms import (
    CapabilityRequirement,
    DeviceType,
    PlatformInfo,
    _as_caps,
    capabilities_satisfied,
    capabilities_unmet_reason,
)

__all__ = [
    "CapabilityRequirement",
    "DeviceType",
    "FormatSignature",
    "KernelBackend",
    "KernelSpec",
    "PlatformInfo",
    "Split",
    "capabilities_satisfied",
    "split_op_id",
]


class KernelBackend(str, Enum):
    """Provenance of an impl: how it is built. Never the device it runs on."""

    TORCH = "torch"
    TORCH_COMPILE = "torch_compile"
    TRITON = "triton"
    CUTE_DSL = "cute_dsl"
    CUTILE = "cutile"
    CUDA_JIT = "cuda_jit"
    LIGER = "liger"
    QUACK = "quack"
    FLASHINFER = "flashinfer"
    SGL_KERNEL = "sgl_kernel"

    def __str__(self) -> str:  # "triton", not "KernelBackend.TRITON", in messages
        return self.value


@dataclass(frozen=True)
class FormatSignature:
    """Data formats an impl accepts. Empty ``supported_dtypes`` means any floating dtype.

    Dtypes are named as strings (``"bfloat16"``), so this stays torch-free; ``torch.bfloat16``
    objects are accepted too and normalised.
    """

    supported_dtypes: tuple[str, ...] = ()
    in_place: bool = False
    supports_backward: bool = True
    description: str = ""

    def __post_init__(self) -> None:
        names = tuple(_dtype_name(d) for d in self.supported_dtypes)
        object.__setattr__(self, "supported_dtypes", names)

    def supports_dtype(self, dtype: Any) -> bool:
        return not self.supported_dtypes or _dtype_name(dtype) in self.supported_dtypes


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Split:
    """An impl's forward and backward as two functions, so that a compiled graph runs each once.

    Attach it to the registered impl callable as its ``split`` attribute (one impl name per op;
    the dispatcher picks the impl, and with it the pair). Under ``torch.compile`` the op's
    training custom op calls ``forward``, keeps what it returns as ``saved`` and hands it to
    ``backward`` (see :mod:`polykernel.compile.library`); eager calls keep using the impl itself.

    - ``forward(*args, grad_mask) -> (outputs, saved)``: ``args`` are the impl's positional
      arguments, ``grad_mask`` one bool per argument (which ones need a gradient); ``outputs``
      is a tuple in the op's return order, ``saved`` a tuple of fresh tensors for the backward.
    - ``backward(grad_outputs, saved, *args, grad_mask) -> grads``: one gradient (or None) per
      argument; ``grad_outputs`` has a tensor for every output (zeros where unused).
    - ``layout(*args, grad_mask) -> saved``: optional; tensors shaped like ``saved`` (for fake
      tensors at trace time). Without it, ``forward`` itself runs on the fake tensors.

    ``saved`` must have one layout per op whichever impl produced it (the torch impl's split
    defines it; an op without a torch split saves nothing), because the backward may select
    another impl than the forward did (a scope that ended in between, say).

    >>> Split(forward=lambda *a: ((), ()), backward=lambda g, s, *a: []).layout is None
    True
    """

    forward: Callable[..., Any]
    backward: Callable[..., Any]
    layout: Callable[..., Any] | None = None


_TARGET = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def split_op_id(op: str) -> tuple[str, str]:
    """``"norm.rms_norm"`` -> ``("norm", "rms_norm")``; a bare name has group ``""``."""
    group, _, name = op.rpartition(".")
    return group, name


@dataclass(frozen=True)
class KernelSpec:
    """One impl of one op. ``target`` is ``"module:attr"`` (attr may be dotted), loaded lazily.

    ``predicate`` (optional, beyond the frozen contract fields) is a per-call check on the
    argument class that the op computes for each call (dtype, sizes, ...): it returns None
    when the impl can take those arguments, else a short reason. It must depend only on that
    class, since decisions are memoized per class.

    ``rank_for`` (optional) is a measured, per-call rank: called with the same argument class
    as ``predicate``, it returns ``(rank, reason)`` to replace the static ``rank`` for these
    arguments, or None to keep it. ``reason`` is the measurement behind the rule (shown by
    ``explain``), e.g. ``"forward, N >= 32768: 3.64-3.75 vs triton 2.50-2.84 TB/s (H200 bf16)"``.
    It orders auto selection (step 6) only: explicit choices and tuned (measured) decisions
    still come first. Like ``predicate`` it must depend only on the class (decisions are
    memoized per class, so it costs nothing on a memo hit); fields may be None when ``explain``
    or ``available_impls`` is asked without arguments (then return None). One that raises keeps
    the static rank, and ``explain`` says so.

    >>> fwd_long = lambda c: (5, "measured 1.3x over triton") if not c.needs_grad and (c.n or 0) >= 32768 else None
    >>> KernelSpec("norm.rms_norm", "quack", "quack:rmsnorm", rank=50, rank_for=fwd_long).rank
    50

    ``graph_rank_for`` (optional) is the same kind of rule for calls made while a CUDA graph is
    captured, asked before ``rank_for`` there and never otherwise: a rank that rests on GPU time
    alone (a replay pays no launch cost, an eager call pays it every time).

    ``accepts_subclasses`` says whether the impl may be handed a tensor subclass (a DTensor, a
    ``__torch_dispatch__`` wrapper, a ``__torch_function__`` subclass; ``torch.nn.Parameter`` is
    not one). Impls that read raw memory (Triton, CuTe, peers' kernels) must not: a DTensor has
    no storage of its own and a wrapper's memory is not what it stands for. Left as None it is
    True for the ``torch`` backend, which goes through torch's own dispatch, and False otherwise.

    The loaded callable may carry a :class:`Split` as its ``split`` attribute: its forward and
    backward as separate functions, which compiled graphs use so the backward does not recompute
    the forward (:mod:`polykernel.compile.library`). Impls without one are recomputed there.

    >>> spec = KernelSpec("norm.rms_norm", "triton", "polykernel.backends.triton.rms_norm:rms_norm")
    >>> spec.group, spec.name, spec.impl
    ('norm', 'rms_norm', 'triton')
    >>> spec.accepts_subclasses
    False
    """

    op: str
    backend: KernelBackend | str
    target: str
    capabilities: frozenset[CapabilityRequirement] = frozenset()
    requires_modules: tuple[str, ...] = ()
    format_signature: FormatSignature = FormatSignature()
    rank: int = 100
    deterministic: bool = True
    cuda_graph_safe: bool = True
    description: str = ""
    predicate: Callable[[Any], str | None] | None = field(default=None, compare=False)
    accepts_subclasses: bool | None = None
    rank_for: Callable[[Any], tuple[int, str] | None] | None = field(default=None, compare=False)
    graph_rank_for: Callable[[Any], tuple[int, str] | None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", KernelBackend(self.backend))
        object.__setattr__(self, "capabilities", frozenset(_as_caps(self.capabilities)))
        object.__setattr__(self, "requires_modules", tuple(self.requires_modules))
        if self.accepts_subclasses is None:
            object.__setattr__(self, "accepts_subclasses", self.backend is KernelBackend.TORCH)

    def rank_here(self, arg_class: Any, capturing: bool = False) -> tuple[int, str | None]:
        """The rank for one argument class (in a CUDA graph being captured, or not), and why
        when a rule moved it (else None).

        >>> KernelSpec("norm.rms_norm", "triton", "m:f", rank=10).rank_here(None)
        (10, None)
        """
        for name in ("graph_rank_for", "rank_for") if capturing else ("rank_for",):
            rule = getattr(self, name)
            if rule is None:
                continue
            try:
                got = rule(arg_class)
            except Exception as exc:  # a broken rule must not break selection: static rank, visibly
                return self.rank, f"{name} raised {type(exc).__name__}: {exc}; static rank kept"
            if got is not None:
                rank, reason = got
                return int(rank), str(reason) + (" (in CUDA graphs)" if name == "graph_rank_for" else "")
        return self.rank, None

    @property
    def group(self) -> str:
        """The op id's group: ``"norm.rms_norm"`` -> ``"norm"`` (``""`` for a bare name)."""
        return split_op_id(self.op)[0]

    @property
    def name(self) -> str:
        """The op id's bare name: ``"norm.rms_norm"`` -> ``"rms_norm"`` (as sglang's spec splits it)."""
        return split_op_id(self.op)[1]

    @property
    def impl(self) -> str:
        """The impl's name: its backend value (``"triton"``), unique per op."""
        return self.backend.value  # type: ignore[union-attr]

    def load(self) -> Callable[..., Any]:
        """Import the target module and return the callable (``ValueError`` if malformed)."""
        if not isinstance(self.target, str) or not _TARGET.match(self.target):
            raise ValueError(f"KernelSpec target {self.target!r} is not of the form 'module:attr'")
        module_name, _, attr = self.target.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj

    def missing_modules(self) -> list[str]:
        """Required modules that cannot be found (metadata only: nothing is imported)."""
        return [m for m in self.requires_modules if not _module_findable(m)]

    def is_available(self, platform: PlatformInfo) -> bool:
        """Metadata-only check: capabilities and required modules (no import, no predicate)."""
        return self.unavailable_reason(platform) is None

    def unavailable_reason(self, platform: PlatformInfo) -> str | None:
        reason = capabilities_unmet_reason(self.capabilities, platform)
        if reason is not None and not (self.backend is KernelBackend.TRITON and triton_interpret_allows(platform)):
            return reason
        missing = self.missing_modules()
        if missing:
            return f"module {missing[0]!r} not installed"
        return self.failed_import()

    def failed_import(self) -> str | None:
        """A required module known (from an earlier import: none here) to fail to import, and why."""
        broken = next((m for m in self.requires_modules if m in _import_failures), None)
        return None if broken is None else f"module {broken!r} failed to import: {_import_failures[broken]}"

    def import_error(self) -> str | None:
        """Why a required module, installed, fails to import (imports each one: once per process;
        not torch's own submodules, such as torch._inductor: part of torch, and slow to import)."""
        for m in self.requires_modules:
            if m.split(".")[0] == "torch":
                continue
            err = module_import_error(m)
            if err is not None:
                return f"module {m!r} failed to import: {err}"
        return None


def triton_interpret_allows(platform: PlatformInfo) -> bool:
    """With ``TRITON_INTERPRET=1`` Triton kernels run on CPU tensors through the interpreter (only
    the values Triton itself reads as true: :func:`polykernel.env.triton_interpret`)."""
    return str(platform.device) == "cpu" and env.triton_interpret()


_findable: dict[str, bool] = {}
# Installed modules whose import raised: name -> "RuntimeError: No CTK flavor installed". A peer's
# front package can be found yet fail to import (FlashInfer's CuTe DSL packages without their native
# library): any exception counts, not only ImportError. Kept for the process: it will not import later.
_import_failures: dict[str, str] = {}


def module_import_error(name: str) -> str | None:
    """Import ``name`` if it is installed and not yet imported; its error (``"Type: message"``) or None."""
    if name in _import_failures:
        return _import_failures[name]
    if sys.modules.get(name) is not None or not _module_findable(name):
        return None  # imported already, or missing (that reason is unavailable_reason's)
    try:
        importlib.import_module(name)
    except Exception as exc:
        first = str(exc).strip().splitlines()
        _import_failures[name] = f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__
    return _import_failures.get(name)


def _module_findable(name: str) -> bool:
    hit = _findable.get(name)
    if hit is None:
        try:
            import importlib.util

            hit = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a missing parent package raises here
            hit = False
        _findable[name] = hit
    return hit
