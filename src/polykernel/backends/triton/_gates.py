"""Per-call predicates of the triton impls (torch-free: they read the op's argument class, so
``explain`` can give the reason on any machine)."""

from __future__ import annotations

from collections.abc import Callable
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


def _fp64_free(field: str) -> Callable[[Any], str | None]:
    """The distillation kernels' fp32 math takes no float64 ``field`` (a dtype of the argument
    class): fp64 math is the contract's for it, the torch impl's."""

    def predicate(a: Any) -> str | None:
        if str(getattr(a, field)).removeprefix("torch.") == "float64":
            return f"{field} is float64 (fp64 math: the torch impl)"
        return None

    return predicate


kl_div = _fp64_free("target_dtype")
jsd = _fp64_free("teacher_dtype")
tvd = _fp64_free("q_dtype")
fused_linear_jsd = _fp64_free("teacher_dtype")
