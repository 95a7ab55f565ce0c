"""Host launchers of the CuTeDSL row norms (kernels in :mod:`._norms`), shared by ``rms_norm`` and
``layer_norm``: allocate outputs, fetch the compiled kernel for the key, launch through TVM-FFI.

A key is (kernel, x dtype, parameter dtypes, N, options, arch); the row count is symbolic, so one
compile serves every M. Empty inputs never launch.
"""

from __future__ import annotations

import torch

from . import _common as common
from . import _norms as kern


def _dt(t: torch.Tensor | None):
    return None if t is None else common.cutlass_dtype(t.dtype)


_archs: dict[torch.device, tuple[int, int]] = {}


def _arch(device: torch.device) -> tuple[int, int]:
    hit = _archs.get(device)
    if hit is None:
        hit = _archs[device] = torch.cuda.get_device_capability(device)
    return hit


def norm_forward(
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    offset: float,
    layer: bool,
    llama: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """y [M, N] in x's dtype, rstd [M] fp32 and (LayerNorm) mean [M] fp32 from 16-byte rows."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x2.device)
    mean = torch.empty(m, dtype=torch.float32, device=x2.device) if layer else None
    if m == 0 or n == 0:
        return y, rstd.fill_(0), None if mean is None else mean.fill_(0)
    key = ("norm_fwd", x2.dtype, _dt_key(weight), _dt_key(bias), n, layer, llama, _arch(x2.device))
    fn = common.compiled(key, lambda: kern.compile_fwd(_dt(x2), _dt(weight), _dt(bias), n, layer, llama))
    fn(x2, weight, bias, y, rstd, mean, eps, offset)
    return y, rstd, mean


def norm_backward(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    mean: torch.Tensor | None,
    offset: float,
    layer: bool,
    llama: bool,
    want_dw: bool,
    want_db: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """dx [M, N] in x's dtype and fp32 dW, dB (summed over rows; None when not wanted)."""
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    zeros = lambda: torch.zeros(n, dtype=torch.float32, device=x2.device)
    if m == 0 or n == 0:
        return dx, zeros() if want_dw else None, zeros() if want_db else None
    cfg, acc_smem = kern.bwd_config(n, common.cutlass_dtype(x2.dtype).width)
    blocks = -(-m // cfg.rows)
    # Persistent grid: about two waves of CTAs, fewer when shared memory (wide rows) limits them.
    per_sm = 1 if acc_smem else max(1, min(4, 2048 // cfg.threads))
    groups = max(1, min(blocks, per_sm * common.sm_count(x2.device) // cfg.cluster))
    parts = groups * cfg.rows
    dw = torch.empty((parts, n), dtype=torch.float32, device=x2.device) if want_dw else None
    db = torch.empty((parts, n), dtype=torch.float32, device=x2.device) if want_db else None
    key = ("norm_bwd", x2.dtype, _dt_key(weight), n, layer, llama, want_dw, want_db, _arch(x2.device))
    fn = common.compiled(key, lambda: kern.compile_bwd(_dt(x2), _dt(weight), n, layer, llama, want_dw, want_db))
    fn(x2, weight, dy2, rstd, mean, dx, dw, db, offset, groups)
    return dx, None if dw is None else dw.sum(0), None if db is None else db.sum(0)


def _dt_key(t: torch.Tensor | None):
    return None if t is None else t.dtype
