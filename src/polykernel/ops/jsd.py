"""``loss.jsd``: the generalized Jensen-Shannon divergence of Liger-Kernel's ``LigerJSDLoss``.

``student_logp`` (Q, the student's log-probs) and ``teacher_logp`` (P, the teacher's) are
``[..., V]``; with ``M = β·P + (1-β)·Q`` each row's loss is ``β·KL(P‖M) + (1-β)·KL(Q‖M)``,
except that β = 0 is the forward KL(P‖Q) and β = 1 the reverse KL(Q‖P) (Liger's and TRL's
convention; the formula would give 0 there). The rows are summed and divided by the number of
scored rows: all of them, or those whose ``labels`` entry is not ``ignore_index``. An empty or
all-ignored batch gives 0/0 = NaN (Liger returns 0) with zero gradients, as ``cross_entropy``'s
"mean" does; an ignored row's gradient is exactly 0 whatever its values (NaN and inf
included), as ``cross_entropy``'s. A probability of exactly 0 contributes 0 (KL's 0·log 0 = 0: a vocabulary entry
masked to -inf in both adds nothing; Liger and TRL give NaN there). The loss is fp32 (fp64 for
fp64 inputs); the gradient is for ``student_logp`` only, in its dtype (the teacher takes none).
"""

from __future__ import annotations

import torch

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, ErrorModel, Op
from . import _checks as check
from . import _distill as distill

OP_ID = "loss.jsd"


def reference(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64): per-element terms
    (:func:`polykernel.ops._distill.jsd_terms`), their row sums, the mean over scored rows."""
    acc = distill.acc_dtype(student_logp, teacher_logp)
    x, y = student_logp.to(acc), teacher_logp.to(acc)
    if labels is None:
        rows = distill.jsd_terms(x, y, float(beta)).sum(-1)
        return rows.sum() / rows.numel()
    valid = labels != ignore_index
    x, y = distill.skip_ignored(valid, x, y)
    rows = distill.jsd_terms(x, y, float(beta)).sum(-1)
    return torch.where(valid, rows, 0.0).sum() / valid.sum()


def validate(student_logp: torch.Tensor, teacher_logp: torch.Tensor, labels: torch.Tensor | None, beta: float, ignore_index: int) -> None:
    distill.validate_pair(OP_ID, "student_logp", student_logp, "teacher_logp", teacher_logp, min_classes=1)
    distill.validate_labels(OP_ID, labels, student_logp.shape[:-1], "student_logp", student_logp)
    distill.validate_beta(OP_ID, beta)
    check.ignore_index(OP_ID, ignore_index, "labels", labels)


_grad_enabled = torch.is_grad_enabled


def _key(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
) -> tuple:
    """The argument class; it holds everything validity depends on (teacher_matches, labels'
    dtype, device and shape match), so `validate` runs once per class. The guard pins the
    student's and labels' whole shapes (labels must match the student's rows) and compares the
    teacher's shape with the student's per call."""
    return (
        student_logp.device,
        student_logp.dtype,
        student_logp.requires_grad and _grad_enabled(),
        student_logp.shape[-1] if student_logp.dim() else None,
        teacher_logp.dtype,
        teacher_logp.device,
        teacher_logp.shape == student_logp.shape,
        distill.labels_class(labels, student_logp.shape[:-1]),
        beta,
        ignore_index,
    )


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def jsd(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    ignore_index: int = -100,
    impl: str | None = None,
) -> torch.Tensor:
    """Generalized JSD between the student's and the teacher's log-probs ``[..., V]`` (fp32 scalar).

    ``beta`` in [0, 1] mixes M = β·P + (1-β)·Q (0: forward KL(P‖Q), 1: reverse KL(Q‖P)); rows whose
    ``labels`` entry is ``ignore_index`` are skipped and not counted in the mean.

    >>> import torch, polykernel
    >>> s, t = torch.randn(4, 10).log_softmax(-1), torch.randn(4, 10).log_softmax(-1)
    >>> loss = polykernel.jsd(s, t, beta=0.5)
    >>> loss.shape, loss.dtype
    (torch.Size([]), torch.float32)
    >>> bool(polykernel.jsd(s, s) == 0)
    True
    """
    return _dispatch(impl, student_logp, teacher_logp, labels, beta, ignore_index)  # _op.dispatch; see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# Each element is a few fp32 roundings of terms that cancel (Y - log M, X - log M), so its error is
# relative to a magnitude w = P·(1 + |Y|)·(|Y| + |log M| + 1) + Q·(...) (the exp's argument
# carries |Y|·u of relative error on GPUs): ~8 u32 of it (see _distill.jsd_magnitudes). A row sums
# V of them (mixed signs: λ·√V·u32 of Σw), the loss sums the rows (each >= 0) and divides by the
# count c of scored rows: so the scale is Σ_rows Σ_V w / c. Gradient: dx = (1-β)·Q·(X - log M)/c
# (-P/c, Q·(X - Y + 1)/c) per element, off by ~8 u32 of its own magnitude, written in the forward
# and scaled by the cotangent in the backward (rounded twice).
def error_model(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
) -> Bounds:
    sums, x_max = distill.jsd_magnitudes(student_logp, teacher_logp, float(beta))
    valid = distill.scored_rows(labels, ignore_index, sums.numel())
    count = max(1, int(valid.sum()))
    v = student_logp.shape[-1]
    total = sums[valid].sum().item() if sums.numel() else 0.0
    top = x_max[valid].max().item() if bool(valid.any()) else 0.0
    loss = ErrorModel(ops=4, sum_rel=1, cancel=8, sum_abs=1, n=max(v, sums.numel()), scale=total / count)
    d_student = ErrorModel(rounds=2, ops=6, cancel=8, scale=top / count)
    return Bounds(outputs=(loss,), grads={0: d_student})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Student and teacher log-probs of one shape, ~5% of the rows ignored (benchmarks, explain)."""
    s = (2 * torch.randn(shape, device=device)).log_softmax(-1).to(dtype).requires_grad_(requires_grad)
    t = (2 * torch.randn(shape, device=device)).log_softmax(-1).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], device=device).masked_fill(torch.rand(shape[:-1], device=device) < 0.05, -100)
    return Case(f"{'x'.join(map(str, shape))}", (s, t, labels))


