"""Generated hot-path code that a traceback and a debugger can show.

The dispatcher's per-call paths (``core.op``), the subclass check, the guard wrapper
(``core.hit_guard``) and Triton's launch key (``backends.triton._launch``) are Python generated
per op, so that a fixed arity and inlined checks cost no ``*args`` tuple, bound method or loop.
:func:`define` compiles such source under a readable file name and registers it with
:mod:`linecache`, so tracebacks print its lines and ``pdb`` steps through it like any module.

    >>> f = define("def twice(x):\\n    return 2 * x\\n", "<polykernel example>", "twice", {})
    >>> f(3)
    6
"""

from __future__ import annotations

import linecache
from collections.abc import Callable
from typing import Any

__all__ = ["define"]


def define(src: str, filename: str, name: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    """Compile ``src`` as ``filename``, run it in ``namespace`` and return its ``name``.
    Another source under a name already taken gets the name with a number: each name shows one
    source."""
    lines = src.splitlines(keepends=True)
    base, n = filename, 1
    while (entry := linecache.cache.get(filename)) is not None and entry[2] != lines:
        n += 1
        filename = f"{base[:-1]} #{n}>" if base.endswith(">") else f"{base} #{n}"
    # (size, mtime None: linecache.checkcache keeps entries without a file on disk, lines, name)
    linecache.cache[filename] = (len(src), None, lines, filename)
    exec(compile(src, filename, "exec"), namespace)
    return namespace[name]
