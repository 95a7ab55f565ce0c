"""Per-call predicates of the triton impls (torch-free: they read the op's argument class, so
``explain`` can give the reason on any machine)."""

from __future__ import annotations

from typing import Any

_KERNEL_DTYPES = ("float32", "bfloat16", "float16")


def rope(info: Any) -> str | None:
    """rope and mrope: the kernel computes only the q and k gradients, and takes k in a kernel dtype."""
    if info.rot_grad:
        return "cos/sin require grad (the Triton kernel computes only the q and k gradients)"
    k_dtype = str(info.k_dtype).removeprefix("torch.")
    if k_dtype not in _KERNEL_DTYPES:
        return f"k dtype {k_dtype} not supported"
    return None
