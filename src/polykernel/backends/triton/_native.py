"""The native launch path: the host path of the norms, GLUs, rope and the serving ops in C++ (``polykernel/csrc/``).

On the H200 host, Python around a Triton kernel costs more than the kernel (notes/PERF.md): a
Python autograd node alone ~60 µs per fwd+bwd, Triton's launcher ~6.6 µs, a torch allocation
2-8 µs. The C++ extension does an op's allocations, launches and autograd node the way torch's own
ops do. Triton still compiles: each :class:`Slot` (one kernel, fixed constexprs) asks Python on a
specialization it has not seen, which launches through ``kernel[grid]`` and hands the compiled
handle and its parameter layout back (checked against the driver's view of the function).

Build: the extension is compiled once per torch/Python/source version into the cache directory
(``$POLYKERNEL_CACHE_DIR`` or the user cache dir, ``native/``), by ``make setup`` (the README's
commands) or ``python -m polykernel.backends.triton._native``; it needs a C++ compiler, no CUDA
toolkit. It builds under a file lock (``backends/_extension_lock.py``): another process's build is
waited for (logged), and a build interrupted mid-way (the process killed, or exiting while the
background build runs) no longer blocks later ones. Until it is built, or where it cannot be, the
Python path runs: that is logged once, and with ``POLYKERNEL_NATIVE=1`` (require it) it is an
error. A CUDA call that finds no built extension starts the build in the background and keeps
using the Python path meanwhile. The launch layout
is written for the Triton releases ``csrc/slot.h`` names; with another the Python path runs (the
same way: logged once, an error when required).

``POLYKERNEL_NATIVE``: ``1`` (or ``on``/``true``/``yes``) requires the path, ``0`` (or
``off``/``false``/``no``) turns it off (so does ``set_enabled(False)``; benchmarks A/B it), ``auto``
(the default) uses it once built. Any other value is an error where the path is first consulted.

Example::

    C = module()                 # the extension, or None (not built / not usable here)
    y = C.rms_norm(x, w, 1e-6, 0.0, False)   # None when this input takes the Python path
"""

from __future__ import annotations

import hashlib
import logging
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ... import _compat, env
from .._extension_lock import build_lock
from . import _launch

log = logging.getLogger("polykernel")

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCE = CSRC / "native.cpp"  # the one translation unit: it includes the other csrc files
# No -std: torch's cpp_extension passes the standard its headers need (2.14's refuse less than C++20);
# one of ours after it would override it.
CFLAGS = ["-O2"]

# Read from POLYKERNEL_NATIVE where first consulted (module __getattr__ below), then plain globals.
ENABLED: bool  # the fast launch off: the old path
REQUIRED: bool

_module: Any = None
_state = "new"  # new | building | ready | failed
_lock = threading.Lock()
_logged: set[str] = set()


def mode() -> str:
    """``POLYKERNEL_NATIVE`` as ``'auto'``, ``'on'`` (required) or ``'off'`` (:func:`polykernel.env.native_mode`)."""
    return env.native_mode()


def _settle() -> None:
    """ENABLED and REQUIRED from the environment, once (raises on a bad value, every time)."""
    g = globals()
    if "ENABLED" in g and "REQUIRED" in g:
        return
    m = mode()
    g.setdefault("REQUIRED", m == "on")
    g.setdefault("ENABLED", m != "off" and _launch.ENABLED)


def _required() -> bool:
    _settle()
    return globals()["REQUIRED"]


