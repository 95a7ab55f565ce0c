"""Checks of command-line values shared by the commands (``polykernel.tools.cli``, ``bench``,
``tune``, ``demo``): each bad value is one line that names the option and the problem, raised
before any work (a ``ValueError`` the commands print as ``polykernel CMD: ...``, or an
``argparse.ArgumentTypeError`` that argparse prefixes with ``argument --option:``)."""

from __future__ import annotations

import argparse
import inspect
import math
import os
from typing import Any


def device(name: str, option: str = "--device") -> str:
    """``name`` when torch knows it and this machine has it; else a ``ValueError``. The answer for
    a device that is not here would be about another machine (and the torch impl would run, or
    fail deep inside an op's first tensor)."""
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"{option} {name}: not a device (expected cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return name
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{option} {name}: no CUDA device here (torch {torch.__version__} sees none)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{option} {name}: no such CUDA device (torch sees {torch.cuda.device_count()})")
        return name
    backend = getattr(torch, dev.type, None)  # torch.mps, torch.xpu ...: each says whether it is here
    available = getattr(backend, "is_available", None)
    if not (callable(available) and available()):
        raise ValueError(f"{option} {name}: no {dev.type} device here")
    return name


def shape(text: str, option: str = "--shape") -> tuple[int, ...]:
    """``4096x4096`` -> (4096, 4096): positive sizes separated by ``x`` (a dropped or zero size
    is an error, not a shape of another rank or an empty tensor)."""
    parts = text.strip().lower().split("x")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{option} {text!r}: expected sizes like 4096x4096") from None
    if any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"{option} {text!r}: sizes must be positive, like 4096x4096")
    return dims


def _positive(convert: Any, kind: str) -> Any:
    """An argparse type: ``convert(text)`` when it is finite and > 0, else one line saying so."""

    def check(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a positive {kind}, not {text!r}")
        return value

    return check


positive_int = _positive(int, "integer")  # a count: steps, batch, threads
positive_float = _positive(float, "number")  # a learning rate


def records(result: dict[str, Any], key: str, required: tuple[str, ...], path: str, what: str) -> dict[str, Any]:
    """``result`` (a loaded ``--load`` file) when ``result[key]`` is a non-empty list of objects
    that each hold ``required``; else a ``ValueError`` naming the file, ``what`` it should be
    and the first thing missing (another tool's JSON, a file with no rows)."""
    items = result.get(key)
    why = f"no {key!r} list" if not isinstance(items, list) else f"no {key}" if not items else ""
    for i, item in enumerate(items if not why else []):
        missing = [k for k in required if k not in item] if isinstance(item, dict) else None
        why = f"{key[:-1]} {i} is not an object" if missing is None else f"{key[:-1]} {i} lacks {missing[0]!r}" if missing else ""
        if why:
            break
    if why:
        raise ValueError(f"--load {path}: not {what} ({why})")
    return result


def example(op: Any, dims: tuple[int, ...], dtype: Any, device: str, grad: bool, option: str = "--shape") -> Any:
    """The op's example call for ``dims``; a shape that does not fit its layout is a ``ValueError``
    naming the layout (the first paragraph of the op's ``example`` docstring)."""
    try:
        return op.example(dims, dtype, device, grad)
    except (ValueError, TypeError, IndexError, RuntimeError) as exc:
        layout = " ".join((inspect.getdoc(op.example) or "").split("\n\n")[0].split()).replace("``", "")
        layout = layout.removeprefix("Op(example=) of ")
        raise ValueError(
            f"{option} {'x'.join(map(str, dims))} does not fit {op.id}'s example inputs ({exc}); {op.name}: {layout}"
        ) from None


def writable_dir(path: str, option: str) -> None:
    """Create ``path`` (a directory) if needed; a ``ValueError`` when that or writing in it fails,
    so that a run learns it before measuring rather than after."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"{option} {path}: cannot write there (no write permission)")


def writable_file(path: str, option: str) -> None:
    """A ``ValueError`` when ``path`` cannot be written: its directory missing or read-only, or a
    directory itself (checked before the work that produces it; nothing is created)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        why = "it is a directory"
    elif not os.path.isdir(parent):
        why = f"no directory {parent}"
    elif not os.access(parent, os.W_OK):
        why = f"no write permission in {parent}"
    else:
        return
    raise ValueError(f"{option} {path}: cannot write there ({why})")


def given(args: argparse.Namespace, parser: argparse.ArgumentParser, names: list[str]) -> str | None:
    """The first of ``names`` (dests) whose value differs from the parser's default, as the user
    wrote it (``--no-compile``, ``OP``), or None: the options that a mode ignores."""
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if action.dest in names and value != action.default and not (value == [] and action.default is None):  # nargs="*"
            if action.option_strings:
                return action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
            return action.metavar or action.dest.upper()
    return None
