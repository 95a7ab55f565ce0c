"""Side effects of a compiled call that must happen while Dynamo traces it: registering an op's
DTensor sharding rules, and reporting (once) an op that decomposes on DTensors."""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from .runtime import _current
from .store import NAMESPACE, _built


def _register_rules(op_id: str) -> None:
    """Register ``op_id``'s DTensor sharding rules (idempotent): a compiled call met a DTensor."""
    # polykernel.distributed.dtensor too: a DTensor is in use, so eager calls take its route, and the
    # traced mean_of_sum reads it (a first import is not possible while Dynamo traces).
    from ..distributed import dtensor  # noqa: F401
    from . import sharding as dtensor_sharding

    dtensor_sharding.register(_current(op_id), _built[op_id])


def _report_decomposing(op_id: str, why: str) -> None:
    """Compiled training on DTensors decomposes ``op_id``: logged once; ``POLYKERNEL_STRICT=1``
    makes it an error."""
    from ..core import selection as dispatch
    from ..errors import ImplNotAvailableError

    if dispatch.strict_mode():
        raise ImplNotAvailableError(op_id, "training custom ops on DTensors", f"{why} (POLYKERNEL_STRICT=1)")
    dispatch.log_once(("compile-dtensor", op_id, why), f"polykernel: {op_id}: compiled training on DTensors decomposes the op ({why})")


def _report_unforced(op_id: str) -> None:
    """A compiled call of ``op_id`` decomposes (its compile mode) while a choice names one of its
    impls: that impl does not run in the compiled code. Logged once; ``POLYKERNEL_STRICT=1`` makes it
    an error. Read while tracing: a choice made after the compile is not seen (docs/compile.md)."""
    from ..core import selection as dispatch
    from ..core.selection.state import fallback_once

    source = dispatch.forced_for(op_id)
    if source is None:
        return
    name = _current(op_id).name
    fallback_once(
        ("compile-decompose-forced", op_id, source),
        f"polykernel: {op_id}: {source} names an impl, but under torch.compile the op decomposes into torch ops for "
        f"Inductor (its compile_mode), so no impl runs; pass impl= or set POLYKERNEL_COMPILE_{name.upper()}=ours",
    )


# Side effects of a compiled call that must really happen while Dynamo traces CompiledOp.call
# (registering rules, logging: a logger call in traced code would break the graph, and
# fullgraph=True with it). They run through ``comptime``, whose function Dynamo runs; by name,
# with string arguments, so that the rule reads only constants.
_TRACE_TIME = {"register_rules": _register_rules, "report_decomposing": _report_decomposing, "report_unforced": _report_unforced}


# Notices only: without comptime they are not worth a node in every graph of a decomposed op
# (the no-op custom op stays in the compiled code), so they are left out there.
_NOTICE_ONLY = frozenset({"report_unforced"})


def _at_trace_time(action: str, *args: str) -> None:
    """``_TRACE_TIME[action](*args)``, now: also while Dynamo traces the caller."""
    if torch.compiler.is_compiling():
        comptime = _compat.comptime()
        if comptime is not None:
            comptime(_from_trace)
        elif action not in _NOTICE_ONLY:  # no comptime in this torch: the fake impl of a no-op custom op, run while tracing
            _trace_time_op(action, list(args))
    else:
        _TRACE_TIME[action](*args)


def _from_trace(ctx: Any) -> None:  # no free variables: comptime's rule
    _TRACE_TIME[ctx.get_local("action").as_python_constant()](*ctx.get_local("args").as_python_constant())


def _trace_time_real(action: str, args: list[str]) -> None:
    """The compiled graph's node does nothing when it runs: the action ran while tracing."""


_trace_time_op = torch.library.custom_op(
    f"{NAMESPACE}::trace_time_action", _trace_time_real, mutates_args=(), schema="(str action, str[] args) -> ()"
)
_trace_time_op.register_fake(lambda action, args: _TRACE_TIME[action](*args))
