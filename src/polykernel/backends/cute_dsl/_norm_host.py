"""Host launchers of the CuTeDSL row norms (kernels in :mod:`._norms`), shared by ``rms_norm`` and
``layer_norm``: allocate outputs, fetch the compiled kernel for the key, launch through TVM-FFI.

A key is (kernel, x dtype, parameter dtypes, N, options, arch); the row count is symbolic, so one
compile serves every M. Empty inputs never launch. CuTeDSL itself (``_common``, ``_norms``) is
imported on the first launch, so this module and the op modules import on any machine.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

VEC_BYTES = 16


def rows16(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as [M, n] with unit column stride, 16-byte aligned base and row stride (what the
    compiled kernels assume); copies only when the layout breaks it."""
    t2 = t.reshape(math.prod(t.shape[:-1]), n)  # not -1: ambiguous when n = 0
    if t2.stride(-1) != 1 or t2.stride(0) % (VEC_BYTES // t.element_size()) or t2.data_ptr() % VEC_BYTES:
        t2 = t2.new_empty(t2.shape).copy_(t2)  # fresh storage: standard strides, aligned base
    return t2


def vector16(t: torch.Tensor | None) -> torch.Tensor | None:
    """A 1-D parameter as a contiguous, 16-byte aligned tensor (a copy only when needed)."""
    if t is not None and (t.stride(0) != 1 or t.data_ptr() % VEC_BYTES):
        t = t.new_empty(t.shape).copy_(t)
    return t


def _kernels() -> tuple[ModuleType, ModuleType]:
    from . import _common, _norms  # CuTeDSL: only once a launch needs it

    return _common, _norms


_sms: dict[torch.device, int] = {}
_archs: dict[torch.device, tuple[int, int]] = {}


def _sm_count(device: torch.device) -> int:
    hit = _sms.get(device)
    if hit is None:
        hit = _sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return hit


def _dt(t: torch.Tensor | None):
    return None if t is None else _kernels()[0].cutlass_dtype(t.dtype)


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
    common, kern = _kernels()
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
    common, kern = _kernels()
    cfg, acc_smem = kern.bwd_config(n, common.cutlass_dtype(x2.dtype).width)
    blocks = -(-m // cfg.rows)
    # Persistent grid: as many CTAs as fit at once. The backward compiles to ~128 registers a thread
    # (sm_90a, ptxas), so 65536 // (threads * 128) CTAs share an SM; wide rows (dW in shared
    # memory, 512 threads) take one.
    per_sm = 1 if acc_smem else max(1, 65536 // (cfg.threads * 128))
    if cfg.cluster > 1:  # clustered rows run one CTA an SM (acc_smem): as many clusters as fit
        groups = max(1, min(blocks, _max_clusters(x2.device, cfg.cluster)))
    else:
        groups = max(1, min(blocks, per_sm * _sm_count(x2.device)))
    parts = groups * cfg.rows
    dw = torch.empty((parts, n), dtype=torch.float32, device=x2.device) if want_dw else None
    db = torch.empty((parts, n), dtype=torch.float32, device=x2.device) if want_db else None
    key = ("norm_bwd", x2.dtype, _dt_key(weight), n, layer, llama, want_dw, want_db, _arch(x2.device))
    fn = common.compiled(key, lambda: kern.compile_bwd(_dt(x2), _dt(weight), n, layer, llama, want_dw, want_db))
    fn(x2, weight, dy2, rstd, mean, dx, dw, db, offset, groups)
    return dx, None if dw is None else dw.sum(0), None if db is None else db.sum(0)


_clusters: dict[tuple[torch.device, int], int] = {}


def _max_clusters(device: torch.device, size: int) -> int:
    """How many clusters of ``size`` CTAs (one CTA an SM) run at once on ``device``.

    Not ``SMs // size``: a cluster must fit in one GPC, so on the H200 (132 SMs) 33 clusters of 4
    do not all fit, and a persistent grid of 33 ran its last cluster as a second wave - its rows
    after everyone else's (the fwd+bwd at N = 64K took 1.77x Triton's backward time). The driver's
    occupancy query answers (through CuTeDSL's HardwareInfo); if it cannot, assume 8 GPCs of
    ``SMs // 8`` SMs each, which under-fills by at most one cluster per GPC.
    """
    key = (device, size)
    hit = _clusters.get(key)
    if hit is None:
        try:
            from cutlass.utils import HardwareInfo

            with torch.cuda.device(device):
                hit = int(HardwareInfo(device.index or 0).get_max_active_clusters(size))
        except Exception:  # an older CuTeDSL or driver: the conservative estimate
            hit = 0
        if hit <= 0:
            hit = max(1, (_sm_count(device) // 8 // size) * 8)
        _clusters[key] = hit
    return hit


def _dt_key(t: torch.Tensor | None):
    return None if t is None else t.dtype
