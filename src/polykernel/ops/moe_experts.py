"""``moe.moe_experts``: the routed experts of a mixture-of-experts layer, in transformers' layout.

``hidden [T, H]`` (T tokens), ``top_k_index [T, k]`` (int64/int32, each in ``[0, E)``),
``top_k_weights [T, k]`` (hidden's dtype or fp32), ``gate_up_proj [E, 2I, H]`` (each expert's
gate rows first, then its up rows), ``down_proj [E, H, I]``, all on one device; the projections
have hidden's dtype. Per token::

    out[t] = Σ_j w[t, j] · down[e] @ (act(gate[e] @ x[t]) ⊙ (up[e] @ x[t])),   e = index[t, j]

This is ``Qwen3MoeExperts``/``MixtralExperts`` (and DeepSeek-V3's, whose fp32 routing weights
are accepted as they are). ``activation`` is ``"silu"`` (SwiGLU experts), ``"gelu"`` (erf) or
``"gelu_tanh"``. A token may name one expert twice: both terms count (a sum). Gradients flow to
hidden, top_k_weights and both projections; the output has hidden's dtype.

Precision: the semantics are exact math; impls compute the projections as GEMMs in the inputs'
dtype with fp32 accumulation (fp64 stays fp64), the activation and the weighted sum in fp32. The
error model lets them round the intermediates (gate/up, the activation's product, each expert's
output) to the inputs' dtype once each, as GEMMs with 16-bit operands must.

Not here: gpt-oss's experts (interleaved gate/up columns, transposed ``[E, H, 2I]`` weights with
biases, a clamped activation); transformers' expert-parallel sentinel (an index equal to E meaning
"not on this rank") is an error here, as is any index outside ``[0, E)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, Op
from . import _checks as check
from . import _moe
from ._moe import INDEX_DTYPES as INDEX_DTYPES
from ._moe import check_routing as check_routing

OP_ID = "moe.moe_experts"
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def activate(g: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(g)`` for one of :data:`ACTIVATIONS` (torch's own functions)."""
    if activation == "silu":
        return F.silu(g)
    return F.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")


