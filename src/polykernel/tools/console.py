"""Terminal output for the command line: rich tables and progress bars on a terminal, plain text
otherwise (a pipe, a file, CI logs), from the same code.

    >>> from polykernel.tools.console import make_console, table
    >>> con = make_console()
    >>> t = table(con, "op", "impl", title="what ran")
    >>> t.add_row("norm.rms_norm", "triton")
    >>> con.print(t)                                    # doctest: +SKIP

Plain output means: no colours or cursor movement, no box-drawing characters, no line wrapping
(so that grep and diff work on it), and no progress bars (a finished task prints one line
instead). ``--json`` output never goes through here.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import IO, Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

__all__ = ["fits", "make_console", "progress", "table"]

# Wide enough that no table or line of ours is ever wrapped when the output is not a terminal.
_PLAIN_WIDTH = 100_000
# Plain tables: the header underlined with dashes, columns separated by spaces, no other rules
# (rich's Box format: eight rows of left, horizontal, divider, right characters).
_PLAIN_BOX = box.Box("    \n    \n -  \n    \n    \n    \n    \n    \n", ascii=True)


def make_console(file: IO[str] | None = None, *, force_terminal: bool | None = None, width: int | None = None) -> Console:
    """A rich Console on ``file`` (default: stdout), plain when ``file`` is not a terminal.

    ``force_terminal=True`` gives terminal output on any file (tests), ``False`` plain output on
    a terminal. Markup in strings is off: op names, shapes and reasons are printed as they are.
    """
    file = file if file is not None else sys.stdout
    probe = Console(file=file, force_terminal=force_terminal)
    if probe.is_terminal:
        return Console(file=file, force_terminal=force_terminal, width=width, markup=False, highlight=False)
    return Console(
        file=file,
        force_terminal=False,
        no_color=True,
        width=width or _PLAIN_WIDTH,
        markup=False,
        highlight=False,
        emoji=False,
        soft_wrap=True,
    )


class _Table(Table):
    """A rich Table whose title is a line of its own above it, wrapped at the console's width
    (rich wraps a title to the table's width: a narrow table would stack it word by word)."""

    heading: Text | None = None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.heading is not None:
            yield self.heading
        yield from super().__rich_console__(console, options)


def table(
    console: Console,
    *columns: str,
    title: str | None = None,
    right: tuple[str, ...] = (),
    show_header: bool = True,
    keep: tuple[str, ...] = (),
) -> Table:
    """A table with ``columns`` (those named in ``right`` right-aligned, for numbers), boxed on a
    terminal and as space-separated columns under a header line otherwise.

    On a narrow terminal the other columns wrap between words so that the numbers (``right``)
    and the columns named in ``keep`` (names, ids) are not broken as long as the rest can give
    way; :func:`fits` says whether a table prints with nothing wrapped.
    """
    terminal = console.is_terminal
    t = _Table(
        box=box.SIMPLE_HEAD if terminal else _PLAIN_BOX,
        show_edge=False,
        pad_edge=False,
        header_style="bold" if terminal else "",
        show_header=show_header,
    )
    if title:
        t.heading = Text(title, style="bold" if terminal else "")
    for name in columns:
        no_wrap = not terminal or name in right or name in keep
        t.add_column(name, justify="right" if name in right else "left", overflow="fold", no_wrap=no_wrap)
    return t


def fits(console: Console, t: Table) -> bool:
    """Whether ``t`` prints on ``console`` with no cell wrapped or cut (its natural width fits)."""
    return Measurement.get(console, console.options.update_width(_PLAIN_WIDTH), t).maximum <= console.width


@contextlib.contextmanager
def progress(console: Console, *, transient: bool = False) -> Iterator[Progress]:
    """A rich progress display on a terminal; on plain output a disabled one (tasks still count,
    nothing is drawn: callers print a summary line when a task ends).

    >>> with progress(make_console()) as bar:        # doctest: +SKIP
    ...     task = bar.add_task("training", total=30)
    ...     bar.advance(task)
    """
    columns: list[Any] = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console, transient=transient, disable=not console.is_terminal) as bar:
        yield bar
