"""The ``torch.distributed`` internals polykernel reads: functional collectives' async tensor,
DTensor's per-op schema infos, and FSDP2's ``fully_shard`` where it was private."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from .probe import _FORCED_WHY, FORCED, _fell_back, _probe

if FORCED:
    _fell_back("is_async_collective", _FORCED_WHY)


def is_async_collective(t: Any) -> bool:
    """Whether ``t`` is functional collectives' ``AsyncCollectiveTensor`` (its storage is not its
    data until waited on). Looked up only if that module is loaded; fallback: by class name."""
    if not FORCED:
        fc = sys.modules.get("torch.distributed._functional_collectives")
        act = getattr(fc, "AsyncCollectiveTensor", None)
        if act is not None:
            return type(t) is act
    return type(t).__name__ == "AsyncCollectiveTensor" and callable(getattr(t, "wait", None))


@functools.cache
def dtensor_schema_infos() -> dict[Any, Any] | None:
    """DTensor's per-op schema infos (``RuntimeSchemaInfo``: which arguments its strategy cache
    keys on), which polykernel.compile.sharding widens to every argument. None: that cannot be
    done, and custom sharding rules are not registered (they could share a cached strategy
    between calls that differ in an option)."""

    def get() -> Any:
        from torch.distributed.tensor import DTensor

        infos = DTensor._op_dispatcher.sharding_propagator.op_to_schema_info
        return infos if isinstance(infos, dict) else None

    return _probe("dtensor_schema_infos", get, None)


def fully_shard() -> Callable[..., Any]:
    """FSDP2's ``fully_shard``: public since torch 2.6, before that a private module."""
    try:
        from torch.distributed.fsdp import fully_shard as fn
    except ImportError:
        if FORCED:
            raise
        from torch.distributed._composable.fsdp import fully_shard as fn
    return fn
