"""``loss.fused_linear_jsd``: ``jsd(log_softmax(hs @ Ws.T / t), log_softmax(ht @ Wt.T / t), labels)``
without ever holding either ``[N, V]`` logits (Liger-Kernel's ``LigerFusedLinearJSDLoss``).

``student_hidden`` is ``[..., H]`` with ``student_weight [V, H]`` (one dtype), ``teacher_hidden``
``[..., Ht]`` (the student's leading shape) with ``teacher_weight [V, Ht]`` (one dtype, maybe
another than the student's); ``labels`` ``[...]`` int or None. The logits are computed in fp32
from the inputs' values (an fp32 matmul result, never rounded to the inputs' dtype: JSD's
gradient is a difference of nearly equal distributions, where that rounding would show) and
divided by ``temperature``; then the loss is ``loss.jsd``'s exactly (``beta``, ``ignore_index``,
the mean over scored rows, NaN for none). Gradients for the student's hidden states and
weight only; the teacher takes none.

Impls walk the rows in chunks whose size comes from the problem: a chunk's logits (both fp32)
and its dlogits (the inputs' dtype) stay within ``CHUNK_BYTES`` (512 MiB; ``TORCH_BUDGET``, a quarter of it, for the torch impl, whose
temporaries are a few more fp32 chunks: the finest chunking, which the error model counts on;
rows a multiple of 128 when large, at most N: :func:`chunk_rows`).
When the student needs gradients they are computed during the forward, per chunk
``grad_hidden[chunk] = dlogits @ Ws`` and ``grad_weight += dlogits.T @ hs[chunk]`` (accumulated in
the weight's dtype, one rounding per chunk); the backward scales them by the cotangent (skipped
when it is exactly 1; on the device under CUDA-graph capture), so the graph can be
back-propagated once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.hit_guard import SHAPE
from ..core.op import SUM_LAMBDA, TINY, Bounds, Case, ErrorModel, Op
from . import _autocast
from . import _checks as check
from . import _distill as distill
from ._head_blocks import float64_blocks
from .jsd import reference as _jsd_reference

OP_ID = "loss.fused_linear_jsd"

CHUNK_BYTES = 512 << 20  # one chunk's fp32 student and teacher logits plus its dlogits
TORCH_BUDGET = CHUNK_BYTES // 4  # the torch chunk_fn's share: its temporaries are ~6 more fp32 chunks


def chunk_rows(v: int, elt: int, n: int, budget: int = CHUNK_BYTES) -> int:
    """Rows per chunk: two fp32 logit rows and a dlogits row (``elt`` bytes) per row within
    ``budget``, a multiple of 128 when large (matmul tiles), at most ``n`` (~600 rows at
    V = 128K in bf16: big enough for the matmuls, a fraction of the gradients' own memory)."""
    rows = max(1, budget // (max(v, 1) * (8 + elt)))
    rows = rows - rows % 128 if rows >= 256 else rows
    return max(1, min(rows, n))


def logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``hidden @ weight.T / temperature`` in fp32 (fp64 stays fp64), from the inputs' values."""
    acc = distill.acc_dtype(hidden, weight)
    return F.linear(hidden.to(acc), weight.to(acc)) / temperature


def reference(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The semantics, in plain torch (materializes both ``[N, V]`` logits)."""
    zs = logits(student_hidden, student_weight, temperature)
    zt = logits(teacher_hidden.detach(), teacher_weight.detach(), temperature)
    if labels is not None:  # before log_softmax: its backward would give 0·NaN on an ignored NaN row
        zs, zt = distill.skip_ignored(labels != ignore_index, zs, zt)
    return _jsd_reference(zs.log_softmax(-1), zt.log_softmax(-1), labels, beta, ignore_index)


def _validate_head(name: str, hidden: torch.Tensor, w_name: str, weight: torch.Tensor) -> None:
    check.tensor(OP_ID, name, hidden)
    check.floating(OP_ID, name, hidden)
    check.tensor(OP_ID, w_name, weight)
    check.floating(OP_ID, w_name, weight)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise check.OpArgumentError(
            OP_ID, w_name, f"expected shape (V, {hidden.shape[-1]}) to match {name}'s last dim, got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise check.OpTypeError(OP_ID, w_name, f"expected {name}'s dtype {hidden.dtype}, got {weight.dtype}")
    check.same_device(OP_ID, w_name, weight, name, hidden)


def validate(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None,
    beta: float,
    ignore_index: int,
    temperature: float,
) -> None:
    _validate_head("student_hidden", student_hidden, "student_weight", student_weight)
    if student_weight.shape[0] == 0:
        raise check.OpArgumentError(OP_ID, "student_weight", "expected at least one class (V >= 1), got V = 0")
    _validate_head("teacher_hidden", teacher_hidden, "teacher_weight", teacher_weight)
    if teacher_hidden.shape[:-1] != student_hidden.shape[:-1]:
        raise check.OpArgumentError(
            OP_ID,
            "teacher_hidden",
            f"expected the student's leading shape {tuple(student_hidden.shape[:-1])}, got {tuple(teacher_hidden.shape[:-1])}",
        )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise check.OpArgumentError(
            OP_ID, "teacher_weight", f"expected the student's vocabulary V = {student_weight.shape[0]}, got {teacher_weight.shape[0]}"
        )
    check.same_device(OP_ID, "teacher_hidden", teacher_hidden, "student_hidden", student_hidden)
    distill.validate_labels(OP_ID, labels, student_hidden.shape[:-1], "student_hidden", student_hidden)
    distill.validate_beta(OP_ID, beta)
    check.ignore_index(OP_ID, ignore_index, "labels", labels)
    check.positive_float(OP_ID, "temperature", temperature)
    check.finite_float(OP_ID, "temperature", temperature)


def _head_matches(hidden: torch.Tensor, weight: torch.Tensor, ref: torch.Tensor) -> bool:
    return (
        weight.dim() == 2 and weight.shape[1] == hidden.shape[-1] and weight.dtype == hidden.dtype
        and weight.device == ref.device and hidden.device == ref.device
    )  # fmt: skip


def _key(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
) -> tuple:
    """The argument class. It holds everything validity depends on (the options, both heads'
    dtypes and sizes, labels' class, and whether the weights, the teacher's rows and the labels
    agree with the student's hidden states as one flag), so `validate` runs once per class. The
    guard pins every tensor's whole shape (which the flag relates)."""
    rows = student_hidden.shape[:-1]
    matches = (
        _head_matches(student_hidden, student_weight, student_hidden)
        and _head_matches(teacher_hidden, teacher_weight, student_hidden)
        and teacher_hidden.shape[:-1] == rows and teacher_weight.shape[0] == student_weight.shape[0]
    )  # fmt: skip
    return (
        student_hidden.device,
        student_hidden.dtype,
        check.needs_grad(student_hidden, student_weight),
        student_hidden.shape[-1],
        student_weight.shape[0],
        teacher_hidden.dtype,
        teacher_hidden.shape[-1],
        matches,
        distill.labels_class(labels, rows),
        beta,
        ignore_index,
        temperature,
    )


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def fused_linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    impl: str | None = None,
) -> torch.Tensor:
    """Generalized JSD of the student's and teacher's LM heads, logits never materialized.

    >>> import torch, polykernel
    >>> hs, ws = torch.randn(6, 16), torch.randn(100, 16)
    >>> ht, wt = torch.randn(6, 32), torch.randn(100, 32)
    >>> polykernel.fused_linear_jsd(hs, ws, ht, wt, beta=0.5, temperature=2.0).shape
    torch.Size([])
    """
    args = (student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta, ignore_index, temperature)
    if _any_autocast():  # the heads as F.linear there, every impl alike (ops._autocast)
        return _autocast.dispatch(_op, _dispatch, impl, args)
    return _dispatch(impl, *args)


def flops(
    student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor, *_: object, backward: bool = False
) -> int:
    """Matmul FLOPs: 2·N·V·(H + Ht) forward (both logits); the backward adds dH and dW of the
    student, 4·N·V·H (so 8·N·H·V for fwd+bwd when H = Ht)."""
    n = student_hidden.numel() // max(student_hidden.shape[-1], 1)
    v, h, ht = student_weight.shape[0], student_hidden.shape[-1], teacher_hidden.shape[-1]
    return 2 * n * v * (h + ht) + (4 * n * v * h if backward else 0)


def bytes_moved(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *_: object,
    backward: bool = False,
    **__: object,
) -> int:
    """Fewest bytes: read both hidden states and weights (+ write dH and dW in the backward). The
    op is matmul-bound: rate it by ``flops``, not by these bytes."""
    sizes = [t.numel() * t.element_size() for t in (student_hidden, student_weight, teacher_hidden, teacher_weight)]
    return sum(sizes) + ((sizes[0] + sizes[1]) if backward else 0)


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# First order, every term a bound per element (no cancellation across classes or rows is assumed,
# so another accumulation order or a GPU's correlated roundings stay within it).
# - Logits: fp32 sums over H (Ht) of products of the inputs' values, each off by
#   δ_v <= λ·√H·u32·Zabs_v, Zabs_v = Σ_k |h_k·W_vk| (per element; the reduction length H and the
#   fp32 accumulation are the term's: it holds whatever the order of the sum), then /t.
# - Log-probs x = z/t - lse (y likewise for the teacher): x_v is off by a_v + b, a_v = δ_v/t +
#   u32·(|z_v/t| + |x_v|) its own (the logit's error, the division and the subtraction) and
#   b = Σ_w Q_w·δ_w/t + u32·(3|lse| + max|z/t| + Σ_w Q_w·|x_w| + λ√V + 6) the row's (lse moves by
#   Q·δ to first order; the sum of V exps carries λ√V u32 + a few, their arguments' error).
# - The row's loss Σ_v term(x_v, y_v) moves by Σ_v |dX_v|·(a+b)_v + |dY_v|·(a+b)_v (dX, dY its
#   exact partial derivatives), plus loss.jsd's own fp32 model: ~8 u32 of the terms' magnitudes w
#   (_distill.jsd_weights) and λ·√V u32 of Σ_v |term_v| (the row's sum, mixed signs); the mean over
#   scored rows (each >= 0) is relative (sum_rel).
# - Student dlogits dz = (dX - Q·ΣdX)·c, c = 1/(count·t): dX_v = f(x_v, y_v) elementwise, so dz_v
#   moves by E_v = (|f_x| + Q|ΣdX|)·δx_v + |f_y|·δy_v + Q_v·Σ_w (|f_x|·δx + |f_y|·δy)_w (f_x, f_y the
#   exact second derivatives, in closed form per β branch), plus its own fp32 evaluation, 8 u32 of
#   j (loss.jsd's gradient model: the student part of w, through dX and ΣdX) and λ√V u32 of
#   Q·Σ|dX| (ΣdX's sum over V); then it is rounded to the inputs' dtype (rounds_abs: u(dtype) of
#   |dz|, the term that holds in bf16/fp16).
# - dH = dz·Ws sums over V: scale max|Ws|·c·max_row Σ_v|dz| (the matmul's own λ·√V·u32 of it: V is
#   that reduction's length), the E and j row sums as a multiple of it; dW = dzᵀ·hs sums over rows,
#   likewise with column sums and max|hs|, accumulated in the weight's dtype once per chunk (and
#   once more by the cotangent).
_CLASS_BLOCK = 1 << 14  # classes of a head converted to float64 at a time (the error model's: _head_blocks)


def _logits64(rows: torch.Tensor, weight: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows @ weight.T / temperature`` and ``|rows| @ |weight|.T`` (Zabs) in float64 for float64
    ``rows``, a block of classes at a time."""
    z = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float64, device=rows.device)
    za = torch.empty_like(z)
    ra = rows.abs()
    for s, e, w, _ in float64_blocks(weight, None, _CLASS_BLOCK):
        z[:, s:e] = rows @ w.T
        za[:, s:e] = ra @ w.abs_().T
    return z / temperature, za


def _jsd_derivatives(x: torch.Tensor, y: torch.Tensor, beta: float) -> tuple[torch.Tensor, ...]:
    """Per element (fp64): the row's ∂/∂x and ∂/∂y (dX, dY) and dX's ∂/∂x and ∂/∂y (f_x, f_y), in
    closed form. β = 0: row = P·(Y - X); β = 1: Q·(X - Y); else with L = log(β·P + (1-β)·Q),
    dX = (1-β)·Q·(X - L), dY = β·P·(Y - L). A probability of 0 contributes 0."""
    p, q = y.exp(), x.exp()
    if beta == 0:
        dx, dy, fx, fy = -p, p * (y - x + 1), torch.zeros_like(p), -p
    elif beta == 1:
        dx, dy, fx, fy = q * (x - y + 1), -q, q * (x - y + 2), -q
    else:
        m = torch.maximum(x, y).nan_to_num(neginf=0.0)
        mix = beta * (y - m).exp() + (1 - beta) * (x - m).exp()
        lm = m + mix.log()
        sq = (1 - beta) * (x - m).exp() / mix  # (1-β)·Q/M
        sp = beta * (y - m).exp() / mix  # β·P/M
        dx, dy = (1 - beta) * q * (x - lm), beta * p * (y - lm)
        fx, fy = (1 - beta) * q * (x - lm + 1 - sq), -(1 - beta) * q * sp
    return tuple(torch.where((p == 0) & (q == 0), 0.0, a).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0) for a in (dx, dy, fx, fy))


def _logp_error(z: torch.Tensor, x: torch.Tensor, za: torch.Tensor, h: int, temperature: float, v: int) -> torch.Tensor:
    """Per element: the bound a + b on the fp32 log-probs' error (see the comment above)."""
    u32 = 2.0**-24
    q = x.exp()
    d = SUM_LAMBDA * h**0.5 * u32 * za / temperature
    lse = (z - x).abs().amax(-1, keepdim=True)
    own = d + u32 * (z.abs() + x.abs())
    row = (q * d).sum(-1, keepdim=True) + u32 * (
        3 * lse + z.abs().amax(-1, keepdim=True) + (q * x.abs()).nan_to_num().sum(-1, keepdim=True) + SUM_LAMBDA * v**0.5 + 6
    )
    return (own + row).nan_to_num(posinf=0.0)


def error_model(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
) -> Bounds:
    h, ht, v = student_hidden.shape[-1], teacher_hidden.shape[-1], student_weight.shape[0]
    hs2 = distill.rows_view(student_hidden.detach())
    ht2 = distill.rows_view(teacher_hidden.detach())
    n = hs2.shape[0]
    valid = distill.scored_rows(labels, ignore_index, n)
    count = max(1, int(valid.sum()))
    u32 = 2.0**-24
    t, b = temperature, float(beta)
    lam_v = SUM_LAMBDA * max(v, 1) ** 0.5
    # per row / per class sums over the scored rows, fp64, a row chunk at a time
    w_tot = a_tot = sens_tot = 0.0
    d_row = e_row = j_row = 0.0
    # the sums stay on the heads' device: moving six [rows, V] fp64 blocks to the CPU per chunk
    # (6.4 GB at 1024 x 128256) made most of the large GPU parity tests' time
    dev = student_weight.device
    valid = valid.to(dev)
    d_col, e_col, j_col = (torch.zeros(v, dtype=torch.float64, device=dev) for _ in range(3))
    step = max(1, distill._MODEL_ELEMS // max(v, 1))
    for s in range(0, n, step):
        ok = valid[s : s + step]
        zs, zsa = _logits64(hs2[s : s + step].double(), student_weight, t)
        zt, zta = _logits64(ht2[s : s + step].double(), teacher_weight, t)
        x, y = zs.log_softmax(-1), zt.log_softmax(-1)
        ex, ey = _logp_error(zs, x, zsa, h, t, v), _logp_error(zt, y, zta, ht, t, v)
        wp, wq = distill.jsd_weights(x, y, b)
        dx, dy, fx, fy = _jsd_derivatives(x, y, b)
        q = x.exp()
        ssum = dx.sum(-1, keepdim=True)
        dz = (dx - q * ssum).abs()
        moved = fx.abs() * ex + fy.abs() * ey
        e = moved + q * ssum.abs() * ex + q * moved.sum(-1, keepdim=True) + lam_v * u32 * q * dx.abs().sum(-1, keepdim=True)
        j = wq + q * (x.abs() + 2) * ssum.abs() + q * wq.sum(-1, keepdim=True)
        terms = distill.jsd_terms(x, y, b).abs()
        sens = dx.abs() * ex + dy.abs() * ey
        dz, e, j, wsum, terms, sens = (a[ok] for a in (dz, e, j, wp + wq, terms, sens))
        if dz.numel():
            sums = (wsum.sum(), terms.sum(), sens.sum(), dz.sum(-1).max(), e.sum(-1).max(), j.sum(-1).max())
            w_add, a_add, sens_add, d_max, e_max, j_max = torch.stack(sums).tolist()  # one host sync a chunk
            w_tot, a_tot, sens_tot = w_tot + w_add, a_tot + a_add, sens_tot + sens_add
            d_row, e_row, j_row = max(d_row, d_max), max(e_row, e_max), max(j_row, j_max)
            d_col += dz.sum(0)
            e_col += e.sum(0)
            j_col += j.sum(0)
    k = 1.0 / (count * t)
    # the loss: its sensitivity to the log-probs' errors and loss.jsd's own fp32 model, per scored row
    loss = ErrorModel(ops=4, sum_rel=1, cancel=(sens_tot / u32 + 8 * w_tot) / count, sum_abs=a_tot / count, n=max(v, n), scale=1.0)

    def grad(rounds: int, d: float, e_: float, j_: float, w_max: float, terms: int) -> ErrorModel:
        tiny = TINY.get(student_hidden.dtype, 0.0)
        return ErrorModel(
            rounds=rounds, ops=4, rounds_abs=2, cancel=8 + (e_ / u32 + 8 * j_) / max(d, 1e-300), sum_abs=1, n=max(terms, 1),
            scale=w_max * k * d, inter=student_hidden.dtype, floor=SUM_LAMBDA * terms**0.5 * tiny * w_max,
        )  # fmt: skip

    chunks = max(1, -(-n // chunk_rows(v, student_hidden.element_size(), n, TORCH_BUDGET)))  # the impls' finest chunking
    w_max = student_weight.detach().abs().max().item() if student_weight.numel() else 0.0
    h_max = hs2.abs().max().item() if hs2.numel() else 0.0
    d_hidden = grad(2, d_row, e_row, j_row, w_max, v)
    cols = [c.max().item() if v else 0.0 for c in (d_col, e_col, j_col)]
    d_weight = grad(chunks + 1, *cols, h_max, n)
    return Bounds(outputs=(loss,), grads={0: d_hidden, 1: d_weight})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """``shape`` = (N, H, V): student and teacher heads of hidden size H (unit-variance logits),
    ~5% of the rows ignored; the teacher takes no gradient."""
    n, h, v = shape
    hs = torch.randn(n, h, device=device).to(dtype).requires_grad_(requires_grad)
    ws = (torch.randn(v, h, device=device) / h**0.5).to(dtype).requires_grad_(requires_grad)
    ht = torch.randn(n, h, device=device).to(dtype)
    wt = (torch.randn(v, h, device=device) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), device=device).masked_fill(torch.rand(n, device=device) < 0.05, -100)
    return Case(f"{n}x{h}x{v}", (hs, ws, ht, wt, labels))


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""

    def hid(*shape: int, grad: bool = True, tdtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(shape, device=device).to(tdtype).requires_grad_(grad)

    def w(v: int, h: int, scale: float = 2.0, grad: bool = True, tdtype: torch.dtype = dtype) -> torch.Tensor:
        return (scale * torch.randn(v, h, device=device) / h**0.5).to(tdtype).requires_grad_(grad)

    def lab(v: int, *shape: int, ignored: float = 0.0) -> torch.Tensor:
        out = torch.randint(0, v, shape, device=device)
        return out.masked_fill(torch.rand(shape, device=device) < ignored, -100)

    def heads(n: int, h: int, v: int, ht: int | None = None) -> tuple[torch.Tensor, ...]:
        ht = ht or h
        return hid(n, h), w(v, h), hid(n, ht, grad=False), w(v, ht, grad=False)

    out = [
        Case("1x8x1", heads(1, 8, 1)),
        Case("1x8x1000", heads(1, 8, 1000)),
        Case("0x8x1000", heads(0, 8, 1000)),
        Case("17x32x3001-ignored", (*heads(17, 32, 3001), lab(3001, 17, ignored=0.3)), {"beta": 0.3}),
        Case("9x16x2000-allignored", (*heads(9, 16, 2000), lab(2000, 9, ignored=1.0))),
        Case("12x24x1000-beta0-t2", (*heads(12, 24, 1000), lab(1000, 12, ignored=0.2)), {"beta": 0.0, "temperature": 2.0}),
        Case("10x16x999-beta1-t0.5", heads(10, 16, 999), {"beta": 1.0, "temperature": 0.5}),
        Case("8x16x1200-teacher-h40", (*heads(8, 16, 1200, ht=40), lab(1200, 8)), {"beta": 0.7}),
        Case(
            "8x16x700-fp32-teacher",
            (hid(8, 16), w(700, 16), hid(8, 24, grad=False, tdtype=torch.float32), w(700, 24, grad=False, tdtype=torch.float32)),
        ),
        Case("2x3x16x800-3d", (hid(2, 3, 16), w(800, 16), hid(2, 3, 16, grad=False), w(800, 16, grad=False), lab(800, 2, 3, ignored=0.2))),
        Case("7x16x1000-strided", (hid(7, 32)[:, ::2], w(1000, 32)[:, ::2], hid(14, 16, grad=False)[::2], w(1000, 16, grad=False))),
        Case("3x8x20000-longV", heads(3, 8, 20000), {"temperature": 1.5}),
    ]
    if large:  # (the float64 reference holds both [N, V] logits and their JSD's temporaries)
        out += [
            Case("1024x4096x128256", (*heads(1024, 4096, 128256), lab(128256, 1024, ignored=0.05))),
            Case("1024x2048x128256-beta0-t2", (*heads(1024, 2048, 128256, ht=4096), lab(128256, 1024)), {"beta": 0.0, "temperature": 2.0}),
            Case("1031x2048x32000-beta1", heads(1031, 2048, 32000), {"beta": 1.0}),
        ]
    return out


def outputs(
    student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor, *_: object
) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((torch.Size(), distill.acc_dtype(student_hidden, student_weight, teacher_hidden)),)


_op = Op(
    OP_ID,
    fields=(
        "device",
        "dtype",
        "needs_grad",
        "hidden_size",
        "n_classes",
        "teacher_dtype",
        "teacher_hidden_size",
        "matches",
        "labels",
        "beta",
        "ignore_index",
        "temperature",
    ),
    key=_key,
    guard=(SHAPE, SHAPE, SHAPE, SHAPE, SHAPE, None, None, None),
    default_key=lambda device, dtype: (device, dtype, False, None, None, dtype, None, True, None, 0.5, -100, 1.0),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    autocast=_autocast.head_args(reference),  # the heads as F.linear under autocast (ops._autocast)
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # torch.compile: our custom ops (Inductor's code for the reference would materialize both
    # [N, V] logits); nothing saved: a compiled backward recomputes the forward
    compile_mode="ours",
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
_any_autocast = _autocast.any_autocast