def bytes_moved(student_logp: torch.Tensor, teacher_logp: torch.Tensor, *_: object, backward: bool = False, **__: object) -> int:
    """Fewest bytes: read both log-probs (+ write the student's gradient in the backward); the
    labels are O(N) and ignored. fwd+bwd = 3·N·V·elt for one dtype."""
    n = student_logp.numel()
    out = n * (student_logp.element_size() + teacher_logp.element_size())
    return out + (n * student_logp.element_size() if backward else 0)


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes, every β branch, ignored rows, sized for the CPU interpreter unless ``large``."""

    def lp(*shape: int, scale: float = 2.0, grad: bool = True, tdtype: torch.dtype = dtype) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).log_softmax(-1).to(tdtype).requires_grad_(grad)

    def masked(*shape: int, grad: bool = True) -> torch.Tensor:
        # a run of vocabulary entries with probability 0 in both (-inf log-probs)
        z = 2 * torch.randn(shape, device=device)
        z[..., 3:40] = float("-inf")
        return z.log_softmax(-1).to(dtype).requires_grad_(grad)

    def lab(v: int, *shape: int, ignored: float = 0.0) -> torch.Tensor:
        out = torch.randint(0, v, shape, device=device)
        return out.masked_fill(torch.rand(shape, device=device) < ignored, -100)

    def pair(*shape: int, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        return lp(*shape, **kw), lp(*shape, grad=False)  # type: ignore[arg-type]

    out = [
        Case("1x1", pair(1, 1)),
        Case("7-1d", pair(7)),
        Case("3x7-beta0", pair(3, 7), {"beta": 0.0}),
        Case("3x7-beta1", pair(3, 7), {"beta": 1}),
        Case("2x5x33-3d", (*pair(2, 5, 33), lab(33, 2, 5, ignored=0.3))),
        Case("0x16", pair(0, 16)),
        Case("0x16-labels", (*pair(0, 16), lab(16, 0))),
        Case("13x3001-ignored", (*pair(13, 3001), lab(3001, 13, ignored=0.3)), {"beta": 0.3}),
        Case("9x1000-allignored", (*pair(9, 1000), lab(1000, 9, ignored=1.0))),
        Case("9x1000-allignored-beta0", (*pair(9, 1000), lab(1000, 9, ignored=1.0)), {"beta": 0.0}),
        Case("6x1000-ignore7", (*pair(6, 1000), torch.tensor([7, 1, 7, 999, 0, 7], device=device)), {"ignore_index": 7}),
        Case("5x1000-int32-labels-beta1", (*pair(5, 1000), lab(1000, 5, ignored=0.2).int()), {"beta": 1.0}),
        Case("4x500-masked-vocab", (masked(4, 500), masked(4, 500, grad=False))),
        Case("4x500-masked-vocab-beta0", (masked(4, 500), masked(4, 500, grad=False)), {"beta": 0.0}),
        Case("4x500-masked-vocab-beta1", (masked(4, 500), masked(4, 500, grad=False)), {"beta": 1.0}),
        Case("5x700-fp32-teacher", (lp(5, 700), lp(5, 700, grad=False, tdtype=torch.float32)), {"beta": 0.7}),
        Case("6x800-sharp", pair(6, 800, scale=12.0), {"beta": 0.1}),
        Case("9x200-rowstrided", (lp(18, 200)[::2], lp(9, 200, grad=False))),
        Case("7x64-colstrided", (lp(7, 128)[:, ::2], lp(7, 128, grad=False)[:, ::2]), {"beta": 0.9}),
        Case("3x40000-long", (*pair(3, 40000), lab(40000, 3, ignored=0.3)), {"beta": 0.5}),
    ]
    if large:  # (the float64 reference's temporaries: ~15 copies of the inputs)
        out += [
            Case("2048x128256", (*pair(2048, 128256), lab(128256, 2048, ignored=0.05))),
            Case("2048x128256-beta0", (*pair(2048, 128256), lab(128256, 2048, ignored=0.05)), {"beta": 0.0}),
            Case("1024x128256-beta1", pair(1024, 128256), {"beta": 1.0}),
            Case("1031x50257-odd", (*pair(1031, 50257), lab(50257, 1031, ignored=0.1)), {"beta": 0.25}),
            Case("64x262144-long", pair(64, 262144, scale=4.0)),
        ]
    return out


def outputs(student_logp: torch.Tensor, teacher_logp: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((torch.Size(), distill.acc_dtype(student_logp, teacher_logp)),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "teacher_dtype", "teacher_device", "teacher_matches", "labels", "beta", "ignore_index"),
    key=_key,
    guard=(SHAPE, 0, SHAPE, None, None),
    default_key=lambda device, dtype: (device, dtype, False, None, dtype, device, True, None, 0.5, -100),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # torch.compile: our custom ops (not yet measured against Inductor's code for the reference,
    # which holds fp32 copies of the inputs); nothing saved: a compiled backward recomputes the forward
    compile_mode="ours",
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
