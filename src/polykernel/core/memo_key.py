"""The key a decision is memoized under: which call class, under which selection state.

>>> k = MemoKey(("cpu", "float32"), None, (), False, False)
>>> k.capturing, k._replace(capturing=True).capturing
(False, True)
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple


class MemoKey(NamedTuple):
    """``argclass``: the op's argument class (its ``fields``, starting device, dtype,
    needs_grad); ``impl``: the call's ``impl=``; ``scope``: the ``use_impl`` scopes in force;
    ``deterministic``: torch's deterministic-algorithms flag; ``capturing``: a CUDA graph is
    being captured; ``subclass``: the type name of a tensor-subclass argument, else None."""

    argclass: Any
    impl: Any
    scope: Any
    deterministic: bool
    capturing: bool
    subclass: str | None = None


# A MemoKey built without NamedTuple's Python-level __new__ (~4x faster): make(values), with all
# six values. The hot path builds one on a memo miss of its last hit.
make = functools.partial(tuple.__new__, MemoKey)


def key(argclass: Any, impl: Any, scope: Any, deterministic: bool, capturing: bool = False) -> MemoKey:
    return make((argclass, impl, scope, deterministic, capturing, None))
