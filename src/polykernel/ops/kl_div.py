"""``loss.kl_div``: exactly ``torch.nn.functional.kl_div`` (``input``: log-probs), fp32 result.

Per element, with x = ``input`` and t = ``target`` (same shape ``[..., V]``)::

    log_target=False:  t·(log t - x)       (torch.xlogy: 0 where t == 0)
    log_target=True:   exp(t)·(t - x)

reduced as PyTorch does: ``"batchmean"`` (the default here and in Liger) Σ / input.size(0),
``"sum"``, ``"mean"`` Σ / numel, ``"none"`` the elementwise loss in input's shape. The loss is
fp32 (fp64 when an input is fp64) for every dtype; input and target may have different floating
dtypes. An empty input gives PyTorch's answer (0 for "sum", NaN for "mean", and for "batchmean"
when size(0) is 0). Gradients are PyTorch's autograd's: ``-t`` (``-exp(t)``) for input and, when
target requires grad, ``log t + 1 - x`` (NaN where t <= 0, as torch) or ``exp(t)·(t - x + 1)``,
each in its tensor's dtype.
"""

from __future__ import annotations

import torch

from ..core.hit_guard import LAST
from ..core.op import Bounds, Case, ErrorModel, Op
from . import _checks as check
from . import _distill as distill

OP_ID = "loss.kl_div"
REDUCTIONS = ("batchmean", "sum", "mean", "none")


def reference(input: torch.Tensor, target: torch.Tensor, reduction: str = "batchmean", log_target: bool = False) -> torch.Tensor:
    """The semantics, in plain torch: ``torch.kl_div``'s formula in fp32 (fp64 stays fp64)."""
    acc = distill.acc_dtype(input, target)
    x, t = input.to(acc), target.to(acc)
    loss = t.exp() * (t - x) if log_target else torch.xlogy(t, t) - t * x
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / loss.numel()
    return loss.sum() / input.shape[0]


def divisor(input: torch.Tensor, reduction: str) -> int:
    """What the sum is divided by (1 for "sum" and "none")."""
    return input.numel() if reduction == "mean" else input.shape[0] if reduction == "batchmean" else 1


def validate(input: torch.Tensor, target: torch.Tensor, reduction: str, log_target: bool) -> None:
    distill.validate_pair(OP_ID, "input", input, "target", target, min_classes=0)
    check.choice(OP_ID, "reduction", reduction, REDUCTIONS)
    check.boolean(OP_ID, "log_target", log_target)


_grad_enabled = torch.is_grad_enabled


def _key(input: torch.Tensor, target: torch.Tensor, reduction: str = "batchmean", log_target: bool = False) -> tuple:
    """The argument class. It holds everything validity depends on (target_matches: target has
    input's shape), so `validate` runs once per class; the guard recognises a repeat from input's
    last dim, target's metadata and a per-call shape comparison. target_grad: Liger has none."""
    grad = _grad_enabled()
    return (
        input.device,
        input.dtype,
        (input.requires_grad or target.requires_grad) and grad,
        input.shape[-1],
        target.dtype,
        target.device,
        target.requires_grad and grad,
        target.shape == input.shape,
        reduction,
        log_target,
    )


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def kl_div(
    input: torch.Tensor, target: torch.Tensor, *, log_target: bool = False, reduction: str = "batchmean", impl: str | None = None
) -> torch.Tensor:
    """``torch.nn.functional.kl_div(input, target, reduction=..., log_target=...)`` in fp32.

    ``input`` holds log-probabilities (the student's), ``target`` probabilities (log-probabilities
    with ``log_target=True``), both ``[..., V]``. The default reduction is ``"batchmean"``.

    >>> import torch, polykernel
    >>> logp, p = torch.randn(4, 10).log_softmax(-1), torch.randn(4, 10).softmax(-1)
    >>> loss = polykernel.kl_div(logp, p)
    >>> bool(torch.allclose(loss, torch.nn.functional.kl_div(logp, p, reduction="batchmean")))
    True
    """
    return _dispatch(impl, input, target, reduction, log_target)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# Each element is a few fp32 roundings of t·log t - t·x (exp(t)·(t - x)): terms that cancel, so
