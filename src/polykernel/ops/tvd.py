"""``loss.tvd``: total variation distance ``0.5·Σ|p - q|``, Liger-Kernel's ``LigerTVDLoss``.

``p`` and ``q`` are distributions ``[..., V]`` (probabilities, not logs). The loss of an element is
``0.5·|p - q|``, a row's is their sum; rows whose ``labels`` entry is ``ignore_index`` count 0 and
are not counted. Reductions as Liger's: ``"batchmean"`` (default) Σ / scored rows, ``"mean"``
Σ / (scored rows · V), ``"sum"``, ``"none"`` the elementwise loss (p's shape, 0 on ignored
rows). An empty or all-ignored batch gives 0/0 = NaN for the means (Liger raises
ZeroDivisionError) and 0 for "sum". The loss is fp32 (fp64 for fp64 inputs); gradients
``±0.5·sign(p - q)`` (0 where p == q) for p and, when it requires grad, q (Liger: p only).
"""

from __future__ import annotations

import torch

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, ErrorModel, Op
from . import _checks as check
from . import _distill as distill

OP_ID = "loss.tvd"
REDUCTIONS = ("batchmean", "sum", "mean", "none")


def reference(
    p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "batchmean", ignore_index: int = -100
) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = distill.acc_dtype(p, q)
    loss = 0.5 * (p.to(acc) - q.to(acc)).abs()
    if labels is None:
        count = loss[..., 0].numel()
    else:
        valid = labels != ignore_index
        loss = torch.where(valid[..., None], loss, 0.0)
        count = valid.sum()
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (count * p.shape[-1])
    return loss.sum() / count


def validate(p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None, reduction: str, ignore_index: int) -> None:
    distill.validate_pair(OP_ID, "p", p, "q", q, min_classes=1)
    distill.validate_labels(OP_ID, labels, p.shape[:-1], "p", p)
    check.choice(OP_ID, "reduction", reduction, REDUCTIONS)
    check.ignore_index(OP_ID, ignore_index, "labels", labels)


_grad_enabled = torch.is_grad_enabled


def _key(
    p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "batchmean", ignore_index: int = -100
) -> tuple:
    """The argument class; it holds everything validity depends on (q_matches, labels' dtype,
    device and shape match), so `validate` runs once per class. The guard pins p's and labels'
    whole shapes and compares q's with p's per call. q_grad: Liger has none."""
    grad = _grad_enabled()
    return (
        p.device,
        p.dtype,
        (p.requires_grad or q.requires_grad) and grad,
        p.shape[-1] if p.dim() else None,
        q.dtype,
        q.device,
        q.requires_grad and grad,
        q.shape == p.shape,
        distill.labels_class(labels, p.shape[:-1]),
        reduction,
        ignore_index,
    )


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def tvd(
    p: torch.Tensor,
    q: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    reduction: str = "batchmean",
    ignore_index: int = -100,
    impl: str | None = None,
) -> torch.Tensor:
    """Total variation distance ``0.5·Σ|p - q|`` between distributions ``p`` and ``q`` ``[..., V]``.

    >>> import torch, polykernel
    >>> p, q = torch.randn(4, 10).softmax(-1), torch.randn(4, 10).softmax(-1)
    >>> loss = polykernel.tvd(p, q)
    >>> bool(torch.allclose(loss, 0.5 * (p - q).abs().sum(-1).mean()))
    True
    """
    return _dispatch(impl, p, q, labels, reduction, ignore_index)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# |p - q| of two exactly representable values is one fp32 rounding (relative), halved exactly; the