def __getattr__(name: str) -> Any:
    if name in ("ENABLED", "REQUIRED"):  # the first look: read the environment, then a plain global
        _settle()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _log_once(msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        log.warning(msg)


def sources() -> list[Path]:
    """Every file the extension is compiled from: native.cpp and the headers it includes."""
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h") and p.is_file())


def build_dir() -> Path:
    """Where this torch/Python/source combination is built: the name holds torch's and Python's
    versions and a hash of every source file (its path and bytes) and of the flags."""
    from ...tuning.json_store import cache_dir

    h = hashlib.sha256(" ".join(CFLAGS).encode())
    for path in sources():
        data = path.read_bytes()
        h.update(f"\0{path.relative_to(CSRC).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}-{h.hexdigest()[:12]}"
    return (cache_dir() or Path.home() / ".cache" / "polykernel") / "native" / tag


def triton_version() -> tuple[int, int]:
    """The installed Triton's (major, minor), which the C++ launch layout checks."""
    import triton

    found = re.match(r"(\d+)\.(\d+)", triton.__version__)
    if found is None:
        raise RuntimeError(f"cannot read Triton's version from {triton.__version__!r}")
    return int(found[1]), int(found[2])


def unusable(mod: Any) -> str:
    """Why the built extension cannot launch here ("" when it can): a Triton release its launch
    layout was not written for, or (with CUDA) a driver it cannot use. Tells the extension which
    Triton compiles its kernels."""
    return mod.accept_triton(*triton_version()) or (mod.driver_error() if torch.cuda.is_available() else "")


def build(verbose: bool = False) -> Any:
    """Compile (or load the already built) extension; raises on failure."""
    from torch.utils import cpp_extension

    with build_lock(build_dir(), "the native launch path") as out:
        return cpp_extension.load(
            name="polykernel_native",
            sources=[str(SOURCE)],
            build_directory=str(out),
            extra_cflags=CFLAGS,
            verbose=verbose,
        )


def _built() -> bool:
    try:
        return any(build_dir().glob("polykernel_native*.so"))
    except OSError:
        return False


def _finish(wait: bool) -> None:
    global _module, _state
    try:
        mod = build()
        error = unusable(mod)
        if error:
            raise RuntimeError(error)
        _module, _state = mod, "ready"
    except Exception as exc:
        _state = "failed"
        msg = f"polykernel: native launch path unavailable ({type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); the Triton ops launch from Python"
        if _required() and wait:
            raise RuntimeError(msg + " (POLYKERNEL_NATIVE=1 requires it)") from exc
        _log_once(msg)


def module(wait: bool = False) -> Any:
    """The extension when ready, else None. The first call loads a built extension, or starts
    the build (in the background unless ``wait`` or ``POLYKERNEL_NATIVE=1``)."""
    global _state
    if _state == "ready":
        return _module
    _settle()
    if not ENABLED and not wait:
        return None
    with _lock:
        if _state == "new":
            if wait or _required() or _built():
                _state = "building"
                _finish(True)
            else:
                _state = "building"
                _log_once("polykernel: building the native launch path in the background (once per torch version)")
                threading.Thread(target=_finish, args=(False,), name="polykernel-native-build", daemon=True).start()
        elif _state == "failed" and _required():
            raise RuntimeError("polykernel: POLYKERNEL_NATIVE=1 but the native launch path failed to build (see the log)")
    return _module if _state == "ready" else None


def set_enabled(on: bool) -> bool:
    """Turn the native path on or off in this process; returns the old setting."""
    global ENABLED
    _settle()
    old, ENABLED = ENABLED, bool(on)
    return old


def clear() -> None:
    """Forget every plan (after changing a kernel file's TUNE settings in-process)."""
    if _module is not None:
        _module.clear_plans()


# ---------------------------------------------------------------------------------------------
# Slots: one kernel with fixed keyword arguments (constexprs, num_warps)

_SIG_KINDS = {"i32": "i", "i64": "l", "u64": "l", "fp32": "f", "fp64": "d"}


def _layout(compiled: Any, kernel: Any, n_args: int) -> str | None:
    """The packed-parameter kinds of ``n_args`` positional arguments, from Triton's compiled
    signature ('\\0' for a constexpr-specialized one); None if this path cannot launch it."""
    md = compiled.metadata
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False) or getattr(md, "launch_cooperative_grid", False):
        return None
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0) or md.shared > 227 * 1024:
        return None
    sig = compiled.src.signature
    types = [sig[name] for name in kernel.arg_names] if isinstance(sig, dict) else list(sig)
    if any(t != "constexpr" for t in types[n_args:]):  # keyword arguments must all be constexprs
        return None
    kinds = []
    for t in types[:n_args]:
        if t == "constexpr":
            kinds.append("\0")
        elif isinstance(t, str) and t.startswith("*"):
            kinds.append("p")
        elif t in _SIG_KINDS:
            kinds.append(_SIG_KINDS[t])
        else:
            return None
    return "".join(kinds)