# its error is relative to their magnitude |t|·(|log t| + |x| + 1) (exp(t)·(|t| + |x| + 1)·(1 + |t|):
# exp's argument carries |t|·u of relative error on GPUs), ~6 u32 of it. A reduction sums numel
# such elements, of mixed signs: λ·√numel·u32 of the summed magnitudes, then divided like the
# loss. Gradients: dx = -t·c (-exp(t)·c) is relative; dt cancels, relative to c·(|log t| + 1 +
# |x|) (c·exp(t)·(|t| + |x| + 1)), with c = 1/divisor (cotangents |dy| <= 1). A gradient written in
# the forward and scaled by the cotangent in the backward is rounded twice.
def _magnitudes(input: torch.Tensor, target: torch.Tensor, log_target: bool) -> tuple[float, float, float, float]:
    """(Σ of the loss terms' magnitudes, their max, max of dt's magnitudes, max |t|), fp64."""
    total, top, dt_top, t_top = 0.0, 0.0, 0.0, 0.0
    for x, t in distill._row_chunks(input, target):
        if log_target:
            e = t.exp()
            m = e * (t.abs() + x.abs() + 1) * (1 + t.abs())
            md = m
        else:
            lt = torch.where(t > 0, t.abs().log().abs(), 0.0)
            m = t.abs() * (lt + x.abs() + 1)
            md = torch.where(t > 0, lt + 1 + x.abs(), 0.0)
        m, md = m.nan_to_num(posinf=0.0), md.nan_to_num(posinf=0.0)
        if m.numel():
            total += m.sum().item()
            top = max(top, m.max().item())
            dt_top = max(dt_top, md.max().item())
            t_top = max(t_top, t.nan_to_num(posinf=0.0, neginf=0.0).abs().max().item())
    return total, top, dt_top, t_top


