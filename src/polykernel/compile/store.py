"""What the compile layer has built: each op's custom ops by op id, the ops that could not be
built (and why), the custom-op names taken, under one lock."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .compiled_op import CompiledOp

NAMESPACE = "polykernel"

_lock = threading.RLock()
_built: dict[str, CompiledOp] = {}  # op id -> its custom ops (filled once per op, never replaced)
_errors: dict[str, str] = {}  # op id -> why its custom op could not be built
_taken: dict[str, str] = {}  # custom-op name -> op id
_ATTR = "_polykernel_custom_op"  # set on each Op object: its CompiledOp.call
