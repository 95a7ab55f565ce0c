"""Each impl's standing for an argument class: runnable, or why not (platform, dtype, backward,
determinism, CUDA graph capture, tensor subclasses, the spec's predicate, runtime faults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...spec import KernelSpec, PlatformInfo
from .. import registry
from .state import _broken
from .subclasses import INFERENCE

if TYPE_CHECKING:
    from ..protocols import OpLike


@dataclass
class Verdict:
    """One impl's standing for a key: runnable or not, and why."""

    name: str
    rank: int
    reason: str | None  # None: runnable
    rank_note: str | None = None  # why ``rank`` is not the spec's static rank (KernelSpec.rank_for)

    @property
    def runnable(self) -> bool:
        return self.reason is None


def _verdicts(op: OpLike, argkey: tuple[Any, ...], deterministic: bool, capturing: bool, subclass: str | None = None) -> list[Verdict]:
    """Every impl of ``op`` with why it can or cannot take this argument class, in rank order.
    ``subclass``: the type name of a tensor-subclass argument (None: plain tensors only)."""
    specs = registry.specs_for(op)
    info = op.arg_class(argkey)
    platform = PlatformInfo.detect(info.device)
    broken = _broken.get((op.id, argkey), {})
    rows = []
    for name, spec in specs.items():
        rank, note = spec.rank_here(info, capturing)  # on a memo miss only: the hot path never gets here
        rows.append(Verdict(name, rank, _why_not(spec, info, platform, deterministic, capturing, broken, subclass), note))
    rows.sort(key=lambda v: (v.rank, v.name))
    return rows


def _why_not(
    spec: KernelSpec, info: Any, platform: PlatformInfo, det: bool, capturing: bool, broken: dict, subclass: str | None = None
) -> str | None:
    if spec.impl in broken:
        return broken[spec.impl]
    reason = spec.unavailable_reason(platform)
    if reason:
        return reason
    if subclass == INFERENCE and spec.impl != "torch":
        return "an inference tensor that autograd must save: only the torch impl's autograd can"
    if subclass is not None and subclass != INFERENCE and not spec.accepts_subclasses:
        return f"input is a tensor subclass ({subclass}); this impl reads raw memory"
    if not spec.format_signature.supports_dtype(info.dtype):
        return f"dtype {str(info.dtype).removeprefix('torch.')} not supported"
    if info.needs_grad and not spec.format_signature.supports_backward:
        return "has no backward (inputs require grad)"
    if det and not spec.deterministic:
        return "not deterministic (torch.use_deterministic_algorithms is on)"
    if capturing and not spec.cuda_graph_safe:
        return "not CUDA-graph safe (a graph is being captured)"
    if spec.predicate is not None:
        try:
            reason = spec.predicate(info)
        except Exception as exc:  # a broken predicate excludes its impl, visibly
            reason = f"predicate raised {type(exc).__name__}: {exc}"
        if reason:
            return reason
    return None


def _load(op: OpLike, verdict: Verdict) -> Any:
    """Import the impl (lazily, on first selection); an import failure makes it not runnable."""
    spec = registry.specs_for(op)[verdict.name]
    try:
        return registry.load_impl(spec)
    except Exception as exc:  # any import failure: not runnable, with the reason in explain
        # A required module that fails to import (any exception) is named, and then known to
        # every op's verdicts (KernelSpec.unavailable_reason); else the adapter's own failure.
        verdict.reason = spec.import_error() or f"import failed: {type(exc).__name__}: {exc}"
        return None


def _probe_imports(op: OpLike, rows: list[Verdict]) -> list[Verdict]:
    """explain and available_impls: an impl runnable by its metadata whose required module fails
    to import is not runnable (imports the installed modules of those impls; a peer whose
    front package raises at import, e.g. RuntimeError, must not be listed as runnable)."""
    specs = registry.specs_for(op)
    for v in rows:
        spec = specs.get(v.name)
        if v.runnable and spec is not None and spec.requires_modules:
            v.reason = spec.import_error()
    return rows
