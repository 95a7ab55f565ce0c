"""``moe.moe_experts_gpt_oss``: the routed experts of a mixture-of-experts layer, in gpt-oss's layout.

``hidden [T, H]``, ``top_k_index``/``top_k_weights [T, k]`` as in ``moe_experts``;
``gate_up_proj [E, H, 2I]`` (stored transposed: ``x @ gate_up_proj[e]``) with gate and up
*interleaved* by column (gate = columns 0, 2, 4..., up = 1, 3, 5...), ``gate_up_proj_bias
[E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``, all of hidden's dtype. Per token::

    gu = x @ gate_up_proj[e] + gate_up_proj_bias[e];  gate, up = gu[0::2], gu[1::2]
    g = min(gate, limit);  u = clamp(up, -limit, limit)
    out[t] = Σ_j w[t, j] · ((u + 1) · g·σ(alpha·g)) @ down_proj[e] + down_proj_bias[e]),  e = index[t, j]

This is transformers' ``GptOssExperts`` (``alpha`` = ``swiglu_alpha``, 1.702; ``limit`` =
``swiglu_limit``, 7.0). The clamps pass no gradient past the limit (torch's ``clamp``: the
gradient flows where ``gate <= limit`` and ``-limit <= up <= limit``). Gradients flow to hidden,
top_k_weights, both projections and both biases; the output has hidden's dtype.

A second op rather than options of ``moe_experts``: the layout, the biases and the activation all
differ, and the signature (four parameter tensors, alpha and limit) would make every option of the
other meaningless for the other. It shares ``moe_experts``' routing checks and the expert sort.

Precision as ``moe_experts``: GEMMs in the inputs' dtype with fp32 accumulation (fp64 stays fp64),
biases, activation and the weighted sum in fp32; impls may round gate/up, the activation's output
and each expert's GEMM output to the dtype once each.
"""

from __future__ import annotations

import torch

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, Op
from . import _checks as check
from . import _moe

OP_ID = "moe.moe_experts_gpt_oss"
ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's swiglu_alpha and swiglu_limit


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation on interleaved ``[..., 2I]`` pre-activations -> ``[..., I]``, as
    ``GptOssExperts._apply_gate`` computes it."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def reference(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    alpha: float = ALPHA,
    limit: float = LIMIT,
) -> torch.Tensor:
    """The semantics, in plain torch: each expert applied to every token (masked to zero input),
    its output scaled by the token's summed routing weight for it (zero where not routed). GEMMs
    in the inputs' dtype (fp64 for fp64), the rest in fp32; shapes independent of the routing."""
    t, h = hidden.shape
    acc = torch.promote_types(torch.promote_types(hidden.dtype, top_k_weights.dtype), torch.float32)
    weights = top_k_weights.to(acc)
    out = torch.zeros((t, h), dtype=acc, device=hidden.device)
    for e in range(gate_up_proj.shape[0]):
        hit = top_k_index == e
        routed = hit.any(-1, keepdim=True)
        # selects, not products with 0: expert e's NaN/inf reaches only its tokens (moe_experts')
        scale = torch.where(hit, weights, 0).sum(-1, keepdim=True)
        x = torch.where(routed, hidden, 0)
        gate_up = (x @ gate_up_proj[e]).to(acc) + gate_up_proj_bias[e].to(acc)
        inner = clamped_swiglu(gate_up, alpha, limit).to(hidden.dtype)
        out = out + scale * torch.where(routed, (inner @ down_proj[e]).to(acc) + down_proj_bias[e].to(acc), 0)
    return out.to(hidden.dtype)


