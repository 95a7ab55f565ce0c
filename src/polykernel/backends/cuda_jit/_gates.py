"""Gates of the ``cuda_jit`` impls: the toolchain (nvcc, ninja) and the per-call predicates.

torch-free and ``cpp_extension``-free: the toolchain is looked up the way torch's extension loader
looks for it (``$CUDA_HOME``/``$CUDA_PATH``, then ``nvcc`` on PATH, then /usr/local/cuda; ninja on
PATH), once per process. The device and its arch (sm_80+) are the backend's declaration.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any

VEC_BYTES = 16  # every load and store is 128 bits
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_lock = threading.Lock()
_probed: list[str | None] = []  # [None] (the toolchain is there) or [why not], once probed


def nvcc() -> str | None:
    """The nvcc that torch's extension loader would use, or None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        path = os.path.join(home, "bin", "nvcc")
        return path if os.path.isfile(path) else None
    return shutil.which("nvcc") or (path if os.path.isfile(path := "/usr/local/cuda/bin/nvcc") else None)


def _probe() -> str | None:
    if nvcc() is None:
        where = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        return f"nvcc not found in CUDA_HOME={where}" if where else "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    if shutil.which("ninja") is None:
        return "ninja not found (torch's extension loader needs it: pip install ninja)"
    return None


def toolchain_reason() -> str | None:
    """None when nvcc and ninja are here, else why not (probed once per process)."""
    if not _probed:
        with _lock:
            if not _probed:
                _probed.append(_probe())
    return _probed[0]


def reset() -> None:
    """Forget the probe's answer (tests; after installing the toolkit in a running process)."""
    with _lock:
        _probed.clear()


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def vector_width(dtype: Any) -> int | None:
    """Elements per 128-bit vector (8 for bf16/fp16, 4 for fp32), None for another dtype."""
    size = _BYTES.get(_name(dtype))
    return None if size is None else VEC_BYTES // size


def _row(op: str, a: Any) -> str | None:
    vec = vector_width(a.dtype)
    if vec is None:
        return f"cuda_jit {op} takes float32/bfloat16/float16, got {_name(a.dtype)}"
    if a.n is not None and a.n % vec:
        return f"cuda_jit {op} needs N divisible by {vec} (128-bit vectors, no scalar tail); N = {a.n}"
    if a.weight_dtype is not None and _name(a.weight_dtype) not in (_name(a.dtype), "float32"):
        return f"cuda_jit {op} takes a weight of x's dtype or float32, got {_name(a.weight_dtype)}"
    return toolchain_reason()


def rms_norm(a: Any) -> str | None:
    """``norm.rms_norm``: both castings, any offset; weight of x's dtype or fp32."""
    return _row("rms_norm", a)


def fused_add_rms_norm(a: Any) -> str | None:
    return _row("fused_add_rms_norm", a)


def fused_add_rms_norm_(a: Any) -> str | None:
    return _row("fused_add_rms_norm_", a)
