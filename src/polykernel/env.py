"""polykernel's environment variables: the one list of the names it reads, one way to read a
boolean, Triton's reading of ``TRITON_INTERPRET``, and the check that catches a misspelt name.

Booleans (``POLYKERNEL_STRICT``, ``POLYKERNEL_FAST_LAUNCH``, ``POLYKERNEL_LEAN_APPLY``): true is
one of ``1, true, yes, on``, false one of ``0, false, no, off`` or empty (case-insensitive,
stripped); any other value is a ``ValueError`` naming the variable and the accepted values.

:func:`check` runs when decisions are first made (once per process, again after
``clear_caches()``). It parses every boolean that is set (and ``POLYKERNEL_NATIVE``), so a bad value fails the first op call
even where the variable is read at import; an unknown ``POLYKERNEL_*`` name, or a per-op name
whose op does not exist (an op registered later is not known yet), warns, naming the closest
valid name; under ``POLYKERNEL_STRICT=1`` it is an error.
"""

from __future__ import annotations

import difflib
import logging
import os
import threading
import warnings
from collections.abc import Iterable

from .errors import shown

__all__ = ["BOOLEANS", "KNOWN", "NATIVE_MODES", "PER_OP", "check", "flag", "native_mode", "triton_interpret"]

log = logging.getLogger("polykernel")

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")

# Every POLYKERNEL_* variable polykernel reads (src/ and the test suite), and what it does.
KNOWN: dict[str, str] = {
    "POLYKERNEL_IMPL": "impl preference for every op (a name or comma-separated list)",
    "POLYKERNEL_STRICT": "boolean: a skipped preference or a runtime fallback is an error",
    "POLYKERNEL_TUNE": "off|cached|on: measured selection",
    "POLYKERNEL_TUNE_MARGIN": "how much faster than the static choice a measured winner must be",
    "POLYKERNEL_TUNE_CALLS": "calls per process a measured per-process compile (torch_compile) is spread over",
    "POLYKERNEL_CACHE_DIR": "directory of the tuning store and the native builds",
    "POLYKERNEL_NATIVE": "0|1|auto: the native launch path of the Triton impls",
    "POLYKERNEL_FAST_LAUNCH": "boolean: the Triton impls' direct launch path",
    "POLYKERNEL_LEAN_APPLY": "boolean: the Triton impls' lean autograd apply",
    "POLYKERNEL_HYPOTHESIS_EXAMPLES": "the test suite's number of property-test examples",
    "POLYKERNEL_VERIFY": "first|off|always: check a new decision's impl against the torch impl once (default first on CUDA)",
    "POLYKERNEL_COMPAT_FALLBACKS": "boolean: use every private-API fallback (polykernel._compat; CI runs the suite so)",
}
# Per-op variables: the prefix, then the op's bare name upper-cased (POLYKERNEL_IMPL_RMS_NORM).
PER_OP = ("POLYKERNEL_IMPL_", "POLYKERNEL_COMPILE_")
BOOLEANS = ("POLYKERNEL_STRICT", "POLYKERNEL_FAST_LAUNCH", "POLYKERNEL_LEAN_APPLY", "POLYKERNEL_COMPAT_FALLBACKS")

# TRITON_INTERPRET as Triton reads it (triton.knobs' env_bool, C++ getenv_bool): these values,
# lower-cased and not stripped, are true; any other value Triton reads as false.
_TRITON_TRUE = ("1", "true", "on", "yes", "y")
_TRITON_FALSE = ("0", "false", "off", "no", "n", "")
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()  # check and add as one: threads meeting one key warn once