def error_model(input: torch.Tensor, target: torch.Tensor, reduction: str = "batchmean", log_target: bool = False) -> Bounds:
    total, top, dt_top, t_top = _magnitudes(input, target, log_target)
    div = max(1, divisor(input, reduction))
    if reduction == "none":
        loss = ErrorModel(ops=6, cancel=6, scale=top)
        c = 1.0
    else:
        loss = ErrorModel(ops=4, cancel=6, sum_abs=1, n=max(1, input.numel()), scale=total / div)
        c = 1.0 / div
    d_input = ErrorModel(rounds=2, ops=4 + (t_top if log_target else 0))
    d_target = ErrorModel(rounds=2, ops=4 + (t_top if log_target else 0), cancel=8, scale=c * dt_top)
    return Bounds(outputs=(loss,), grads={0: d_input, 1: d_target})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Student log-probs and teacher probs of one shape (benchmarks, ``explain --shape``)."""
    logp = torch.randn(shape, device=device).log_softmax(-1).to(dtype).requires_grad_(requires_grad)
    p = torch.randn(shape, device=device).softmax(-1).to(dtype)
    return Case(f"{'x'.join(map(str, shape))}", (logp, p))


def bytes_moved(
    input: torch.Tensor, target: torch.Tensor, reduction: str = "batchmean", log_target: bool = False, *, backward: bool = False
) -> int:
    """Fewest bytes. Forward: read input and target (+ write the fp32 loss for "none"). Backward:
    write d_input (+ d_target when target requires grad); for "none" also read target and the fp32
    cotangent (and input, for d_target). So a scalar loss's fwd+bwd is 3·numel·size."""
    n, ex, et = input.numel(), input.element_size(), target.element_size()
    none = reduction == "none"
    out = n * (ex + et) + (4 * n if none else 0)
    if backward:
        out += n * ex + (n * et if target.requires_grad else 0)
        if none:
            out += n * (4 + et) + (n * ex if target.requires_grad else 0)
    return out


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes, every reduction, both target forms, sized for the CPU interpreter."""

    def logp(*shape: int, scale: float = 2.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).log_softmax(-1).to(dtype).requires_grad_()

    def probs(*shape: int, log: bool = False, grad: bool = False, tdtype: torch.dtype = dtype) -> torch.Tensor:
        z = 2.0 * torch.randn(shape, device=device)
        return (z.log_softmax(-1) if log else z.softmax(-1)).to(tdtype).requires_grad_(grad)

    def with_zeros(*shape: int) -> torch.Tensor:
        t = probs(*shape).detach()
        return t.masked_fill(torch.rand(shape, device=device) < 0.3, 0.0)

    out = [
        Case("1x1", (logp(1, 1), probs(1, 1))),
        Case("7-1d", (logp(7), probs(7))),
        Case("3x7-sum", (logp(3, 7), probs(3, 7)), {"reduction": "sum"}),
        Case("2x5x33-3d", (logp(2, 5, 33), probs(2, 5, 33))),
        Case("2x5x33-3d-mean-log", (logp(2, 5, 33), probs(2, 5, 33, log=True)), {"reduction": "mean", "log_target": True}),
        Case("0x16", (logp(0, 16), probs(0, 16))),
        Case("0x16-mean", (logp(0, 16), probs(0, 16)), {"reduction": "mean"}),
        Case("4x0", (logp(4, 0), probs(4, 0))),
        Case("6x1000-none", (logp(6, 1000), probs(6, 1000)), {"reduction": "none"}),
        Case("6x1000-none-log", (logp(6, 1000), probs(6, 1000, log=True)), {"reduction": "none", "log_target": True}),
        Case("5x999-zeros", (logp(5, 999), with_zeros(5, 999))),
        Case("13x3001-target-grad", (logp(13, 3001), probs(13, 3001, grad=True)), {"reduction": "sum"}),
        Case("4x1000-log-target-grad", (logp(4, 1000), probs(4, 1000, log=True, grad=True)), {"log_target": True}),
        Case("5x1000-none-target-grad", (logp(5, 1000), probs(5, 1000, grad=True)), {"reduction": "none"}),
        Case("5x700-fp32-target", (logp(5, 700), probs(5, 700, tdtype=torch.float32))),
        Case("9x200-rowstrided", (logp(18, 200)[::2], probs(9, 200))),
        Case("7x64-colstrided", (logp(7, 128)[:, ::2], probs(7, 128)[:, ::2]), {"log_target": False, "reduction": "sum"}),
        Case("3x40000-long", (logp(3, 40000), probs(3, 40000, log=True)), {"log_target": True}),
    ]
    if large:  # (the float64 reference of 8192 x 128256 would need ~100 GB: half of it)
        out += [
            Case("4096x128256", (logp(4096, 128256), probs(4096, 128256))),
            Case("4096x128256-log", (logp(4096, 128256), probs(4096, 128256, log=True)), {"log_target": True}),
            Case("1031x50257-none", (logp(1031, 50257), probs(1031, 50257)), {"reduction": "none"}),
            Case("64x262144-sum", (logp(64, 262144), probs(64, 262144)), {"reduction": "sum"}),
        ]
    return out


def outputs(
    input: torch.Tensor, target: torch.Tensor, reduction: str = "batchmean", log_target: bool = False
) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((input.shape if reduction == "none" else torch.Size(), distill.acc_dtype(input, target)),)


_op = Op(
    OP_ID,
    fields=(
        "device",
        "dtype",
        "needs_grad",
        "n",
        "target_dtype",
        "target_device",
        "target_grad",
        "target_matches",
        "reduction",
        "log_target",
    ),
    key=_key,
    guard=(LAST, 0, None, None),
    default_key=lambda device, dtype: (device, dtype, False, None, dtype, device, False, True, None, False),  # reduction None: unknown
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
