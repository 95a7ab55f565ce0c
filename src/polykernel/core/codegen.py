"""Generated hot-path code that a traceback and a debugger can show.

Two functions per call are generated, because plain source costs measurably more there
(``benchmarks/results/cpu-2026-12-03-plain-dispatch/``): each op's ``Op.dispatch``
(``core.hot_path``: a fixed arity, each option compared inline) and the Triton fast launch's
argument key (``backends.triton._launch``). Everything else on the per-call path is plain source.
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