def flag(name: str, default: bool) -> bool:
    """The boolean variable ``name`` (``default`` when unset); a ``ValueError`` for any other value."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(
        f"{name}={shown(raw)}: expected a boolean: true is one of {', '.join(TRUE)}; "
        f"false is one of {', '.join(FALSE[:-1])} or empty (case-insensitive)"
    )


# POLYKERNEL_NATIVE's values (case-insensitive, stripped; unset or empty is auto) and their modes.
NATIVE_MODES = {"auto": "auto", "1": "on", "on": "on", "true": "on", "yes": "on", "0": "off", "off": "off", "false": "off", "no": "off"}


def native_mode() -> str:
    """``POLYKERNEL_NATIVE`` as ``'auto'``, ``'on'`` (required) or ``'off'``; unset or empty is auto.
    Raises ``ValueError`` naming the variable and the accepted values on any other value."""
    raw = os.environ.get("POLYKERNEL_NATIVE", "")
    found = NATIVE_MODES.get(raw.strip().lower() or "auto")
    if found is None:
        raise ValueError(
            f"POLYKERNEL_NATIVE={shown(raw)} is not a setting of polykernel's native launch path; use 1 (or on, true, "
            "yes: required), 0 (or off, false, no: the Python path) or auto (the default: used once built); "
            "case and surrounding spaces do not matter"
        )
    return found


def triton_interpret() -> bool:
    """Whether Triton runs its interpreter: only Triton's own true values of ``TRITON_INTERPRET``.
    A value Triton does not recognise is treated as unset, with one warning (Triton compiles then,
    so treating it as set would make Triton impls eligible on the CPU, where they fail)."""
    raw = os.environ.get("TRITON_INTERPRET")
    if raw is None:
        return False
    value = raw.lower()
    if value in _TRITON_TRUE:
        return True
    if value not in _TRITON_FALSE:
        _warn_once(
            ("TRITON_INTERPRET", raw),
            f"polykernel: TRITON_INTERPRET={shown(raw)} is not a value Triton reads as true "
            f"({', '.join(_TRITON_TRUE)}); treated as unset: Triton kernels are compiled, not interpreted",
        )
    return False


def check(op_names: Iterable[str], strict: bool) -> None:
    """Check the ``POLYKERNEL_*`` variables set: booleans must parse (else ``ValueError``); a
    misspelt or unknown name warns (each once per call of this function), naming the closest
    valid name; with ``strict`` the problems are one ``ValueError`` instead."""
    for name in BOOLEANS:
        flag(name, False)
    native_mode()  # read where a Triton kernel first launches: a bad value must fail the first call, not a launch
    per_op = {p + op.upper() for op in op_names for p in PER_OP}
    problems = [p for p in (_problem(name, per_op) for name in sorted(os.environ)) if p is not None]
    if not problems:
        return
    if strict:
        raise ValueError("; ".join(problems) + " (an error under POLYKERNEL_STRICT=1)")
    for problem in problems:
        message = f"polykernel: {problem} (ignored)"
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log.warning(message)


def _problem(name: str, per_op: set[str]) -> str | None:
    if not name.upper().startswith("POLYKERNEL_") or name in KNOWN or name in per_op:
        return None
    for prefix in PER_OP:
        if name.upper().startswith(prefix):
            ops = sorted(n[len(prefix) :] for n in per_op if n.startswith(prefix))
            closest = difflib.get_close_matches(name[len(prefix) :].upper(), ops, 1, 0.6)
            hint = f"did you mean {prefix}{closest[0]}?" if closest else f"valid names: {', '.join(prefix + op for op in ops)}"
            return f"{name} names no op ({prefix}<OP> takes an op's name upper-cased); {hint}"
    closest = difflib.get_close_matches(name.upper(), list(KNOWN), 1, 0.6)
    hint = f"did you mean {closest[0]}? " if closest else ""
    known = ", ".join([*KNOWN, *(p + "<OP>" for p in PER_OP)])
    return f"{name} is not a polykernel variable; {hint}known variables: {known}"


def _warn_once(key: tuple[str, str], message: str) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log.warning(message)


def reset_warnings() -> None:
    """Warn again about values already warned of (``clear_caches`` calls this)."""
    _warned.clear()
