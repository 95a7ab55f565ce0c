"""Tensor parallelism: DTensor arguments run the selected impl on each rank's local shard
(:mod:`.dtensor`), imported only once a DTensor meets an op."""

from __future__ import annotations

from typing import Any


def route(op: Any, key: tuple[Any, ...]) -> Any:
    """The op's DTensor route for ``key`` (see :func:`.dtensor.route`)."""
    from . import dtensor

    return dtensor.route(op, key)


def explain_local(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``explain`` for DTensor arguments (see :func:`.dtensor.explain_local`)."""
    from . import dtensor

    return dtensor.explain_local(*args, **kwargs)
