"""What the layers below :mod:`polykernel.core.op` read of an op and of a decision, as
:class:`typing.Protocol` s: they annotate with these, never with the classes of a layer above
(issue 36: no import circle, not even one of annotations only).

``OpLike`` is what the registry, the first-call checks, tuning and selection use of
:class:`polykernel.core.op.Op`; ``HotPathOp`` adds the internals that the generated hot path
(:mod:`polykernel.core.hot_path`) binds; ``DecisionLike`` is what the first-call checks
(:mod:`polykernel.core.first_call`, :mod:`polykernel.core.verify`) use of
:class:`polykernel.core.selection.Decision`. ``Op`` and ``Decision`` match them structurally
(neither names them). Annotations only: with ``from __future__ import annotations`` nothing
evaluates them, and this module imports nothing of polykernel at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from .errormodel import Bounds
    from .memo_key import MemoKey
    from .values import ArgClass, Case

__all__ = ["DecisionLike", "HotPathOp", "OpLike"]


class OpLike(Protocol):
    """An op as the layers below :mod:`polykernel.core.op` use it (``Op``'s docstring says
    what each member means); the modules that read each member in the comments."""

    id: str  # everywhere
    name: str  # core.explain_args, core.selection.resolution
    fields: tuple[str, ...]  # tuning.key
    key: Callable[..., tuple[Any, ...]]  # core.selection.explain, core.hot_path
    default_key: Callable[[torch.device, torch.dtype], tuple[Any, ...]]  # core.selection.explain
    reference: Callable[..., Any]  # core.verify, core.first_call, core.explain_args, tuning.measure, core.hot_path
    error_model: Callable[..., Bounds]  # core.verify, tuning.measure
    dtypes: tuple[torch.dtype, ...]  # core.explain_args
    cases: Callable[[torch.device, torch.dtype], list[Case]]  # core.explain_args
    validate: Callable[..., None] | None  # core.explain_args
    writes: tuple[str, ...]  # core.registry, core.verify
    _written: tuple[tuple[int, str], ...]  # (position, name) of each argument the op writes: core.explain_args, core.hot_path

    def arg_class(self, argkey: tuple[Any, ...]) -> ArgClass: ...  # core.selection.verdicts, .explain

    def inference_call(self, args: tuple[Any, ...]) -> bool: ...  # core.selection.explain

    def memoized(self, key: MemoKey) -> Any: ...  # core.selection.explain

    def remember(self, key: MemoKey, decision: Any) -> None: ...  # core.selection.resolution

    def forget(self, key: MemoKey) -> None: ...  # core.selection.resolution (the fault policy)

    def clear(self) -> None: ...  # core.selection.settings (clear_memos)


class HotPathOp(OpLike, Protocol):
    """An op as :mod:`polykernel.core.hot_path` generates its ``dispatch``: the guard spec, and the
    entries and state of ``Op``'s own slow path that the generated code binds or names."""

    guard: tuple[Any, ...] | None
    _memo: dict[tuple[Any, ...], Any]
    _fast: list[tuple[Any, ...]]

    def call(self, impl: str | None, argkey: tuple[Any, ...] | None, *args: Any) -> Any: ...

    def custom_op(self, impl: str | None, *args: Any) -> Any: ...

    def forward_ad(self, impl: str | None, args: tuple[Any, ...], argkey: Any = ...) -> Any: ...

    def _dispatch_slow(self, impl: str | None, args: tuple[Any, ...], scope: Any = None, det: Any = None, grad: Any = None) -> Any: ...

    def _dispatch_slow_star(self, impl: str | None, *args: Any) -> Any: ...

    def _captured(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> Any: ...

    def _subclass(self, key: tuple[Any, ...], args: tuple[Any, ...], decision: Any) -> Any: ...


class DecisionLike(Protocol):
    """A memoized decision as the first-call checks use it: whose it is, for which memo key
    (``key.argclass``), which impl, its callable (replaced once checked) and whether it ran."""

    op: OpLike
    key: tuple[Any, ...]
    impl: str
    fn: Any
    ran: bool
