"""cuTile RMSNorm: forward and backward, ``casting`` "fp32" and "llama", any ``offset``.

Forward: one row per block with the whole row in one tile for N <= ONE_TILE_N (16K; several
rows per block only when rows are shorter than ROW_ELEMS), so a block reads its row once and
writes it once. The backward holds rows of up to BWD_ONE_TILE_N in one tile (TM rows per block).
Longer rows are walked in CHUNK_N-wide chunks (forward: sum of squares, then normalize; backward: the row dot, then dx).
The forward saves rstd (fp32, one per row). The backward is persistent (about two blocks per SM):
each block accumulates dW = Σ dy·x̂ over its rows into its own row of an fp32 partials buffer,
summed on the host in a fixed order, so dW is deterministic (no atomics).
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from .._double_backward import rms_norm_grads
from .._fallback import registered
from ._host import launch, num_sms, pow2, rows

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_rms_norm = registered("norm.rms_norm")

ONE_TILE_N = 16384  # forward: rows up to this length are held in one tile, one row per block
CHUNK_N = 4096  # chunk width for longer rows
ROW_ELEMS = 2048  # forward: rows shorter than this share a block (TM = ROW_ELEMS // TN rows)
# The backward holds x, dy and a dW accumulator per tile: half the forward's tile (an sm_90
# compile of TM x TN = 2 x 4096 in fp32 took 15 s and a 1 MB cubin, a sign of spills).
BWD_ONE_TILE_N = 4096
BWD_TILE_ELEMS = 4096
# Two resident blocks per SM for the persistent backward (grid = 2 x SMs): left alone, tileiras
# gives these kernels 255 registers at 256 threads, one block per SM; the hint caps them at 128,
# without spills for casting "fp32" (sm_90 cubins: no local frame; "llama" spills 96-184 bytes).
BWD_OCCUPANCY = 2
ZERO = ct.PaddingMode.ZERO


# ---------------------------------------------------------------------------------------------
# Kernels


@ct.kernel
def _fwd_tile(X, W, Y, RSTD, EPS: ct.Constant[float], OFFSET: ct.Constant[float], LLAMA: ct.Constant[bool],
              TM: ct.Constant[int], TN: ct.Constant[int]):  # fmt: skip
    bm = ct.bid(0)
    inv_n = 1.0 / ct.astype(X.shape[1], ct.float32)
    x = ct.astype(ct.load(X, index=(bm, 0), shape=(TM, TN), padding_mode=ZERO, allow_tma=False), ct.float32)
    rstd = ct.rsqrt(ct.sum(x * x, axis=1, keepdims=True) * inv_n + EPS)  # (TM, 1)
    ct.store(RSTD, index=(bm,), tile=ct.reshape(rstd, (TM,)))
    w = ct.reshape(ct.astype(ct.load(W, index=(0,), shape=(TN,), padding_mode=ZERO, allow_tma=False), ct.float32), (1, TN)) + OFFSET
    xhat = x * rstd
    if LLAMA:
        xhat = ct.astype(ct.astype(xhat, X.dtype), ct.float32)
    ct.store(Y, index=(bm, 0), tile=ct.astype(xhat * w, Y.dtype), allow_tma=False)


@ct.kernel
def _fwd_chunked(X, W, Y, RSTD, EPS: ct.Constant[float], OFFSET: ct.Constant[float], LLAMA: ct.Constant[bool],
                 TN: ct.Constant[int]):  # fmt: skip
    row = ct.bid(0)
    n = X.shape[1]
    chunks = ct.cdiv(n, TN)
    acc = ct.full((1, TN), 0.0, dtype=ct.float32)
    for j in range(chunks):
        x = ct.astype(ct.load(X, index=(row, j), shape=(1, TN), padding_mode=ZERO, allow_tma=False), ct.float32)
        acc = acc + x * x
    rstd = ct.rsqrt(ct.sum(acc, axis=1, keepdims=True) / ct.astype(n, ct.float32) + EPS)  # (1, 1)
    ct.store(RSTD, index=(row,), tile=ct.reshape(rstd, (1,)))
    for j in range(chunks):
        x = ct.astype(ct.load(X, index=(row, j), shape=(1, TN), padding_mode=ZERO, allow_tma=False), ct.float32)
        w = ct.reshape(ct.astype(ct.load(W, index=(j,), shape=(TN,), padding_mode=ZERO, allow_tma=False), ct.float32), (1, TN)) + OFFSET
        xhat = x * rstd
        if LLAMA:
            xhat = ct.astype(ct.astype(xhat, X.dtype), ct.float32)
        ct.store(Y, index=(row, j), tile=ct.astype(xhat * w, Y.dtype), allow_tma=False)


@ct.kernel(occupancy=BWD_OCCUPANCY)
def _bwd_tile(X, W, DY, RSTD, DX, DWP, OFFSET: ct.Constant[float], LLAMA: ct.Constant[bool],
              TM: ct.Constant[int], TN: ct.Constant[int]):  # fmt: skip
    bid, blocks = ct.bid(0), ct.num_blocks(0)
    inv_n = 1.0 / ct.astype(X.shape[1], ct.float32)
    w = ct.reshape(ct.astype(ct.load(W, index=(0,), shape=(TN,), padding_mode=ZERO, allow_tma=False), ct.float32), (1, TN)) + OFFSET
    dw = ct.full((TM, TN), 0.0, dtype=ct.float32)
    for i in range(bid, ct.cdiv(X.shape[0], TM), blocks):
        x = ct.astype(ct.load(X, index=(i, 0), shape=(TM, TN), padding_mode=ZERO, allow_tma=False), ct.float32)
        dy = ct.astype(ct.load(DY, index=(i, 0), shape=(TM, TN), padding_mode=ZERO, allow_tma=False), ct.float32)
        rstd = ct.reshape(ct.load(RSTD, index=(i,), shape=(TM,), padding_mode=ZERO), (TM, 1))
        xhat = x * rstd
        g = dy * w
        if LLAMA:  # y = round(x̂)·w: the reference's cast also rounds the gradient of x̂
            dw = dw + dy * ct.astype(ct.astype(xhat, X.dtype), ct.float32)
            g = ct.astype(ct.astype(g, X.dtype), ct.float32)
        else:
            dw = dw + dy * xhat
        c = ct.sum(g * xhat, axis=1, keepdims=True) * inv_n
        ct.store(DX, index=(i, 0), tile=ct.astype((g - xhat * c) * rstd, DX.dtype), allow_tma=False)
    ct.store(DWP, index=(bid, 0), tile=ct.sum(dw, axis=0, keepdims=True))


@ct.kernel(occupancy=BWD_OCCUPANCY)
def _bwd_chunked(X, W, DY, RSTD, DX, DWP, OFFSET: ct.Constant[float], LLAMA: ct.Constant[bool], TN: ct.Constant[int]):
    # DWP starts at zero; each block adds into its own row only (no races, no atomics)
    bid, blocks = ct.bid(0), ct.num_blocks(0)
    n = X.shape[1]
    chunks = ct.cdiv(n, TN)
    for row in range(bid, X.shape[0], blocks):
        rstd = ct.reshape(ct.load(RSTD, index=(row,), shape=(1,), padding_mode=ZERO), (1, 1))
        acc = ct.full((1, TN), 0.0, dtype=ct.float32)
        for j in range(chunks):
            x = ct.astype(ct.load(X, index=(row, j), shape=(1, TN), padding_mode=ZERO, allow_tma=False), ct.float32)
            dy = ct.astype(ct.load(DY, index=(row, j), shape=(1, TN), padding_mode=ZERO, allow_tma=False), ct.float32)
            w = ct.reshape(ct.astype(ct.load(W, index=(j,), shape=(TN,), padding_mode=ZERO, allow_tma=False), ct.float32), (1, TN)) + OFFSET
            g = dy * w
            if LLAMA:
                g = ct.astype(ct.astype(g, X.dtype), ct.float32)
            acc = acc + g * (x * rstd)
        c = ct.sum(acc, axis=1, keepdims=True) / ct.astype(n, ct.float32)
        for j in range(chunks):
            x = ct.astype(ct.load(X, index=(row, j), shape=(1, TN), padding_mode=ZERO, allow_tma=False), ct.float32)
            dy = ct.astype(ct.load(DY, index=(row, j), shape=(1, TN), padding_mode=ZERO, allow_tma=False), ct.float32)
            w = ct.reshape(ct.astype(ct.load(W, index=(j,), shape=(TN,), padding_mode=ZERO, allow_tma=False), ct.float32), (1, TN)) + OFFSET
            xhat = x * rstd
            g = dy * w
            xr = xhat
            if LLAMA:
                g = ct.astype(ct.astype(g, X.dtype), ct.float32)
                xr = ct.astype(ct.astype(xhat, X.dtype), ct.float32)
            ct.store(DX, index=(row, j), tile=ct.astype((g - xhat * c) * rstd, DX.dtype), allow_tma=False)
            part = ct.load(DWP, index=(bid, j), shape=(1, TN), padding_mode=ZERO)
            ct.store(DWP, index=(bid, j), tile=part + dy * xr)


# ---------------------------------------------------------------------------------------------
# Host launcher


def _tm(m: int, tn: int, elems: int) -> int:
    return min(pow2(m), max(1, elems // tn))


def rms_norm_forward(x2: torch.Tensor, w: torch.Tensor, eps: float, offset: float, llama: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, N] contiguous, rstd [M] fp32) for ``x2`` [M, N] (any strides)."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x2.device)
    if pow2(n) <= ONE_TILE_N:
        tn = pow2(n)
        tm = _tm(m, tn, ROW_ELEMS)
        launch(((m + tm - 1) // tm,), _fwd_tile, x2, w, y, rstd, float(eps), float(offset), llama, tm, tn)
    else:
        launch((m,), _fwd_chunked, x2, w, y, rstd, float(eps), float(offset), llama, CHUNK_N)
    return y, rstd


def rms_norm_backward(
    dy2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, offset: float, llama: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, N] in x's dtype, dw [N] in w's dtype)."""
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    sms = num_sms(x2.device.index if x2.device.index is not None else torch.cuda.current_device())
    if pow2(n) <= BWD_ONE_TILE_N:
        tn = pow2(n)
        tm = _tm(m, tn, BWD_TILE_ELEMS)
        grid = min(2 * sms, (m + tm - 1) // tm)
        dwp = torch.empty((grid, n), dtype=torch.float32, device=x2.device)
        launch((grid,), _bwd_tile, x2, w, dy2, rstd, dx, dwp, float(offset), llama, tm, tn)
    else:
        grid = min(2 * sms, m)
        dwp = torch.zeros((grid, n), dtype=torch.float32, device=x2.device)
        launch((grid,), _bwd_chunked, x2, w, dy2, rstd, dx, dwp, float(offset), llama, CHUNK_N)
    return dx, dwp.sum(0).to(w.dtype)


# ---------------------------------------------------------------------------------------------
# Registered impl


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting):  # type: ignore[override]
        x2 = rows(x, x.shape[-1])
        y, rstd = rms_norm_forward(x2, weight, eps, offset, casting == "llama")
        ctx.save_for_backward(x2, weight, rstd, x)  # x: a create_graph backward differentiates through it
        ctx.offset, ctx.llama, ctx.eps, ctx.casting = offset, casting == "llama", eps, casting
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, weight, rstd, x = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            return (*rms_norm_grads(x, weight, ctx.eps, ctx.offset, ctx.casting, dy, ctx.needs_input_grad), None, None, None)
        dx, dw = rms_norm_backward(rows(dy, x2.shape[1]), x2, weight, rstd, ctx.offset, ctx.llama)
        return (dx.view(dy.shape) if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None, None, None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.rms_norm``). Empty inputs
    (no rows, or N = 0) go to the torch impl: there is no kernel to launch."""
    if x.numel() == 0:
        return _torch_rms_norm(x, weight, eps, offset, casting)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps, offset, casting)
    y, _ = rms_norm_forward(rows(x, x.shape[-1]), weight, eps, offset, casting == "llama")
    return y.view(x.shape)
