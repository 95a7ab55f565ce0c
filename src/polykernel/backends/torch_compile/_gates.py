"""Gates of the ``torch_compile`` impls: can Inductor compile here, now, for this class?

torch-free at import (torch is imported inside the predicates, which run only on a decision for a
new argument class, when torch is loaded anyway). Nothing here imports ``torch._inductor``: the
compiler toolchain is probed with ``shutil.which`` / ``find_spec``, once per device type.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import threading
from typing import Any

MODULES = ("torch._inductor",)

_lock = threading.Lock()
_probed: dict[str, str | None] = {}  # device type -> None (Inductor can compile for it) or why not


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _cxx() -> str | None:
    """The C++ compiler Inductor's CPU code would use ($CXX, else the usual names), if any."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((path for path in map(shutil.which, names) if path), None)


def _probe(device_type: str) -> str | None:
    if not _findable("torch._inductor"):
        return "module 'torch._inductor' not installed"
    if device_type == "cpu":
        return None if _cxx() else "no C++ compiler for Inductor's CPU code (g++, c++, clang++ or $CXX not found)"
    if device_type == "cuda":
        return None if _findable("triton") else "Inductor's CUDA code needs triton (not installed)"
    return f"Inductor compiles for CPU and CUDA only, not {device_type}"


def compiler_reason(device_type: str) -> str | None:
    """None when Inductor has a compiler for ``device_type`` here, else why not (probed once)."""
    try:
        return _probed[device_type]
    except KeyError:
        pass
    with _lock:
        if device_type not in _probed:
            _probed[device_type] = _probe(device_type)
        return _probed[device_type]


def reset() -> None:
    """Forget the probe's answers (tests; after installing a compiler in a running process)."""
    with _lock:
        _probed.clear()


def usable(op_id: str, a: Any) -> str | None:
    """The predicate of every ``torch_compile`` impl (``a``: the op's argument class)."""
    import torch

    device = a.device
    reason = compiler_reason(getattr(device, "type", str(device)))
    if reason:
        return reason
    if torch.compiler.is_compiling():
        return "inside a torch.compile trace: the outer compile traces the op itself"
    if getattr(device, "type", None) == "cuda" and torch.cuda.is_current_stream_capturing():
        from . import _compiled

        if not _compiled.ready(op_id, tuple(a.as_dict().values())):
            return "not compiled for this argument class yet, and nothing compiles during CUDA-graph capture (run it once before capturing)"
    return None


def rms_norm(a: Any) -> str | None:
    return usable("norm.rms_norm", a)


def fused_add_rms_norm(a: Any) -> str | None:
    return usable("norm.fused_add_rms_norm", a)


def layer_norm(a: Any) -> str | None:
    return usable("norm.layer_norm", a)


def swiglu(a: Any) -> str | None:
    return usable("activation.swiglu", a)


def geglu(a: Any) -> str | None:
    return usable("activation.geglu", a)


def silu_and_mul(a: Any) -> str | None:
    return usable("serving.silu_and_mul", a)


def rope(a: Any) -> str | None:
    return usable("embedding.rope", a)