def validate(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> None:
    """Every check, before any kernel; on the CPU also the index values."""
    h = _moe.check_hidden(OP_ID, hidden)
    check.tensor(OP_ID, "gate_up_proj", gate_up_proj)
    check.floating(OP_ID, "gate_up_proj", gate_up_proj)
    if (
        gate_up_proj.dim() != 3
        or gate_up_proj.shape[1] != h
        or gate_up_proj.shape[2] % 2
        or 0 in (gate_up_proj.shape[0], gate_up_proj.shape[2])
    ):
        raise check.OpArgumentError(
            OP_ID,
            "gate_up_proj",
            f"expected [E, H, 2I] with E, I >= 1 and H = {h} (hidden's last dim; gpt-oss stores it transposed), "
            f"got {tuple(gate_up_proj.shape)}",
        )
    n_experts, inter = gate_up_proj.shape[0], gate_up_proj.shape[2] // 2
    expected = {
        "gate_up_proj_bias": (n_experts, 2 * inter),
        "down_proj": (n_experts, inter, h),
        "down_proj_bias": (n_experts, h),
    }
    for name, tensor in (("gate_up_proj_bias", gate_up_proj_bias), ("down_proj", down_proj), ("down_proj_bias", down_proj_bias)):
        check.tensor(OP_ID, name, tensor)
        check.floating(OP_ID, name, tensor)
        if tuple(tensor.shape) != expected[name]:
            raise check.OpArgumentError(
                OP_ID,
                name,
                f"expected {expected[name]} to match gate_up_proj {tuple(gate_up_proj.shape)} and hidden, got {tuple(tensor.shape)}",
            )
    _moe.check_like_hidden(OP_ID, hidden, (("gate_up_proj", gate_up_proj), *zip(expected, (gate_up_proj_bias, down_proj, down_proj_bias))))
    _moe.check_routing(OP_ID, hidden, top_k_index, top_k_weights, n_experts)
    check.finite_float(OP_ID, "alpha", alpha)
    check.positive_float(OP_ID, "limit", limit)
    if not check.is_finite(float(limit)):  # not math.isinf: Dynamo traces this on a symbolic float (dynamic=True)
        raise check.OpArgumentError(OP_ID, "limit", f"expected a finite limit > 0, got {check.shown(limit)}")


def _key(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    alpha: float = ALPHA,
    limit: float = LIMIT,
) -> tuple:
    """The argument class: the sizes, dtypes, alpha and limit, and whether every shape, dtype and
    device agrees (one flag), so `validate` runs once per class; the CPU's index values are
    checked per call by the public function. The guard pins every tensor's whole shape."""
    h = hidden.shape[1]
    e, h2, two_i = gate_up_proj.shape
    inter = two_i // 2
    tensors = (hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias)
    agree = (
        h2 == h
        and gate_up_proj_bias.shape == (e, two_i)
        and down_proj.shape == (e, inter, h)
        and down_proj_bias.shape == (e, h)
        and _moe.routing_agrees(hidden, top_k_index, top_k_weights)
        and all(p.dtype == hidden.dtype for p in (gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias))
        and all(a.device == hidden.device for a in tensors)
    )
    needs_grad = check.needs_grad(hidden, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias)
    return (
        hidden.device,
        hidden.dtype,
        needs_grad,
        h,
        inter,
        e,
        top_k_index.shape[1],
        alpha,
        limit,
        top_k_index.dtype,
        top_k_weights.dtype,
        agree,
    )


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def moe_experts_gpt_oss(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    *,
    alpha: float = ALPHA,
    limit: float = LIMIT,
    impl: str | None = None,
) -> torch.Tensor:
    """gpt-oss's routed experts: ``Σ_j w[t, j] · (clamped_swiglu(x·Wgu[e] + bgu[e]) · Wd[e] + bd[e])``.

    >>> import torch, polykernel
    >>> x = torch.randn(6, 16)
    >>> weights, index = polykernel.moe_router(torch.randn(6, 4), 2)
    >>> gate_up, down = torch.randn(4, 16, 2 * 32) / 4, torch.randn(4, 32, 16) / 6
    >>> polykernel.moe_experts_gpt_oss(x, index, weights, gate_up, torch.zeros(4, 64), down, torch.zeros(4, 16)).shape
    torch.Size([6, 16])
    """
    args = (hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias, alpha, limit)
    # validity depends on the index values there (compiled: the trace validates the arguments, the custom op the values)
    if (not isinstance(top_k_index, torch.Tensor) or top_k_index.is_cpu) and not torch.compiler.is_compiling():
        validate(*args)
    return _dispatch(impl, *args)


def flops(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    *_: object,
    backward: bool = False,
) -> int:
    """Matmul FLOPs of the routed work, as ``moe_experts``: 6·S·H·I forward, 18·S·H·I fwd+bwd."""
    return _moe.routed_flops(top_k_index, hidden.shape[-1], gate_up_proj.shape[2] // 2, backward)


def bytes_moved(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    *_: object,
    backward: bool = False,
) -> int:
    """Fewest bytes, as ``moe_experts`` (plus the biases). Matmul-bound: rate it by ``flops``."""
    return _moe.routed_bytes(hidden, (gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias), backward)


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# moe_experts' model (ops/moe_experts.py), with the biases' magnitudes added to each GEMM's and
# gpt-oss's activation: inner = (u + 1)·g·σ(αg), whose slope in g is (u + 1)·s(g) with
# s(g) = σ(z) + z·σ(z)(1 - σ(z)), z = αg: |s| <= 1.1 and |s'| <= |α|/2; its slope in u is g·σ(αg); the clamps are
# 1-Lipschitz (the value's error does not grow), and their gradient mask is taken from the exact
# pre-activations (an impl whose rounded gate/up lands across the limit gets the other mask: the
# cases keep every pre-activation away from it). Evaluating σ(αg) costs (6 + α|g|)·u32.
_SLOPE, _CURVE = 1.1, 0.5


def error_model(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    alpha: float = ALPHA,
    limit: float = LIMIT,
) -> Bounds:
    dt = hidden.dtype
    h = hidden.shape[1]
    k = top_k_index.shape[1]
    inter = gate_up_proj.shape[2] // 2
    a_ = abs(float(alpha))
    gam = _moe.gamma
    tr = _moe.subnormal_units(dt)
    x, w, expert, token = _moe.pairs(hidden, top_k_index, top_k_weights)
    # one expert's weights in float64 at a time, its pairs in chunks of rows (as moe_experts')
    tally = _moe.Tally(x, k, 4)
    z = dict(device=x.device, dtype=torch.float64)
    for e, sel in _moe.by_expert(expert):
        w1, b1 = gate_up_proj.detach()[e].double(), gate_up_proj_bias.detach()[e].double()  # [H, 2I], [2I]
        w2, b2 = down_proj.detach()[e].double(), down_proj_bias.detach()[e].double()  # [I, H], [H]
        a1, a2, ab1, ab2 = w1.abs(), w2.abs(), b1.abs(), b2.abs()
        n_e = sel.numel()
        # backward for |dy| <= 1: d_y = w·dy; d_inner = W2[e]·(w·dy), of magnitude |w|·Σ_H |W2[e]|
        col = a2.sum(1)[None, :]  # [1, I]
        # the parameter gradients' sums over the expert's pairs, gathered over the chunks
        d1_c, d1_d = torch.zeros_like(w1), torch.zeros_like(w1)
        db1_c, db1_d = torch.zeros_like(b1), torch.zeros_like(b1)
        sw, hw, hw_c, hw_d = torch.zeros((), **z), torch.zeros(inter, **z), torch.zeros(inter, **z), torch.zeros(inter, **z)
        for rows in _moe.chunks(sel):
            xe, aw = x[token[rows]], w[rows].abs()[:, None]
            ax = xe.abs()
            gu = xe @ w1 + b1
            m1 = ax @ a1 + ab1  # |x|·|W| + |b| per pre-activation
            gu_c, gu_d = gam(h) * m1 + ab1, m1 + tr  # its dot product and bias add; rounded
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
            y = inner @ w2 + b2
            m2 = ainner @ a2 + ab2
            y_c = gam(inter) * m2 + in_c @ a2 + ab2
            y_d = in_d @ a2 + m2 + tr
            out = aw * (y_c + gam(k) * m2), aw * (y_d + y.abs() + tr)
            di = aw * col
            di_c, di_d = gam(h) * di, 2 * (di + tr)
            dw_c = gam(h) * m2.sum(1) + y_c.sum(1) + ((gam(inter) + gam(h)) * col * ainner + col * in_c).sum(1)
            dw_d = y_d.sum(1) + (col * in_d).sum(1)
            slope = au1 * _SLOPE
            dg_m, du_m = di * slope * mask_g, di * aglu * mask_u
            dg_c = di_c * slope + di * u_c * _SLOPE + di * au1 * _CURVE * a_ * g_c + dg_m * (6 + a_ * ag)
            dg_d = di_d * slope + di * u_d * _SLOPE + di * au1 * _CURVE * a_ * g_d + dg_m + tr
            du_c = di_c * aglu + di * _SLOPE * g_c + du_m * (6 + a_ * ag)
            du_d = di_d * aglu + di * _SLOPE * g_d + du_m + tr
            dgu_m, dgu_c, dgu_d = (torch.stack((a, b), -1).flatten(-2) for a, b in ((dg_m, du_m), (dg_c, du_c), (dg_d, du_d)))
            dxe_m = dgu_m @ a1.T
            dx = (gam(2 * inter) + gam(k)) * dxe_m + dgu_c @ a1.T, dgu_d @ a1.T + dxe_m + tr
            tally.pairs(rows, out, dx, (dw_c, dw_d))
            d1_c += ax.T @ (gam(n_e) * dgu_m + dgu_c)
            d1_d += ax.T @ dgu_d
            db1_c += gam(n_e) * dgu_m.sum(0) + dgu_c.sum(0)
            db1_d += dgu_d.sum(0)
            sw += aw.sum()
            hw += (aw * ainner).sum(0)  # [I]
            hw_c += (aw * in_c).sum(0)
            hw_d += (aw * in_d).sum(0)
        tally.param(0, d1_c, d1_d)
        tally.param(1, db1_c, db1_d)
        del d1_c, d1_d
        # d W2[e] is the same for each of its H columns, d b2[e] for each of H: expanded (an
        # empty H, no bound)
        d2_c, d2_d = gam(n_e) * hw + hw_c, hw_d + 2 * hw + 2 * n_e * tr
        tally.param(2, d2_c[:, None].expand(inter, h), d2_d[:, None].expand(inter, h))
        tally.param(3, (gam(n_e) * sw).expand(h), (2 * sw + 2 * n_e * tr).expand(h))
    return tally.bounds(dt)


def _params(n_experts: int, h: int, inter: int, device: torch.device | str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """gate_up_proj [E, H, 2I], its bias, down_proj [E, I, H], its bias: each GEMM's output ~unit."""
    gate_up = (torch.randn(n_experts, h, 2 * inter, device=device) / h**0.5).to(dtype)
    gate_up_bias = (0.5 * torch.randn(n_experts, 2 * inter, device=device)).to(dtype)
    down = (torch.randn(n_experts, inter, h, device=device) / inter**0.5).to(dtype)
    down_bias = (0.5 * torch.randn(n_experts, h, device=device)).to(dtype)
    return gate_up, gate_up_bias, down, down_bias


def _limit_in_a_gap(hidden: torch.Tensor, index: torch.Tensor, params: tuple[torch.Tensor, ...]) -> float:
    """A limit that clamps many pre-activations but lies in the widest gap between them (gate
    values and |up| values, between their median and 95th percentile): no rounding of a GEMM
    moves one across it, so every impl takes the exact result's gradient mask."""
    w1, b1 = params[0].double(), params[1].double()
    x = hidden.double()[torch.arange(hidden.shape[0]).repeat_interleave(index.shape[1])]
    gu = torch.einsum("ph,phn->pn", x, w1[index.reshape(-1)]) + b1[index.reshape(-1)]
    vals = torch.cat((gu[:, 0::2].reshape(-1), gu[:, 1::2].abs().reshape(-1))).sort().values
    lo, hi = int(0.5 * vals.numel()), max(int(0.95 * vals.numel()), int(0.5 * vals.numel()) + 2)
    window = vals[lo:hi]
    gaps = window[1:] - window[:-1]
    i = int(gaps.argmax())
    return float((window[i] + window[i + 1]) / 2)


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """``shape`` = (T, H, I, E, k), trailing sizes optional (I = H, E = 4, k = 2): random tokens,
    a softmax top-k routing, random experts and biases; gpt-oss's alpha and limit."""
    return _moe.example(shape, dtype, device, requires_grad, _params)


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward routings (as ``moe_experts``') and clamping: a limit that clamps many values."""

    def case(
        label: str, t: int, h: int, inter: int, n_experts: int, k: int, index: torch.Tensor | None = None, clamp: bool = False
    ) -> Case:
        hidden, index, weights = _moe.routed(t, h, n_experts, k, index, device, dtype)
        params = _params(n_experts, h, inter, device, dtype)
        kw = {}
        if clamp and t:
            kw["limit"] = _limit_in_a_gap(hidden.cpu(), index.cpu(), tuple(p.cpu() for p in params))
        args = (hidden.requires_grad_(), index, weights.requires_grad_(), *(p.requires_grad_() for p in params))
        return Case(label, args, kw)

    base = (13, 24, 40, 5, 2)
    out = [
        case("13x24x40-E5-k2", *base),
        case("13x24x40-E5-k2-clamped", *base, clamp=True),
        *(case(*spec) for spec in _moe.awkward_routings()),
        case("9x17x23-E3-k2-odd-clamped", 9, 17, 23, 3, 2, clamp=True),
        _moe.int32_fp32_weights(case("13x24x40-E5-k2-int32-fp32weights", *base)),
    ]
    if large:
        out += [
            case("2048x2880x2880-E32-k4", 2048, 2880, 2880, 32, 4),
            *(case(*spec) for spec in _moe.large_routings()),
        ]
    return out


_op = Op(
    OP_ID,
    fields=(
        "device",
        "dtype",
        "needs_grad",
        "hidden_size",
        "intermediate_size",
        "n_experts",
        "top_k",
        "alpha",
        "limit",
        "index_dtype",
        "weights_dtype",
        "args_match",
    ),
    key=_key,
    guard=(SHAPE, SHAPE, SHAPE, SHAPE, SHAPE, SHAPE, SHAPE, None, None),
    default_key=lambda device, dtype: (device, dtype, False, None, None, None, None, ALPHA, LIMIT, torch.int64, dtype, True),
    validate=validate,
    reference=reference,
    error_model=error_model,
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # outputs, dtypes, compile_mode "ours" and the DTensor layout (the biases replicated with
    # the projections): the MoE ops' shared facts
    **_moe.DECLARATION,
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