_slots: dict[tuple[Any, ...], Any] = {}


def slot(kernel: Any, **meta: Any) -> Any:
    """The C++ ``Slot`` for ``kernel`` launched with ``meta`` (one per pair; requires :func:`module`)."""
    key = (kernel, *meta.items())
    s = _slots.get(key)
    if s is None:
        s = _slots[key] = _new_slot(kernel, meta)
    return s


def _new_slot(kernel: Any, meta: dict[str, Any]) -> Any:
    C = module()
    refused: set[bytes] = set()

    def miss(grid: tuple[int, int, int], args: tuple[Any, ...], key: bytes) -> None:
        compiled = kernel[grid](*args, **meta)
        if key in refused:
            return
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        try:
            kinds = _layout(compiled, kernel, len(args))
            ok = kinds is not None and s.add(
                key, int(compiled.function), int(compiled.metadata.num_warps), int(compiled.metadata.shared), kinds
            )
        except Exception as exc:  # Triton internals other than expected: this key stays in Python
            ok = False
            _log_once(f"polykernel: native launch of {kernel.__name__} refused ({type(exc).__name__}: {exc})")
        if not ok:
            refused.add(key)
            _log_once(f"polykernel: {kernel.__name__} launches from Python for some arguments (layout not supported natively)")

    s = C.Slot(miss)
    return s


class RowTile(NamedTuple):
    """One entry of a plan's ``tiles`` (``RowTiles`` in csrc/plans.h): a kernel's slot for one ROWS."""

    slot: Any
    rows: int


def row_tiles(most: int, tile: Callable[[int], RowTile]) -> list[RowTile]:
    """The slots of a kernel whose tile depends on the row count M only through ROWS:
    ``tile(m)`` for each power of two m up to ``most`` (the largest ROWS, a power of two); C++
    takes the entry of M's next power of two, the last for every larger M."""
    return [tile(1 << i) for i in range(max(1, most).bit_length())]


def call(name: str, args: tuple[Any, ...], key_args: tuple[Any, ...], make_plan: Callable[..., Any]) -> Any:
    """``C.<name>(*args)``: the op in C++, or None where the Python path runs (not built, functorch
    transforms, Triton launch hooks, an input the C++ op does not take). A CUDA call whose plan key
    (``key_args``) has no entry yet stores ``make_plan(*key_args)`` first (None: that key stays in
    Python), then runs.

    >>> y = call("rms_norm", (x, w, 1e-6, 0.0, False), (x, w, False), plan_for)   # doctest: +SKIP
    """
    C = module()
    if C is None or transforms_active() or hooks_set():
        return None
    run = getattr(C, name)
    out = run(*args)
    if out is None and args[0].is_cuda and getattr(C, f"{name}_plan_state")(*key_args) == 0:
        getattr(C, f"set_{name}_plan")(*key_args, make_plan(*key_args))
        out = run(*args)
    return out


_colsum_slot: Any = None


def colsum_slot() -> Any:
    """One slot for the norms' shared column-sum kernel (its key includes the output dtype)."""
    global _colsum_slot
    if _colsum_slot is None:
        from . import _colsum

        _colsum_slot = slot(_colsum._colsum_kernel, **_colsum.META)
    return _colsum_slot


def transforms_active() -> bool:
    """functorch transforms (vmap, grad) need the Python autograd path."""
    return _compat.functorch_transforms_active()


def hooks_set() -> bool:
    """Triton launch hooks (profilers) only run on Triton's own path."""
    knobs = _launch._runtime_knobs
    return knobs is not None and (_launch._hooked(knobs.launch_enter_hook) or _launch._hooked(knobs.launch_exit_hook))


if __name__ == "__main__":  # python -m polykernel.backends.triton._native: build now
    logging.basicConfig(level=logging.INFO)
    _settle()  # a bad POLYKERNEL_NATIVE fails here too
    mod = build(verbose="-v" in sys.argv)
    print(f"polykernel native launch path built: {mod.__file__}")
    why = unusable(mod)
    if why:  # built, but the Python path will run: an error where it is required (CI's newest-torch job)
        print(f"polykernel native launch path not usable here: {why}", file=sys.stderr)
        if _required():
            sys.exit(1)