# reductions sum terms >= 0 (relative: λ·√n·u32) and divide once. The gradients ±0.5·c (c = the
# reduction's 1/divisor, or the elementwise cotangent) are one rounding of c, written in the forward
# and scaled by the cotangent in the backward (rounded twice).
def error_model(
    p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "batchmean", ignore_index: int = -100
) -> Bounds:
    n = p.numel()
    loss = ErrorModel(ops=2) if reduction == "none" else ErrorModel(ops=4, sum_rel=1, n=max(1, n))
    grad = ErrorModel(rounds=2, ops=3)
    return Bounds(outputs=(loss,), grads={0: grad, 1: grad})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Two distributions of one shape, ~5% of the rows ignored (benchmarks, explain)."""
    p = torch.randn(shape, device=device).softmax(-1).to(dtype).requires_grad_(requires_grad)
    q = torch.randn(shape, device=device).softmax(-1).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], device=device).masked_fill(torch.rand(shape[:-1], device=device) < 0.05, -100)
    return Case(f"{'x'.join(map(str, shape))}", (p, q, labels))


def bytes_moved(
    p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "batchmean", *_: object, backward: bool = False
) -> int:
    """Fewest bytes. Forward: read p and q (+ write the fp32 loss for "none"). Backward: write dp
    (+ dq when q requires grad); for "none" also read p, q and the fp32 cotangent. So a scalar
    loss's fwd+bwd is 3·numel·size; labels are O(N) and ignored."""
    n, ep, eq = p.numel(), p.element_size(), q.element_size()
    none = reduction == "none"
    out = n * (ep + eq) + (4 * n if none else 0)
    if backward:
        out += n * ep + (n * eq if q.requires_grad else 0) + (n * (ep + eq + 4) if none else 0)
    return out


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes, every reduction, ignored rows, sized for the CPU interpreter unless ``large``."""

    def dist(*shape: int, grad: bool = True, tdtype: torch.dtype = dtype) -> torch.Tensor:
        return (2 * torch.randn(shape, device=device)).softmax(-1).to(tdtype).requires_grad_(grad)

    def lab(v: int, *shape: int, ignored: float = 0.0) -> torch.Tensor:
        out = torch.randint(0, v, shape, device=device)
        return out.masked_fill(torch.rand(shape, device=device) < ignored, -100)

    def ties(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        # p == q on a third of the entries: the gradient is 0 there
        p = dist(*shape)
        q = torch.where(torch.rand(shape, device=device) < 0.3, p.detach(), dist(*shape, grad=False))
        return p, q

    out = [
        Case("1x1", (dist(1, 1), dist(1, 1, grad=False))),
        Case("7-1d", (dist(7), dist(7, grad=False))),
        Case("3x7-sum", (dist(3, 7), dist(3, 7, grad=False)), {"reduction": "sum"}),
        Case("2x5x33-3d-ignored", (dist(2, 5, 33), dist(2, 5, 33, grad=False), lab(33, 2, 5, ignored=0.3))),
        Case("0x16", (dist(0, 16), dist(0, 16, grad=False))),
        Case("0x16-sum", (dist(0, 16), dist(0, 16, grad=False)), {"reduction": "sum"}),
        Case("13x3001-ignored-mean", (dist(13, 3001), dist(13, 3001, grad=False), lab(3001, 13, ignored=0.3)), {"reduction": "mean"}),
        Case("9x1000-allignored", (dist(9, 1000), dist(9, 1000, grad=False), lab(1000, 9, ignored=1.0))),
        Case("9x1000-allignored-sum", (dist(9, 1000), dist(9, 1000, grad=False), lab(1000, 9, ignored=1.0)), {"reduction": "sum"}),
        Case("9x1000-allignored-none", (dist(9, 1000), dist(9, 1000, grad=False), lab(1000, 9, ignored=1.0)), {"reduction": "none"}),
        Case("6x1000-none-ignored", (dist(6, 1000), dist(6, 1000, grad=False), lab(1000, 6, ignored=0.4)), {"reduction": "none"}),
        Case(
            "6x1000-ignore7",
            (dist(6, 1000), dist(6, 1000, grad=False), torch.tensor([7, 1, 7, 999, 0, 7], device=device)),
            {"ignore_index": 7},
        ),
        Case("5x1000-int32-labels", (dist(5, 1000), dist(5, 1000, grad=False), lab(1000, 5, ignored=0.2).int())),
        Case("8x500-ties", ties(8, 500)),
        Case("5x700-q-grad-fp32", (dist(5, 700), dist(5, 700, tdtype=torch.float32)), {"reduction": "sum"}),
        Case("4x300-q-grad-none", (dist(4, 300), dist(4, 300)), {"reduction": "none"}),
        Case("9x200-rowstrided", (dist(18, 200)[::2], dist(9, 200, grad=False))),
        Case("7x64-colstrided", (dist(7, 128)[:, ::2], dist(7, 128, grad=False)[:, ::2]), {"reduction": "mean"}),
        Case("3x40000-long", (dist(3, 40000), dist(3, 40000, grad=False), lab(40000, 3, ignored=0.3))),
    ]
    if large:  # (the float64 reference of 8192 x 128256 would need ~100 GB: half of it)
        out += [
            Case("4096x128256", (dist(4096, 128256), dist(4096, 128256, grad=False), lab(128256, 4096, ignored=0.05))),
            Case("1031x50257-none", (dist(1031, 50257), dist(1031, 50257, grad=False)), {"reduction": "none"}),
            Case("64x262144-mean", (dist(64, 262144), dist(64, 262144, grad=False)), {"reduction": "mean"}),
        ]
    return out


def outputs(
    p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "batchmean", *_: object
) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((p.shape if reduction == "none" else torch.Size(), distill.acc_dtype(p, q)),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "q_dtype", "q_device", "q_grad", "q_matches", "labels", "reduction", "ignore_index"),
    key=_key,
    guard=(SHAPE, 0, SHAPE, None, None),
    default_key=lambda device, dtype: (device, dtype, False, None, dtype, device, False, True, None, "batchmean", -100),
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
