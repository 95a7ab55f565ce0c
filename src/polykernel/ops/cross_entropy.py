"""``loss.cross_entropy``: ``F.cross_entropy`` on fp32-upcast logits, class dim last.

``logits`` is ``[..., V]`` and ``target`` ``[...]`` (int64 or int32; flattened to rows); the loss
is fp32 (fp64 for fp64 logits): a scalar for ``"mean"``/``"sum"``, ``target``'s shape for
``"none"``. Per row, with ``lse = logsumexp(x)`` and smoothing ``ε``::

    loss = lse - (1 - ε)·x[t] - ε·mean(x)        (0 where t == ignore_index)
    dloss/dx = softmax(x) - (1 - ε)·onehot(t) - ε/V

``"mean"`` divides the sum by the number of non-ignored targets, so an empty or all-ignored
batch gives NaN with zero gradients, exactly as PyTorch does. An ignored row's loss and gradient
are exactly 0 whatever its logits, NaN and inf included (PyTorch documents that ignored targets
do not contribute to the gradient; ``F.cross_entropy``'s backward gives NaN on such a row, 0·NaN,
which no impl copies): a non-finite padding row poisons nothing.

Options (all off by default; each costs nothing when off):

- ``weight`` (``[V]`` floating, no grad): class weights with ``F.cross_entropy``'s semantics,
  label smoothing included: ``loss = (1-ε)·w[t]·(lse - x[t]) + ε/V·Σ_c w[c]·(lse - x[c])``,
  and ``"mean"`` divides by the summed ``w[t]`` of the scored targets.
- ``softcap`` (> 0): the logits become ``softcap·tanh(x/softcap)`` before everything else
  (Gemma 2/3); the gradient carries ``1 - tanh²``.
- ``z_loss`` (>= 0): adds ``z_loss·w[t]·lse²`` per scored row (PaLM; ``lse`` of the soft-capped
  logits, ``w[t] = 1`` without weights), so it is reduced exactly like the loss (one
  denominator). Liger's z-loss is unweighted over a weighted mean: same without ``weight``. The gradient has the logits' dtype;
the logits are never written to.

Out-of-range targets (neither in ``[0, V)`` nor ``ignore_index``): on the CPU the public function
raises ``OpArgumentError`` before anything runs. On other devices the host does not check (that
would cost a device-to-host sync per call); instead the kernels never read out of bounds and flag
the row: the Triton and torch impls make that row's loss (so the mean/sum) and gradient NaN (the
torch impl reads class 0 there, so the first-use check, which runs it first on the caller's
values, never trips PyTorch's device-side index assertion). No impl returns a finite loss
computed from an out-of-range target.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, ErrorModel, Op
from ..distributed.layout import ROWS, Layout, rows_with
from . import _checks as check

OP_ID = "loss.cross_entropy"
REDUCTIONS = ("mean", "sum", "none")
TARGET_DTYPES = (torch.int64, torch.int32)


def reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """The semantics, in plain torch: ``F.cross_entropy`` on the upcast ``[rows, V]`` logits.

    The upcast values are evaluated in fp64 and the loss rounded to fp32 (fp64 stays fp64): the
    same function as fp32 ``F.cross_entropy``, without its rounding errors (~1e-5 of the gradient's
    scale at V = 40K with label smoothing), so parity tests can hold the impls to fp32 accuracy.
    With options: softcap first, then ``F.cross_entropy(weight=...)`` per row plus the z-loss
    term, reduced over the summed weights of the scored rows (see the module docstring).
    """
    out_dtype = torch.promote_types(logits.dtype, torch.float32)
    v = logits.shape[-1]
    t = target.reshape(-1).long()
    # ignored rows read as zeros: their loss and gradient are exactly 0 whatever their logits
    # (torch documents that they do not contribute; its log_softmax backward gives 0·NaN there)
    x = torch.where((t != ignore_index)[:, None], logits.reshape(-1, v).to(torch.float64), 0.0)
    if weight is None and softcap is None and not z_loss:
        out = F.cross_entropy(x, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
        out = out.to(out_dtype)
        return out.reshape(target.shape) if reduction == "none" else out
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    w = None if weight is None else weight.detach().to(device=x.device, dtype=torch.float64)
    rows = F.cross_entropy(x, t, weight=w, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    valid = t != ignore_index
    wt = valid.to(torch.float64) if w is None else torch.where(valid, w[torch.where(valid, t, 0)], 0.0)
    if z_loss:
        rows = rows + z_loss * wt * torch.logsumexp(x, -1).square()
    if reduction == "none":
        return rows.to(out_dtype).reshape(target.shape)
    total = torch.where(valid, rows, 0.0).sum()  # ignored rows: zero gradients whatever the divisor
    if reduction == "sum":
        return total.to(out_dtype)
    # as F.cross_entropy: nothing scored is NaN with zero gradients (not inf·0); scored targets
    # whose weights sum to 0 are NaN with NaN gradients on the scored rows (mean_divisor)
    scored = valid.any()
    return torch.where(scored, total / torch.where(scored, mean_divisor(wt.sum()), 1.0), torch.nan).to(out_dtype)


def mean_divisor(weight_sum: torch.Tensor) -> torch.Tensor:
    """A weighted mean's divisor, the summed class weights of the scored targets, with 0 as NaN.

    ``F.cross_entropy`` divides its two parts by that sum separately, ``(1-ε)·Σ w[t]·nll / Σ w[t]
    + ε·smooth / Σ w[t]``: when the weights of the scored targets sum to 0 (non-negative weights:
    all 0) the first is 0/0, so the loss is NaN and so are the scored rows' gradients, whatever
    the smoothing, z-loss or softcap add (one division of the whole sum would give +inf with
    smoothing). The impls' divisors follow this (``polykernel.backends._cross_entropy.denominator``).
    """
    return torch.where(weight_sum == 0, torch.nan, weight_sum)


def validate_options(op: str, ignore_index: int, label_smoothing: float, reduction: str) -> None:
    """Checks shared with ``loss.fused_linear_cross_entropy`` and the nn modules' constructors
    (``ignore_index`` against the target's dtype: :func:`validate_target`)."""
    check.ignore_index(op, ignore_index, "target", None)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise check.OpArgumentError(op, "label_smoothing", f"expected a number in [0, 1], got {check.shown(label_smoothing)}")
    check.choice(op, "reduction", reduction, REDUCTIONS)


def validate_extras(
    op: str,
    weight: torch.Tensor | None,
    softcap: float | None,
    z_loss: float,
    n_classes: int,
    ref_name: str,
    ref: torch.Tensor,
    weight_name: str = "weight",
) -> None:
    """The class weights, softcap and z_loss (shared with ``loss.fused_linear_cross_entropy``,
    whose class weights are ``ce_weight``)."""
    if weight is not None:
        check.tensor(op, weight_name, weight)
        check.floating(op, weight_name, weight)
        if weight.shape != (n_classes,):
            raise check.OpArgumentError(op, weight_name, f"expected shape ({n_classes},) (one weight per class), got {tuple(weight.shape)}")
        check.same_device(op, weight_name, weight, ref_name, ref)
        if weight.requires_grad and torch.is_grad_enabled():  # F.cross_entropy refuses it too
            raise check.OpArgumentError(op, weight_name, "class weights take no gradient; pass weight.detach()")
    if softcap is not None:
        check.positive_float(op, "softcap", softcap)
        check.finite_float(op, "softcap", softcap)
    check.nonnegative_float(op, "z_loss", z_loss)
    check.finite_float(op, "z_loss", z_loss)


def weight_matches(weight: torch.Tensor | None, n_classes: int, device: torch.device) -> bool:
    """Whether ``weight`` passes `validate_extras` (for the argument classes' one flag)."""
    return weight is None or (
        weight.shape == (n_classes,) and weight.is_floating_point() and weight.device == device
        and not (weight.requires_grad and torch.is_grad_enabled())
    )  # fmt: skip


def as_softcap(value: object) -> object:
    """softcap as the impls take it: None, or a number as a float (anything else as given)."""
    return float(value) if type(value) is int else value


def validate_target(
    op: str, target: torch.Tensor, rows_shape: torch.Size, n_classes: int, ignore_index: int, ref_name: str, ref: torch.Tensor
) -> None:
    """dtype, shape and device of ``target``; its range on the CPU only (elsewhere it costs a sync)."""
    check.tensor(op, "target", target, min_dim=0)
    if target.dtype not in TARGET_DTYPES:
        raise check.OpTypeError(op, "target", f"expected an int64 or int32 tensor of class indices, got {target.dtype}")
    check.ignore_index(op, ignore_index, "target", target)
    if target.shape != rows_shape:
        raise check.OpArgumentError(
            op, "target", f"expected shape {tuple(rows_shape)} ({ref_name}'s shape without its last dim), got {tuple(target.shape)}"
        )
    check.same_device(op, "target", target, ref_name, ref)
    # Not while torch.compile traces: a data-dependent branch would break the graph; the check
    # still runs when the custom op executes (its real impl validates through the eager path).
    if target.device.type == "cpu" and target.numel() and not torch.compiler.is_compiling():
        # Two ops, not five (9 -> ~3 us per CPU call): ignored entries become 0, then min and max.
        lo, hi = torch.aminmax(torch.where(target == ignore_index, 0, target))
        if int(lo) < 0 or int(hi) >= n_classes:  # rare: now find the first offender for the message
            bad = ((target < 0) | (target >= n_classes)) & (target != ignore_index)
            first = target[bad].flatten()[0].item()
            raise check.OpArgumentError(
                op, "target", f"class index {first} is out of range [0, {n_classes}) and is not ignore_index ({ignore_index})"
            )


def validate(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> None:
    check.tensor(OP_ID, "logits", logits)
    check.floating(OP_ID, "logits", logits)
    if logits.shape[-1] == 0:
        raise check.OpArgumentError(OP_ID, "logits", f"expected at least one class (last dim), got shape {tuple(logits.shape)}")
    validate_options(OP_ID, ignore_index, label_smoothing, reduction)
    validate_target(OP_ID, target, logits.shape[:-1], logits.shape[-1], ignore_index, "logits", logits)
    validate_extras(OP_ID, weight, softcap, z_loss, logits.shape[-1], "logits", logits)


def _key(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> tuple:
    """The argument class. It holds everything validity depends on (the options, target's dtype,
    and whether target's shape and device match the logits' rows as one flag), so `validate` runs
    once per class (on the memo miss), except on the CPU: see `cross_entropy`. n_classes and
    label_smoothing come first because impls' eligibility depends on them (QuACK has no
    smoothing). The guard (``_op``'s ``guard``) recognises a repeat without building it: both
    shapes whole (which the flag relates), so a repeat compares no shape in Python."""
    matches = (
        target.shape == logits.shape[:-1] and target.device == logits.device
        and weight_matches(weight, logits.shape[-1], logits.device)
    )  # fmt: skip
    return (
        logits.device,
        logits.dtype,
        check.needs_grad(logits),
        logits.shape[-1],
        label_smoothing,
        ignore_index,
        reduction,
        target.dtype,
        matches,
        weight is not None,
        softcap,
        z_loss,
    )


def as_smoothing(value: object) -> object:
    """label_smoothing as the impls take it: an int as a float, anything else as given (for
    validation to name it)."""
    return float(value) if type(value) is int else value


_compiling = torch.compiler.is_compiling
_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
    impl: str | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``logits [..., V]`` against class indices ``target [...]`` (fp32 result).

    ``weight`` (class weights), ``softcap`` and ``z_loss``: see the module docstring.

    >>> import torch, polykernel
    >>> logits, target = torch.randn(4, 10), torch.tensor([1, 2, -100, 9])
    >>> polykernel.cross_entropy(logits, target).shape
    torch.Size([])
    >>> polykernel.cross_entropy(logits, target, reduction="none", label_smoothing=0.1).shape
    torch.Size([4])
    >>> polykernel.cross_entropy(logits, target, softcap=30.0, z_loss=1e-4).shape
    torch.Size([])
    """
    ls = label_smoothing if type(label_smoothing) is float else as_smoothing(label_smoothing)
    cap = softcap if softcap is None or type(softcap) is float else as_softcap(softcap)
    z = z_loss if type(z_loss) is float else as_smoothing(z_loss)
    if (
        not isinstance(target, torch.Tensor) or target.is_cpu
    ) and not _compiling():  # its values: every call (compiled: the custom op validates)
        validate(logits, target, ignore_index, ls, reduction, weight, cap, z)  # there (its range): every call
    return _dispatch(impl, logits, target, ignore_index, ls, reduction, weight, cap, z)  # _op.dispatch; see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# Per row, in fp32: lse = m + log Σ exp(x - m) (a positive sum over V: its relative error becomes
# an absolute one through the log), minus x_target (cancels: ~u32 of max|x|), and with label
# smoothing a mean of the logits (a cancelling sum over V). So each row's loss is off by a few u32
# of max|x| + 1, plus λ·√V·u32 of it; the mean keeps that bound, a sum of N rows grows it by √N
# (independent rows); the loss is fp32 for every logits dtype. Backward: dlogits = c·(p - onehot
# - ε/V) with c = dy / (valid rows) for "mean" and dy for "sum"/"none" (|dy| <= 1): p is off by
# (|x - lse|·u32)·p <= u32/e (exp's argument), plus lse's error; then rounded to the logits' dtype.
# Options: softcap bounds the logits by softcap (|x| <= min(max|x|, softcap)) at the price of
# tanh's few u32 per logit (ops); z_loss adds z·lse², whose error is 2·z·|lse| times lse's, and
# multiplies p by 1 + 2·z·lse in the gradient; class weights scale a row's loss and gradient by
# w[t] (its smoothing term by max|w|): a weighted mean keeps the per-row bound, sums and the
# gradient grow by max|w| (the mean's c becomes 1 / Σ w[t]).
def error_model(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> Bounds:
    v = logits.shape[-1] if logits.dim() else 1
    scored = target != ignore_index
    valid = max(1, int(scored.sum()))
    x_max = logits.detach().abs().max().item() if logits.numel() else 0.0
    if softcap is not None:
        x_max = min(x_max, softcap)
    row = x_max + 1.0
    lse_max = x_max + math.log(max(v, 1))
    zf = 1.0 + 2.0 * z_loss * lse_max  # lse's error reaches the loss and p (1 + 2·z·lse) this much more
    w_max, w_sum = 1.0, float(valid)
    if weight is not None:
        w = weight.detach().to(torch.float64)
        w_max = max(w.abs().max().item() if w.numel() else 1.0, 1e-30)
        wt = torch.where(scored.reshape(-1), w[torch.where(scored, target, 0).reshape(-1).long()], 0.0) if v else w[:0]
        w_sum = abs(wt.sum().item()) or 1.0
    ops = 4 + (4 if softcap is not None else 0)
    loss_scale = row * zf * (valid**0.5 * w_max if reduction == "sum" else w_max if reduction == "none" else 1.0)
    if reduction == "mean" and weight is not None:
        loss_scale = row * zf * w_max * valid / w_sum  # Σ w·loss / Σ w: |Σ w| can be far below Σ |w|
    loss = ErrorModel(ops=ops, sum_rel=1, cancel=6, sum_abs=2, n=max(v, valid), scale=loss_scale)
    c = (w_max / w_sum if weight is not None else 1.0 / valid) if reduction == "mean" else w_max
    dlogits = ErrorModel(ops=ops, cancel=4 + 4 * (zf - 1), sum_abs=1, n=v, scale=c * zf)
    return Bounds(outputs=(loss,), grads={0: dlogits})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random logits of ``shape`` (last dim = vocabulary) and targets with ~5% ignored."""
    logits = (3 * torch.randn(shape, device=device)).to(dtype).requires_grad_(requires_grad)
    target = torch.randint(0, shape[-1], shape[:-1], device=device)
    target = target.masked_fill(torch.rand(shape[:-1], device=device) < 0.05, -100)
    return Case(f"{'x'.join(map(str, shape))}", (logits, target))


def bytes_moved(logits: torch.Tensor, target: torch.Tensor, *_: object, backward: bool = False, **__: object) -> int:
    """Fewest bytes: forward reads the logits once; backward reads them again and writes dlogits.

    (Targets and per-row statistics are O(N) and ignored.) fwd+bwd = 3·N·V·elt.
    """
    n = logits.numel() * logits.element_size()
    return 3 * n if backward else n


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""

    def x(*shape: int, scale: float = 3.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype).requires_grad_()

    def t(v: int, *shape: int, ignored: float = 0.0) -> torch.Tensor:
        out = torch.randint(0, v, shape, device=device)
        return out.masked_fill(torch.rand(shape, device=device) < ignored, -100)

    def cw(v: int) -> torch.Tensor:  # class weights in [0, 2), a fifth of them 0
        w = 2 * torch.rand(v, device=device)
        return w.masked_fill(torch.rand(v, device=device) < 0.2, 0.0)

    out = [
        Case("1x1", (x(1, 1), t(1, 1))),
        Case("1x1000", (x(1, 1000), t(1000, 1))),
        Case("0x1000", (x(0, 1000), t(1000, 0))),
        Case("0x1000-sum", (x(0, 1000), t(1000, 0)), {"reduction": "sum"}),
        Case("0x1000-none", (x(0, 1000), t(1000, 0)), {"reduction": "none"}),
        Case("13x3001-ignored", (x(13, 3001), t(3001, 13, ignored=0.3))),
        Case("9x2000-allignored", (x(9, 2000), t(2000, 9, ignored=1.0))),
        Case("9x2000-allignored-sum", (x(9, 2000), t(2000, 9, ignored=1.0)), {"reduction": "sum"}),
        Case("8x1000-smooth", (x(8, 1000), t(1000, 8, ignored=0.25)), {"label_smoothing": 0.1}),
        Case("8x1000-smooth1", (x(8, 1000), t(1000, 8)), {"label_smoothing": 1.0, "reduction": "sum"}),
        Case("11x4999-sum", (x(11, 4999), t(4999, 11, ignored=0.2)), {"reduction": "sum"}),
        Case("11x4999-none-smooth", (x(11, 4999), t(4999, 11, ignored=0.2)), {"reduction": "none", "label_smoothing": 0.2}),
        Case("2x3x500-3d", (x(2, 3, 500), t(500, 2, 3))),
        Case("2x3x500-3d-none", (x(2, 3, 500), t(500, 2, 3)), {"reduction": "none"}),
        Case("6x1000-ignore7", (x(6, 1000), torch.tensor([7, 1, 7, 999, 0, 7], device=device)), {"ignore_index": 7}),
        Case("7x1500-rowstrided", (x(14, 1500)[::2], t(1500, 7))),
        Case("5x1200-colstrided", (x(5, 2400)[:, ::2], t(1200, 5)), {"label_smoothing": 0.05}),
        Case("4x1000-int32", (x(4, 1000), t(1000, 4).int())),
        Case("3x40000-long", (x(3, 40000, scale=5.0), t(40000, 3)), {"label_smoothing": 0.1}),
        # the options (module docstring), alone and together; weights with zeros
        Case("9x1000-weight", (x(9, 1000), t(1000, 9, ignored=0.2)), {"weight": cw(1000)}),
        Case(
            "9x1000-weight-smooth-sum",
            (x(9, 1000), t(1000, 9, ignored=0.2)),
            {"weight": cw(1000), "label_smoothing": 0.2, "reduction": "sum"},
        ),
        Case("8x3001-softcap", (x(8, 3001, scale=20.0), t(3001, 8, ignored=0.2)), {"softcap": 15.0}),
        Case("8x1000-zloss-none", (x(8, 1000), t(1000, 8, ignored=0.2)), {"z_loss": 1e-2, "reduction": "none"}),
        Case(
            "10x1500-all-options",
            (x(10, 1500, scale=10.0), t(1500, 10, ignored=0.2)),
            {"weight": cw(1500), "softcap": 8.0, "z_loss": 1e-3, "label_smoothing": 0.1},
        ),
        Case("9x2000-allignored-options", (x(9, 2000), t(2000, 9, ignored=1.0)), {"weight": cw(2000), "softcap": 5.0, "z_loss": 1e-3}),
    ]
    if large:
        out += [
            Case("8192x128256", (x(8192, 128256), t(128256, 8192, ignored=0.05))),
            Case("4096x256000-smooth", (x(4096, 256000), t(256000, 4096, ignored=0.05)), {"label_smoothing": 0.1}),
            Case("1031x128256-none", (x(1031, 128256), t(128256, 1031, ignored=0.05)), {"reduction": "none"}),
            Case("64x262144-sum", (x(64, 262144, scale=10.0), t(262144, 64)), {"reduction": "sum"}),
            Case("4096x256000-softcap", (x(4096, 256000, scale=10.0), t(256000, 4096, ignored=0.05)), {"softcap": 30.0}),
        ]
    return out


def outputs(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    shape = target.shape if reduction == "none" else torch.Size()
    return ((shape, torch.promote_types(logits.dtype, torch.float32)),)


_op = Op(
    OP_ID,
    fields=(
        "device",
        "dtype",
        "needs_grad",
        "n_classes",
        "label_smoothing",
        "ignore_index",
        "reduction",
        "target_dtype",
        "target_matches",
        "has_weight",
        "softcap",
        "z_loss",
    ),
    key=_key,
    guard=(SHAPE, SHAPE, None, None, None, SHAPE, None, None),
    default_key=lambda device, dtype: (device, dtype, False, None, 0.0, -100, "mean", torch.int64, True, False, None, 0.0),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # torch.compile: our custom ops, far faster than Inductor's code (the torch.compile rows of
    # benchmarks/results/h200-2026-11-30-graph.json); saves the LSE (one per row) and the non-ignored count (a sum over rows)
    saved=("rows", "sum"),
    # target, ignore_index, reduction; weight; logits Shard(-1): vocab-parallel (polykernel.distributed.vocab)
    dtensor_layout=Layout(ROWS, rows_with(1), ("loss",), loss_args=(1, 2, 4), loss_weight=5, vocab="logits"),
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
