"""Gates of the cuTile impls: the compiler probe and the per-call predicates.

torch-free and ``cuda.tile``-free at import time. The probe (:func:`compiler_reason`) imports
``cuda.tile`` only when asked, which the dispatcher does only after an impl's capability (a CUDA
device in the arch window) and module (``cuda.tile`` findable) checks have passed, i.e. when a
cuTile impl is first considered on a machine that could run it.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

# tileiras 13.4.92 `--help`: --gpu-name sm_80 ... sm_121 (Ampere to Blackwell).
MIN_SM, MAX_SM = 80, 121
MODULES = ("cuda.tile",)

_lock = threading.Lock()
_probed: dict[int | None, str | None] = {}  # arch (sm) -> None (works) or the reason it does not


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _module_missing() -> bool:
    try:
        return importlib.util.find_spec("cuda.tile") is None
    except (ImportError, ValueError):  # no `cuda` package at all
        return True


def _probe(sm: int | None) -> str | None:
    """Compile a tiny kernel for ``sm`` with the installed tileiras: None if it worked."""
    if _module_missing():
        return "module 'cuda.tile' not installed"
    try:
        from . import _probe_kernel
    except Exception as exc:  # an incompatible cuda-tile build, a missing libcuda, ...
        return f"cuda.tile import failed: {type(exc).__name__}: {_first_line(exc)}"
    try:
        _probe_kernel.compile_for(sm)
    except FileNotFoundError as exc:
        return "tileiras not found" if "tileiras" in str(exc) else f"cuTile probe failed: {_first_line(exc)}"
    except Exception as exc:
        if type(exc).__name__.startswith("TileCompiler"):  # TileCompilerExecutionError / TimeoutError
            return f"tileiras failed: {_first_line(exc)}"
        return f"cuTile probe failed: {type(exc).__name__}: {_first_line(exc)}"
    return None


def compiler_reason(sm: int | None) -> str | None:
    """None when cuTile can compile for ``sm`` here, else why not. Probed once per process and arch."""
    try:
        return _probed[sm]
    except KeyError:
        pass
    with _lock:
        if sm not in _probed:
            _probed[sm] = _probe(sm)
        return _probed[sm]


def reset() -> None:
    """Forget the probe's answers (tests; after installing the compiler in a running process)."""
    with _lock:
        _probed.clear()


def _sm(device: Any) -> int | None:
    from ...spec import PlatformInfo

    return PlatformInfo.detect(device).sm


def _compiler(a: Any) -> str | None:
    return compiler_reason(_sm(a.device))


# -- per-op predicates (the argument class of each op; see ops/<op>.py) --------------------------


def swiglu(a: Any) -> str | None:
    return _compiler(a)


def geglu(a: Any) -> str | None:
    return _compiler(a)


def rms_norm(a: Any) -> str | None:
    return _compiler(a)


def softmax(a: Any) -> str | None:
    return _compiler(a)


def rope(a: Any) -> str | None:
    if a.partial:
        return "partial rotary (rotary_dim < head dim): the cuTile kernel rotates the whole head"
    if a.interleaved:
        return "interleaved=True: the cuTile kernel pairs rotate-half only"
    if a.rot_grad:
        return "cos/sin require grad (the cuTile kernel computes only the q and k gradients)"
    if str(a.k_dtype).removeprefix("torch.") not in ("float32", "bfloat16", "float16"):
        return f"k dtype {str(a.k_dtype).removeprefix('torch.')} not supported"
    return _compiler(a)