def reference(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """The semantics, in plain torch: each expert applied to the tokens routed to it (the others
    masked to zero, whose output is exactly zero), scaled by its routing weight per token.

    The GEMMs run in the inputs' dtype (fp64 for fp64), the rest in fp32. Every expert sees all T
    rows, so this costs E/k times the routed work; it keeps shapes independent of the routing
    (``torch.compile`` traces it) and involves no sort."""
    t, h = hidden.shape
    n_experts, two_i, _ = gate_up_proj.shape
    acc = torch.promote_types(torch.promote_types(hidden.dtype, top_k_weights.dtype), torch.float32)
    weights = top_k_weights.to(acc)
    out = torch.zeros((t, h), dtype=acc, device=hidden.device)
    for e in range(n_experts):
        hit = top_k_index == e  # [T, k]
        routed = hit.any(-1, keepdim=True)
        # selects, not products with 0: a NaN/inf in expert e's weights, or in a routing weight
        # of another slot, reaches only the tokens routed to e (and their gradients), as in the
        # impls, which never compute the other pairs
        scale = torch.where(hit, weights, 0).sum(-1, keepdim=True)  # Σ_j w[t, j] over the slots naming e
        x = torch.where(routed, hidden, 0)
        gate, up = F.linear(x, gate_up_proj[e]).to(acc).split(two_i // 2, dim=-1)
        inner = (activate(gate, activation) * up).to(hidden.dtype)
        out = out + scale * torch.where(routed, F.linear(inner, down_proj[e]).to(acc), 0)
    return out.to(hidden.dtype)


def validate(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
) -> None:
    """Every check, before any kernel; on the CPU also the index values (see ``moe_experts``)."""
    h = _moe.check_hidden(OP_ID, hidden)
    check.tensor(OP_ID, "gate_up_proj", gate_up_proj)
    check.floating(OP_ID, "gate_up_proj", gate_up_proj)
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != h or gate_up_proj.shape[1] % 2 or 0 in gate_up_proj.shape[:2]:
        raise check.OpArgumentError(
            OP_ID, "gate_up_proj", f"expected [E, 2I, H] with E, I >= 1 and H = {h} (hidden's last dim), got {tuple(gate_up_proj.shape)}"
        )
    n_experts, inter = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    check.tensor(OP_ID, "down_proj", down_proj)
    check.floating(OP_ID, "down_proj", down_proj)
    if down_proj.dim() != 3 or tuple(down_proj.shape) != (n_experts, h, inter):
        raise check.OpArgumentError(
            OP_ID,
            "down_proj",
            f"expected [E, H, I] = ({n_experts}, {h}, {inter}) to match gate_up_proj {tuple(gate_up_proj.shape)} and hidden, "
            f"got {tuple(down_proj.shape)}",
        )
    _moe.check_like_hidden(OP_ID, hidden, (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)))
    check_routing(OP_ID, hidden, top_k_index, top_k_weights, n_experts)
    check.choice(OP_ID, "activation", activation, ACTIVATIONS)


def _key(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str = "silu",
) -> tuple:
    """The argument class. It holds everything validity depends on except the index values (the
    sizes, the dtypes, the activation, and whether the shapes, dtypes and devices agree, as one
    flag), so `validate` runs once per class on the memo miss; the CPU's index values are checked
    per call by the public function. The guard pins every tensor's whole shape (the flag relates
    them), so a repeat hits without comparing shapes in Python; another T takes the slow path
    once (a memo hit) and gets its own guard."""
    h = hidden.shape[1]
    e, two_i, h2 = gate_up_proj.shape
    agree = (
        h2 == h
        and down_proj.shape == (e, h, two_i // 2)
        and _moe.routing_agrees(hidden, top_k_index, top_k_weights)
        and gate_up_proj.dtype == down_proj.dtype == hidden.dtype
        and hidden.device == top_k_index.device == top_k_weights.device == gate_up_proj.device == down_proj.device
    )
    needs_grad = check.needs_grad(hidden, top_k_weights, gate_up_proj, down_proj)
    return (
        hidden.device,
        hidden.dtype,
        needs_grad,
        h,
        two_i // 2,
        e,
        top_k_index.shape[1],
        activation,
        top_k_index.dtype,
        top_k_weights.dtype,
        agree,
    )


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activation: str = "silu",
    impl: str | None = None,
) -> torch.Tensor:
    """The routed experts: ``Σ_j w[t, j] · down[e](act(gate[e]·x) ⊙ up[e]·x)``, ``e = index[t, j]``.

    >>> import torch, polykernel
    >>> x = torch.randn(6, 16)
    >>> weights, index = polykernel.moe_router(torch.randn(6, 4), 2)
    >>> gate_up, down = torch.randn(4, 2 * 32, 16) / 4, torch.randn(4, 16, 32) / 6
    >>> polykernel.moe_experts(x, index, weights, gate_up, down).shape
    torch.Size([6, 16])
    """
    # validity depends on the index (compiled: the trace validates the arguments, the custom op the values)
    if (not isinstance(top_k_index, torch.Tensor) or top_k_index.is_cpu) and not torch.compiler.is_compiling():
        validate(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)  # values there: every call
    return _dispatch(impl, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)  # _op.dispatch; see _key


def flops(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    *_: object,
    backward: bool = False,
) -> int:
    """Matmul FLOPs of the routed work: per token-expert pair 2·H·2I (gate/up) + 2·I·H (down), so
    6·S·H·I forward (S = T·k pairs); the backward's dX and dW GEMMs double it: 18·S·H·I fwd+bwd."""
    return _moe.routed_flops(top_k_index, hidden.shape[-1], gate_up_proj.shape[1] // 2, backward)


def bytes_moved(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *_: object,
    backward: bool = False,
) -> int:
    """Fewest bytes: read hidden and the projections, write the output; the backward reads them
    again with the cotangent and writes dX and both dW. The op is matmul-bound (rate it by
    ``flops``: 6·S·H·I forward, 18·S·H·I fwd+bwd), not by these bytes."""
    return _moe.routed_bytes(hidden, (gate_up_proj, down_proj), backward)


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# A chain of GEMMs. Each dot product of n terms computed in fp32 is off by λ·√n·u32 of the sum of
# its terms' magnitudes (|x|·|W|, not |x·W|: they cancel), and an intermediate an impl may round
# to the inputs' dtype (gate/up, act(g)·u, each expert's output, each weighted term of the sum
# over k) adds u_d of its own magnitude. These errors propagate through the activation (by
# |act'|, |act''| <= 1 for silu and both gelus; evaluating act costs (6 + |g|)·u32: an exp whose
# argument carries |g|·u32) and the next GEMM (by the magnitudes of its other operand). The bound
# is computed per token-expert pair in float64, from the arguments, for cotangents |dy| <= 1, in
# two parts: the u32 terms and the u_d terms (``cancel``, ``rounds_abs``, scale 1), each the
# maximum over the output; the result's own rounding is ``rounds``. The per-expert dW sums run
# over that expert's n_e pairs; dX sums 2I terms per pair, then k pairs.
def _act_and_slope(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        gg = g.detach().requires_grad_()
        a = activate(gg, activation)
        (slope,) = torch.autograd.grad(a.sum(), gg)
    return a.detach(), slope


def error_model(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str = "silu",
) -> Bounds:
    dt = hidden.dtype
    h = hidden.shape[1]
    k = top_k_index.shape[1]
    inter = gate_up_proj.shape[1] // 2
    gam = _moe.gamma
    # a rounding to the dtype is off by u_d·|v|, or by up to half the smallest subnormal: in
    # units of u_d, |v| + tr
    tr = _moe.subnormal_units(dt)
    x, w, expert, token = _moe.pairs(hidden, top_k_index, top_k_weights)
    # (u32 part, u_d part) of each bound; one expert's weights in float64 at a time, its pairs in
    # chunks of rows (Mixtral's all-expert float64 copies and bound tensors would be ~35 GB)
    tally = _moe.Tally(x, k, 2)
    for e, sel in _moe.by_expert(expert):
        wg, wu = gate_up_proj.detach()[e, :inter].double(), gate_up_proj.detach()[e, inter:].double()
        wde = down_proj.detach()[e].double()
        awg, awu, awd = wg.abs(), wu.abs(), wde.abs()
        n_e = sel.numel()
        # backward for |dy| <= 1: d_inner = w·down[e]ᵀ·dy, of magnitude |w|·Σ_H |down[e]|
        col = awd.sum(0)[None, :]
        # the parameter gradients' sums over the expert's pairs, gathered over the chunks
        dg_c, du_c, dg_d, du_d = (torch.zeros_like(wg) for _ in range(4))
        hw, hw_c, hw_d = (torch.zeros(inter, dtype=torch.float64, device=x.device) for _ in range(3))
        for rows in _moe.chunks(sel):
            xe, aw = x[token[rows]], w[rows].abs()[:, None]
            ax = xe.abs()
            g, u = xe @ wg.T, xe @ wu.T
            g_c, u_c = gam(h) * (ax @ awg.T), gam(h) * (ax @ awu.T)  # their dot products over H
            g_d, u_d = g.abs() + tr, u.abs() + tr  # rounded to the dtype
            a, slope = _act_and_slope(g, activation)
            aa, asl, au = a.abs(), slope.abs(), u.abs()
            inner = aa * au  # |act(g)·u|
            ev = (6 + g.abs()) * inner  # evaluating act
            in_c = asl * au * g_c + aa * u_c + ev
            in_d = asl * au * g_d + aa * u_d + inner + tr  # + its own rounding
            y_mag = inner @ awd.T
            y = (a * u) @ wde.T
            y_c = gam(inter) * y_mag + in_c @ awd.T  # the down GEMM over I
            y_d = in_d @ awd.T + y.abs() + tr  # + the expert output's rounding
            out = aw * (y_c + gam(k) * y_mag), aw * (y_d + y.abs() + tr)  # + each weighted term's rounding
            di = aw * col
            di_c, di_d = gam(h) * di, 2 * (di + tr)  # its dot product; w·dy and d_inner rounded
            # d_w = <dy, Y> over H, or <down[e]ᵀ·dy, act(g)·u> over I: both paths' bounds
            dw_c = gam(h) * y_mag.sum(1) + y_c.sum(1) + ((gam(inter) + gam(h)) * col * inner + col * in_c).sum(1)
            dw_d = y_d.sum(1) + (col * in_d).sum(1)
            dg_m, du_m = di * au * asl, di * aa  # |d_gate|, |d_up|
            dgr_c = di_c * au * asl + di * u_c * asl + di * au * g_c + dg_m * (6 + g.abs())
            dgr_d = di_d * au * asl + di * u_d * asl + di * au * g_d + dg_m + tr
            dur_c = di_c * aa + di * asl * g_c + du_m * (6 + g.abs())
            dur_d = di_d * aa + di * asl * g_d + du_m + tr
            dxe_m = dg_m @ awg + du_m @ awu
            dx = (gam(2 * inter) + gam(k)) * dxe_m + dgr_c @ awg + dur_c @ awu, dgr_d @ awg + dur_d @ awu + dxe_m + tr
            tally.pairs(rows, out, dx, (dw_c, dw_d))  # dx: + each pair's term rounded
            dg_c += (gam(n_e) * dg_m + dgr_c).T @ ax
            du_c += (gam(n_e) * du_m + dur_c).T @ ax
            dg_d += dgr_d.T @ ax
            du_d += dur_d.T @ ax
            hw += (aw * inner).sum(0)  # Σ |w·act(g)·u| over the expert's pairs, for each of I
            hw_c += (aw * in_c).sum(0)
            hw_d += (aw * in_d).sum(0)
        tally.param(0, dg_c, dg_d)  # gate_up_proj[e]'s gate rows, then its up rows
        tally.param(0, du_c, du_d)
        del dg_c, du_c, dg_d, du_d
        # d down[e] is the same for each of its H rows: [I] expanded (an empty H, no bound)
        dd_c, dd_d = gam(n_e) * hw + hw_c, hw_d + 2 * hw + 2 * n_e * tr  # + w·act(g)·u rounded
        tally.param(1, dd_c.expand(h, inter), dd_d.expand(h, inter))
    return tally.bounds(dt)


def _projections(n_experts: int, h: int, inter: int, device: torch.device | str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up_proj [E, 2I, H] and down_proj [E, H, I], scaled so each GEMM's output is ~unit."""
    gate_up = (torch.randn(n_experts, 2 * inter, h, device=device) / h**0.5).to(dtype)
    down = (torch.randn(n_experts, h, inter, device=device) / inter**0.5).to(dtype)
    return gate_up, down


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """``shape`` = (T, H, I, E, k), trailing sizes optional (I = H, E = 4, k = 2): random tokens,
    a softmax top-k routing, random experts."""
    return _moe.example(shape, dtype, device, requires_grad, _projections)


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward routings and layouts, sized for the CPU interpreter unless ``large``."""

    def case(label: str, t: int, h: int, inter: int, n_experts: int, k: int, index: torch.Tensor | None = None, **kw: object) -> Case:
        hidden, index, weights = _moe.routed(t, h, n_experts, k, index, device, dtype)
        gate_up, down = _projections(n_experts, h, inter, device, dtype)
        args = (hidden.requires_grad_(), index, weights.requires_grad_(), gate_up.requires_grad_(), down.requires_grad_())
        return Case(label, args, dict(kw))

    base = (13, 24, 40, 5, 2)
    out = [
        case("13x24x40-E5-k2", *base),
        case("13x24x40-E5-k2-gelu", *base, activation="gelu"),
        case("13x24x40-E5-k2-gelu_tanh", *base, activation="gelu_tanh"),
        case("6x16x24-E1-k1", 6, 16, 24, 1, 1),
        *(case(*spec) for spec in _moe.awkward_routings()),
        case("9x17x23-E3-k2-odd", 9, 17, 23, 3, 2),
        _moe.int32_fp32_weights(case("13x24x40-E5-k2-int32-fp32weights", *base)),
    ]
    # strided: hidden a column slice, the index and weights every other column, gate_up transposed
    t, h, inter, n_experts, k = 7, 24, 40, 5, 2
    wide = torch.randn(t, 2 * h, device=device).to(dtype)[:, ::2].requires_grad_()
    routed, weights = _moe.routing(t, 2 * k, n_experts, device, dtype)
    gate_up, down = _projections(n_experts, h, inter, device, dtype)
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    out.append(Case("7x24x40-E5-k2-strided", (wide, routed[:, ::2], weights[:, ::2].requires_grad_(), gate_up_t, down.requires_grad_())))
    c = case("8x24x40-E4-k2-wide-range", 8, 24, 40, 4, 2)
    hidden, index, weights, gate_up, down = c.args
    out.append(Case(c.label, ((8 * hidden.detach()).requires_grad_(), index, weights, gate_up, down)))
    if large:
        out += [
            case("2048x2048x768-E128-k8", 2048, 2048, 768, 128, 8),
            case("1024x4096x14336-E8-k2", 1024, 4096, 14336, 8, 2),
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
        "activation",
        "index_dtype",
        "weights_dtype",
        "args_match",
    ),
    key=_key,
    guard=(SHAPE, SHAPE, SHAPE, SHAPE, SHAPE, None),
    default_key=lambda device, dtype: (device, dtype, False, None, None, None, None, "silu", torch.int64, dtype, True),
    validate=validate,
    reference=reference,
    error_model=error_model,
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # outputs, dtypes, compile_mode "ours" (the compiled backward recomputes the forward: no
    # split yet) and the DTensor layout: the MoE ops' shared facts
    **_moe.DECLARATION,
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
