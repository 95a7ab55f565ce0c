"""Host side of the cuda_jit norms: [M, N] views the kernels take, outputs, the launch.

The kernels read and write 128-bit vectors: every row must start 16-byte aligned with a unit
inner stride. A view that is not (a sliced column, an odd offset) is copied to a fresh contiguous
tensor first (and, in place, the results are copied back), so any layout gets the right result.
"""

from __future__ import annotations

import torch

from . import _build


def _aligned(t: torch.Tensor, vec: int) -> bool:
    return t.stride(-1) == 1 and t.stride(0) % vec == 0 and t.data_ptr() % 16 == 0


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as [M, n] (a view when its layout allows)."""
    return t.reshape(-1, n)


def _kernel_rows(t: torch.Tensor, n: int, vec: int) -> torch.Tensor:
    """t as aligned [M, n] rows: a view when its layout allows, else a fresh contiguous copy."""
    v = _rows(t, n)
    return v if _aligned(v, vec) else v.clone(memory_format=torch.contiguous_format)


def _weight(w: torch.Tensor) -> torch.Tensor:
    w = w.contiguous()
    return w if w.data_ptr() % 16 == 0 else w.clone()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, llama: bool) -> torch.Tensor:
    n = x.shape[-1]
    vec = 16 // x.element_size()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, aligned
    if x.numel():
        xr = _kernel_rows(x, n, vec)
        _build.module().rms_norm_fwd(xr, xr, _weight(weight), y.view(-1, n), xr, eps, offset, False, llama)
    return y


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, s) with s = x + residual: fresh tensors, or (in_place) written over x and residual."""
    n = x.shape[-1]
    vec = 16 // x.element_size()
    if not in_place:
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.numel():
            _build.module().rms_norm_fwd(
                _kernel_rows(x, n, vec),
                _kernel_rows(residual, n, vec),
                _weight(weight),
                y.view(-1, n),
                s.view(-1, n),
                eps,
                offset,
                True,
                False,
            )
        return y, s
    if x.numel():
        xv, rv = _rows(x, n), _rows(residual, n)
        direct = _is_view(xv, x) and _is_view(rv, residual) and _aligned(xv, vec) and _aligned(rv, vec)
        if direct:  # the kernel writes y over x and s over residual itself
            _build.module().rms_norm_fwd(xv, rv, _weight(weight), xv, rv, eps, offset, True, False)
        else:  # a layout the vectors cannot take: compute into fresh rows, copy back
            y, s = fused_add_rms_norm(x, residual, weight, eps, offset)
            residual.copy_(s)
            x.copy_(y)
    return x, residual


def _is_view(v: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``v`` (t.reshape) shares t's memory, so writing v writes t."""
    return v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and v.data_ptr() == t.data_ptr()
