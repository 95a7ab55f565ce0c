"""What the compile layer has built: each op's custom ops by op id, the ops that could not be
built (and why), the custom-op names taken, under one lock."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

NAMESPACE = "polykernel"


class BuiltOp(Protocol):
    """What is read of an op's :class:`~.compiled_op.CompiledOp` through ``_built``: by
    :mod:`.library`'s compiled call (``call``), and by :mod:`.sharding`'s rules (the custom ops,
    what the training pair saves), which :mod:`.compiled_op` imports and so cannot name it.
    Read-only members: ``CompiledOp``'s own may be narrower (a tuple, a list)."""

    @property
    def call(self) -> Callable[..., Any]: ...
    @property
    def forward(self) -> Any: ...
    @property
    def train(self) -> Any: ...
    @property
    def train_backward(self) -> Any: ...
    @property
    def saved_kinds(self) -> Sequence[str]: ...
    @property
    def returns(self) -> Sequence[str]: ...
    @property
    def tensor_args(self) -> Sequence[int]: ...


_lock = threading.RLock()
_built: dict[str, BuiltOp] = {}  # op id -> its custom ops (filled once per op, never replaced)
_errors: dict[str, str] = {}  # op id -> why its custom op could not be built
_taken: dict[str, str] = {}  # custom-op name -> op id
_ATTR = "_polykernel_custom_op"  # set on each Op object: its CompiledOp.call
