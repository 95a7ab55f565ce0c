"""Building the cuda_jit extension: once per torch/Python/source version, under a file lock.

``torch.utils.cpp_extension.load_inline`` compiles ``csrc/binding.cu`` (which includes the
kernels, ``csrc/rms_norm.cuh``) with nvcc and ninja into ``<polykernel cache>/cuda_jit/<tag>/``;
the tag holds torch's and Python's versions and a hash of the sources and flags, so a changed
kernel builds anew and an unchanged one loads in milliseconds. A file lock in that directory
(``backends/_extension_lock.py``) makes parallel processes (ranks, test workers) build it once: the
others wait, then load it; a build interrupted mid-way (the process killed) no longer blocks later
ones. The first failure is kept for the process (no rebuild per call), with its last line.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from pathlib import Path
from typing import Any

from .._extension_lock import build_lock

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("rms_norm.cuh", "binding.cu")
# No -std: torch passes the standard its headers need (C++17 or later; one of ours would override it).
CUDA_FLAGS = ["-O3"]
DECLARATION = (
    "void rms_norm_fwd(at::Tensor x, at::Tensor residual, at::Tensor weight, at::Tensor out, at::Tensor res_out, "
    "double eps, double offset, bool add, bool llama);"
)
LOCK_TIMEOUT_S = 1800.0  # another process building: a cold build takes minutes on a busy host

_lock = threading.Lock()
_module: Any = None
_failed: str | None = None


def tag() -> str:
    """torch's and Python's versions and a hash of the sources and flags."""
    import torch

    h = hashlib.sha256(" ".join(CUDA_FLAGS).encode() + DECLARATION.encode())
    for name in SOURCES:
        data = (CSRC / name).read_bytes()
        h.update(f"\0{name}\0{len(data)}\0".encode())
        h.update(data)
    return f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}-{h.hexdigest()[:12]}"


def build_dir() -> Path:
    from ...tuning.json_store import cache_dir

    return (cache_dir() or Path.home() / ".cache" / "polykernel") / "cuda_jit" / tag()


def build(verbose: bool = False) -> Any:
    """Compile (or load the built) extension; raises on failure."""
    from torch.utils import cpp_extension

    with build_lock(build_dir(), "cuda_jit", timeout=LOCK_TIMEOUT_S) as out:
        return cpp_extension.load_inline(
            name="polykernel_cuda_jit",
            cpp_sources=[DECLARATION],
            cuda_sources=[(CSRC / "binding.cu").read_text()],
            functions=["rms_norm_fwd"],
            extra_include_paths=[str(CSRC)],
            extra_cuda_cflags=CUDA_FLAGS,
            build_directory=str(out),
            verbose=verbose,
        )


def module() -> Any:
    """The extension (built on the first call in this process); a failed build raises again,
    quickly, with the same message."""
    global _module, _failed
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            if _failed is not None:
                raise RuntimeError(_failed)
            try:
                _module = build()
            except Exception as exc:
                lines = str(exc).strip().splitlines()
                _failed = f"cuda_jit build failed ({type(exc).__name__}: {lines[-1] if lines else ''})"
                raise RuntimeError(_failed) from exc
        return _module


if __name__ == "__main__":  # python -m polykernel.backends.cuda_jit._build: build ahead of time
    build(verbose=True)
    print(build_dir())
