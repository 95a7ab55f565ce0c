"""Backend facts, declared once, and the op files' impl rows built from them.

Each backend package declares what holds for all of its impls in one :class:`Backend`
(``polykernel/backends/<name>/__init__.py``): the modules it imports, where it runs, the dtypes
it takes, its default rank, whether it is deterministic and CUDA-graph safe. An op file then
lists its impls with only the op's own facts (rank, predicate, ``rank_for``, description, and
whatever differs from the backend's defaults), and :func:`impls` turns them into the
:class:`~polykernel.spec.KernelSpec` objects the registry holds::

    >>> from polykernel.spec import CapabilityRequirement
    >>> GPU = Backend("triton", modules=("triton",), capabilities=CapabilityRequirement.CUDA, rank=10)
    >>> (spec,) = impls("norm.rms_norm", GPU.impl(description="one row per program"))
    >>> spec.target, spec.requires_modules, spec.rank
    ('polykernel.backends.triton.rms_norm:rms_norm', ('triton',), 10)

Torch-free, like :mod:`polykernel.spec`: op files and backend packages import it on any machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..spec import CapabilityRequirement, FormatSignature, KernelBackend, KernelSpec, split_op_id

__all__ = ["FP8_CAPS", "KERNEL_DTYPES", "Backend", "Impl", "impls"]

# The dtypes our kernels and the peers' take (float64 goes to the torch impl).
KERNEL_DTYPES = ("float32", "bfloat16", "float16")
# fp8 e4m3 ("float8e4nv" in Triton) needs sm_89 (Ada) or newer on the GPU: the fp8 impls' floor.
FP8_CAPS = CapabilityRequirement.cuda(min_sm=89)


def _caps(caps: CapabilityRequirement | Iterable[CapabilityRequirement]) -> frozenset[CapabilityRequirement]:
    return frozenset((caps,) if isinstance(caps, CapabilityRequirement) else caps)


@dataclass(frozen=True)
class Backend:
    """What holds for every impl of one backend (one provenance, a :class:`KernelBackend` value).

    - ``modules``: Python modules its impls need (``KernelSpec.requires_modules``);
    - ``capabilities``: where it runs (OR over requirements; empty: anywhere);
    - ``dtypes``: the dtypes it takes (empty: any floating dtype);
    - ``rank``: its impls' default static rank (lower is preferred); an op's measured rank is
      given per op;
    - ``deterministic``, ``graph_safe``: its impls' execution properties by default;
    - ``package``: where its op modules live; an impl's target defaults to
      ``<package>.<op name>:<op name>``;
    - ``description``: what the backend is, in a line.
    """

    name: KernelBackend | str
    modules: tuple[str, ...] = ()
    capabilities: CapabilityRequirement | frozenset[CapabilityRequirement] = frozenset()
    dtypes: tuple[str, ...] = ()
    rank: int = 100
    deterministic: bool = True
    graph_safe: bool = True
    package: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        name = KernelBackend(self.name)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "capabilities", _caps(self.capabilities))
        object.__setattr__(self, "dtypes", FormatSignature(tuple(self.dtypes)).supported_dtypes)  # normalised names
        if not self.package:
            object.__setattr__(self, "package", f"polykernel.backends.{name.value}")

    def impl(
        self,
        *,
        rank: int | None = None,
        description: str = "",
        predicate: Callable[[Any], str | None] | None = None,
        rank_for: Callable[[Any], tuple[int, str] | None] | None = None,
        graph_rank_for: Callable[[Any], tuple[int, str] | None] | None = None,
        target: str | None = None,
        dtypes: tuple[str, ...] | None = None,
        supports_backward: bool = True,
        deterministic: bool | None = None,
        graph_safe: bool | None = None,
        accepts_subclasses: bool | None = None,
        capabilities: CapabilityRequirement | Iterable[CapabilityRequirement] | None = None,
    ) -> Impl:
        """One op's impl on this backend: the op's own facts, and what differs from the
        backend's (None: the backend's; ``capabilities`` narrows where it runs, e.g. an arch
        floor for one op's kernels). See :func:`impls`."""
        return Impl(
            self,
            rank=self.rank if rank is None else rank,
            description=description,
            predicate=predicate,
            rank_for=rank_for,
            graph_rank_for=graph_rank_for,
            target=target,
            dtypes=self.dtypes if dtypes is None else tuple(dtypes),
            supports_backward=supports_backward,
            deterministic=self.deterministic if deterministic is None else deterministic,
            graph_safe=self.graph_safe if graph_safe is None else graph_safe,
            accepts_subclasses=accepts_subclasses,
            capabilities=None if capabilities is None else _caps(capabilities),
        )


@dataclass(frozen=True)
class Impl:
    """An impl row of an op file, before it knows its op (:meth:`Backend.impl` builds it)."""

    backend: Backend
    rank: int
    description: str = ""
    predicate: Callable[[Any], str | None] | None = field(default=None, compare=False)
    rank_for: Callable[[Any], tuple[int, str] | None] | None = field(default=None, compare=False)
    graph_rank_for: Callable[[Any], tuple[int, str] | None] | None = field(default=None, compare=False)  # in CUDA graphs only
    target: str | None = None
    dtypes: tuple[str, ...] = ()
    supports_backward: bool = True
    deterministic: bool = True
    graph_safe: bool = True
    accepts_subclasses: bool | None = None
    capabilities: frozenset[CapabilityRequirement] | None = None  # None: the backend's

    def spec(self, op_id: str) -> KernelSpec:
        """The :class:`KernelSpec` of this impl for ``op_id``."""
        b = self.backend
        name = split_op_id(op_id)[1]
        return KernelSpec(
            op_id,
            b.name,
            self.target or f"{b.package}.{name}:{name}",
            capabilities=b.capabilities if self.capabilities is None else self.capabilities,  # type: ignore[arg-type]
            requires_modules=b.modules,
            format_signature=FormatSignature(self.dtypes, supports_backward=self.supports_backward),
            rank=self.rank,
            deterministic=self.deterministic,
            cuda_graph_safe=self.graph_safe,
            description=self.description,
            predicate=self.predicate,
            accepts_subclasses=self.accepts_subclasses,
            rank_for=self.rank_for,
            graph_rank_for=self.graph_rank_for,
        )


def impls(op_id: str, *rows: Impl) -> list[KernelSpec]:
    """The op's impl table: one :class:`KernelSpec` per row, in order (one row per backend)."""
    names = [row.backend.name for row in rows]
    twice = sorted({str(n) for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{op_id}: more than one impl of backend {', '.join(twice)} (an impl's name is its backend)")
    return [row.spec(op_id) for row in rows]
