"""The MoE experts ops' error models (moe_experts, moe_experts_gpt_oss) stream over experts and
row chunks: the same bounds as the former whole-tensor float64 model (kept below, verbatim, as
``_old_*``), in memory of one expert's weights plus a chunk of rows (no float64 copy of every
expert's weights, no elementwise bound tensor of the weights' full shape)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from polykernel.core.op import Bounds, ErrorModel
from polykernel.ops import _moe
from polykernel.ops import moe_experts as op
from polykernel.ops import moe_experts_gpt_oss as gpt_oss_op
from polykernel.ops.moe_experts import _act_and_slope
from polykernel.ops.moe_experts_gpt_oss import _CURVE, _SLOPE

DTYPES = [torch.float32, torch.bfloat16]


# -- the former (whole-tensor) error models, verbatim: the reference for the streamed ones ------------
def _old_bounds(top_k_index, dtype, out, d_hidden, d_weights, d_params) -> Bounds:
    t, k = top_k_index.shape

    def tokens(part):
        return part.view(t, k, part.shape[-1]).sum(1)

    grads = {0: _moe.model(*map(tokens, d_hidden), dtype), 2: _moe.model(*d_weights, dtype)}
    grads.update({3 + i: _moe.model(c, d, dtype) for i, (c, d) in enumerate(d_params)})
    return Bounds(outputs=(_moe.model(*map(tokens, out), dtype),), grads=grads)


def _old_error_model(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str = "silu",
) -> Bounds:
    dt = hidden.dtype
    t, h = hidden.shape
    k = top_k_index.shape[1]
    inter = gate_up_proj.shape[1] // 2
    gam = _moe.gamma
    # a rounding to the dtype is off by u_d·|v|, or by up to half the smallest subnormal: in
    # units of u_d, |v| + tr
    tr = _moe.subnormal_units(dt)
    x, w, expert, token = _moe.pairs(hidden, top_k_index, top_k_weights)
    wgu, wd = gate_up_proj.detach().double(), down_proj.detach().double()
    z = dict(device=x.device, dtype=torch.float64)
    # (u32 part, u_d part) of each bound, elementwise; out and dx per pair, summed over k below
    out_c, out_d = torch.zeros(t * k, h, **z), torch.zeros(t * k, h, **z)
    dx_c, dx_d = torch.zeros(t * k, h, **z), torch.zeros(t * k, h, **z)
    dw_c, dw_d = torch.zeros(t * k, **z), torch.zeros(t * k, **z)
    dgu_c, dgu_d = torch.zeros_like(wgu), torch.zeros_like(wgu)
    dd_c, dd_d = torch.zeros_like(wd), torch.zeros_like(wd)
    for e, sel in _moe.by_expert(expert):
        tok = token[sel]
        xe, aw = x[tok], w[sel].abs()[:, None]
        ax = xe.abs()
        awg, awu, awd = wgu[e, :inter].abs(), wgu[e, inter:].abs(), wd[e].abs()
        g, u = xe @ wgu[e, :inter].T, xe @ wgu[e, inter:].T
        g_c, u_c = gam(h) * (ax @ awg.T), gam(h) * (ax @ awu.T)  # their dot products over H
        g_d, u_d = g.abs() + tr, u.abs() + tr  # rounded to the dtype
        a, slope = _act_and_slope(g, activation)
        aa, asl, au = a.abs(), slope.abs(), u.abs()
        inner = aa * au  # |act(g)·u|
        ev = (6 + g.abs()) * inner  # evaluating act
        in_c = asl * au * g_c + aa * u_c + ev
        in_d = asl * au * g_d + aa * u_d + inner + tr  # + its own rounding
        y_mag = inner @ awd.T
        y = (a * u) @ wd[e].T
        y_c = gam(inter) * y_mag + in_c @ awd.T  # the down GEMM over I
        y_d = in_d @ awd.T + y.abs() + tr  # + the expert output's rounding
        out_c[sel] = aw * (y_c + gam(k) * y_mag)
        out_d[sel] = aw * (y_d + y.abs() + tr)  # + each weighted term's rounding
        # backward for |dy| <= 1: d_inner = w·down[e]ᵀ·dy, of magnitude |w|·Σ_H |down[e]|
        col = awd.sum(0)[None, :]
        di = aw * col
        di_c, di_d = gam(h) * di, 2 * (di + tr)  # its dot product; w·dy and d_inner rounded
        # d_w = <dy, Y> over H, or <down[e]ᵀ·dy, act(g)·u> over I: both paths' bounds
        dw_c[sel] = gam(h) * y_mag.sum(1) + y_c.sum(1) + ((gam(inter) + gam(h)) * col * inner + col * in_c).sum(1)
        dw_d[sel] = y_d.sum(1) + (col * in_d).sum(1)
        dg_m, du_m = di * au * asl, di * aa  # |d_gate|, |d_up|
        dg_c = di_c * au * asl + di * u_c * asl + di * au * g_c + dg_m * (6 + g.abs())
        dg_d = di_d * au * asl + di * u_d * asl + di * au * g_d + dg_m + tr
        du_c = di_c * aa + di * asl * g_c + du_m * (6 + g.abs())
        du_d = di_d * aa + di * asl * g_d + du_m + tr
        dxe_m = dg_m @ awg + du_m @ awu
        dx_c[sel] = (gam(2 * inter) + gam(k)) * dxe_m + dg_c @ awg + du_c @ awu
        dx_d[sel] = dg_d @ awg + du_d @ awu + dxe_m + tr  # + each pair's term rounded
        n_e = sel.numel()
        dgu_c[e, :inter] = gam(n_e) * (dg_m.T @ ax) + dg_c.T @ ax
        dgu_c[e, inter:] = gam(n_e) * (du_m.T @ ax) + du_c.T @ ax
        dgu_d[e, :inter], dgu_d[e, inter:] = dg_d.T @ ax, du_d.T @ ax
        hw = (aw * inner).sum(0)  # Σ |w·act(g)·u| over the expert's pairs, for each of I
        dd_c[e] = (gam(n_e) * hw + (aw * in_c).sum(0))[None, :]
        dd_d[e] = ((aw * in_d).sum(0) + 2 * hw + 2 * n_e * tr)[None, :]  # + w·act(g)·u rounded

    return _old_bounds(top_k_index, dt, (out_c, out_d), (dx_c, dx_d), (dw_c, dw_d), ((dgu_c, dgu_d), (dd_c, dd_d)))


def _old_error_model_gpt_oss(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    alpha: float = gpt_oss_op.ALPHA,
    limit: float = gpt_oss_op.LIMIT,
) -> Bounds:
    dt = hidden.dtype
    t, h = hidden.shape
    k = top_k_index.shape[1]
    inter = gate_up_proj.shape[2] // 2
    a_ = abs(float(alpha))
    gam = _moe.gamma
    tr = _moe.subnormal_units(dt)
    x, w, expert, token = _moe.pairs(hidden, top_k_index, top_k_weights)
    w1, b1 = gate_up_proj.detach().double(), gate_up_proj_bias.detach().double()
    w2, b2 = down_proj.detach().double(), down_proj_bias.detach().double()
    z = dict(device=x.device, dtype=torch.float64)
    out_c, out_d = torch.zeros(t * k, h, **z), torch.zeros(t * k, h, **z)
    dx_c, dx_d = torch.zeros(t * k, h, **z), torch.zeros(t * k, h, **z)
    dw_c, dw_d = torch.zeros(t * k, **z), torch.zeros(t * k, **z)
    d1_c, d1_d = torch.zeros_like(w1), torch.zeros_like(w1)
    db1_c, db1_d = torch.zeros_like(b1), torch.zeros_like(b1)
    d2_c, d2_d = torch.zeros_like(w2), torch.zeros_like(w2)
    db2_c, db2_d = torch.zeros_like(b2), torch.zeros_like(b2)
    for e, sel in _moe.by_expert(expert):
        xe, aw = x[token[sel]], w[sel].abs()[:, None]
        ax = xe.abs()
        a1, a2 = w1[e].abs(), w2[e].abs()  # [H, 2I], [I, H]
        gu = xe @ w1[e] + b1[e]
        m1 = ax @ a1 + b1[e].abs()  # |x|·|W| + |b| per pre-activation
        gu_c, gu_d = gam(h) * m1 + b1[e].abs(), m1 + tr  # its dot product and bias add; rounded
        gate, up = gu[:, 0::2], gu[:, 1::2]
        g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
        glu = g * torch.sigmoid(alpha * g)
        inner = (u + 1) * glu
        ag, au1, aglu, ainner = g.abs(), u.abs() + 1, glu.abs(), inner.abs()
        mask_g, mask_u = (gate <= limit).double(), (up.abs() <= limit).double()
        g_c, u_c, g_d, u_d = gu_c[:, 0::2], gu_c[:, 1::2], gu_d[:, 0::2], gu_d[:, 1::2]
        ev = (6 + a_ * ag) * ainner
        in_c = au1 * _SLOPE * g_c + aglu * u_c + ev
        in_d = au1 * _SLOPE * g_d + aglu * u_d + ainner + tr
        y = inner @ w2[e] + b2[e]
        m2 = ainner @ a2 + b2[e].abs()
        y_c = gam(inter) * m2 + in_c @ a2 + b2[e].abs()
        y_d = in_d @ a2 + m2 + tr
        out_c[sel] = aw * (y_c + gam(k) * m2)
        out_d[sel] = aw * (y_d + y.abs() + tr)
        # backward for |dy| <= 1: d_y = w·dy; d_inner = W2[e]·(w·dy), of magnitude |w|·Σ_H |W2[e]|
        n_e = sel.numel()
        sw = aw.sum()
        db2_c[e], db2_d[e] = gam(n_e) * sw, 2 * sw + 2 * n_e * tr
        col = a2.sum(1)[None, :]  # [1, I]
        di = aw * col
        di_c, di_d = gam(h) * di, 2 * (di + tr)
        dw_c[sel] = gam(h) * m2.sum(1) + y_c.sum(1) + ((gam(inter) + gam(h)) * col * ainner + col * in_c).sum(1)
        dw_d[sel] = y_d.sum(1) + (col * in_d).sum(1)
        slope = au1 * _SLOPE
        dg_m, du_m = di * slope * mask_g, di * aglu * mask_u
        dg_c = di_c * slope + di * u_c * _SLOPE + di * au1 * _CURVE * a_ * g_c + dg_m * (6 + a_ * ag)
        dg_d = di_d * slope + di * u_d * _SLOPE + di * au1 * _CURVE * a_ * g_d + dg_m + tr
        du_c = di_c * aglu + di * _SLOPE * g_c + du_m * (6 + a_ * ag)
        du_d = di_d * aglu + di * _SLOPE * g_d + du_m + tr
        dgu_m, dgu_c, dgu_d = (torch.stack((a, b), -1).flatten(-2) for a, b in ((dg_m, du_m), (dg_c, du_c), (dg_d, du_d)))
        dxe_m = dgu_m @ a1.T
        dx_c[sel] = (gam(2 * inter) + gam(k)) * dxe_m + dgu_c @ a1.T
        dx_d[sel] = dgu_d @ a1.T + dxe_m + tr
        d1_c[e] = gam(n_e) * (ax.T @ dgu_m) + ax.T @ dgu_c
        d1_d[e] = ax.T @ dgu_d
        db1_c[e] = gam(n_e) * dgu_m.sum(0) + dgu_c.sum(0)
        db1_d[e] = dgu_d.sum(0)
        hw = (aw * ainner).sum(0)  # [I]
        d2_c[e] = (gam(n_e) * hw + (aw * in_c).sum(0))[:, None]
        d2_d[e] = ((aw * in_d).sum(0) + 2 * hw + 2 * n_e * tr)[:, None]

    grads = ((d1_c, d1_d), (db1_c, db1_d), (d2_c, d2_d), (db2_c, db2_d))
    return _old_bounds(top_k_index, dt, (out_c, out_d), (dx_c, dx_d), (dw_c, dw_d), grads)


def _fields(b: Bounds) -> dict[str, float]:
    models: dict[str, ErrorModel] = {f"out{i}": m for i, m in enumerate(b.outputs)}
    models.update({f"grad{i}": m for i, m in b.grads.items()})
    return {f"{name}.{f}": getattr(m, f) for name, m in models.items() for f in ("cancel", "rounds_abs", "ops", "scale")} | {
        f"{name}.inter": m.inter for name, m in models.items()
    }


def _same(new: Bounds, old: Bounds, label: str) -> None:
    a, b = _fields(new), _fields(old)
    assert a.keys() == b.keys(), label
    for key in a:
        if isinstance(a[key], float):
            assert a[key] == pytest.approx(b[key], rel=1e-12, abs=0), f"{label}: {key}"
        else:
            assert a[key] == b[key], f"{label}: {key}"


def _large_cases(o, dtype: torch.dtype):
    """Several chunks per expert (with CHUNK_ROWS small), k = 3, and a token naming one expert twice."""
    torch.manual_seed(0)
    c = o.example((300, 64, 96, 6, 3), dtype, "cpu")
    hidden, index, weights, *params = c.args
    twice = index.clone()
    twice[::7, 1] = twice[::7, 0]
    return [c, type(c)(c.label + "-twice", (hidden, twice, weights, *params), c.kwargs)]


OPS = [(op, _old_error_model), (gpt_oss_op, _old_error_model_gpt_oss)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("o, old", OPS, ids=["moe_experts", "gpt_oss"])
def test_streamed_error_model_matches_the_whole_tensor_one(monkeypatch, o, old, dtype):
    for c in o.cases("cpu", dtype):
        _same(o.error_model(*c.args, **c.kwargs), old(*c.args, **c.kwargs), c.label)
    monkeypatch.setattr(_moe, "CHUNK_ROWS", 32)  # ~100 pairs per expert: 3-4 chunks each
    for c in _large_cases(o, dtype):
        _same(o.error_model(*c.args, **c.kwargs), old(*c.args, **c.kwargs), c.label)


class _LargestOutput(TorchDispatchMode):
    """Records the most elements of any tensor an op allocates (views and in-place results, which
    share an argument's storage, allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("o, old", OPS, ids=["moe_experts", "gpt_oss"])
def test_error_model_memory_is_one_expert_and_a_chunk(monkeypatch, o, old):
    """No tensor larger than one expert's weights, a chunk of rows or [T, H]: never every
    expert's weights (E = 8) in float64, nor a bound tensor of their shape."""
    monkeypatch.setattr(_moe, "CHUNK_ROWS", 16)
    t, h, inter, n_experts, k = 96, 24, 40, 8, 2
    c = o.example((t, h, inter, n_experts, k), torch.float32, "cpu")
    limit = max(3 * inter * h, 16 * max(h, 2 * inter), t * h)
    with _LargestOutput() as mode:
        o.error_model(*c.args, **c.kwargs)
    assert 0 < mode.most <= limit
    with _LargestOutput() as mode:  # the whole-tensor model's float64 weights: E times that
        old(*c.args, **c.kwargs)
    assert mode.most > limit
