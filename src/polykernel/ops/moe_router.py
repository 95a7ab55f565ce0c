"""``moe.moe_router``: a mixture-of-experts router's top-k, ``softmax`` then ``top_k``.

``logits`` is ``[..., E]`` (one row of expert scores per token, any floating dtype); the result is
``(weights, index)``, both ``[..., top_k]``: ``index`` (int64) holds the ``top_k`` experts with
the largest probability, in descending order, and ``weights`` their probabilities
``softmax(logits)[index]`` in ``logits``' dtype, divided by their sum when ``renormalize``
(Qwen3-MoE's ``norm_topk_prob``, Mixtral). Math in fp32 (fp64 stays fp64). Gradients flow from
``weights`` to ``logits``.

Ties: experts are ranked by their logits (softmax is monotonic, so the selection is the same as
by probability, without the ties that rounding the probabilities to fp32 would create), and
equal logits rank the lower expert index first. So every impl and the float64 reference pick the
same experts. (transformers ranks the fp32 probabilities with ``torch.topk``, whose order among
ties is unspecified.)
"""

from __future__ import annotations

import torch

from ..core.hit_guard import LAST
from ..core.op import Bounds, Case, ErrorModel, Op, rows_and_len
from . import _checks as check

OP_ID = "moe.moe_router"


def reference(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(acc)
    # a stable descending sort: equal logits keep their order, lower expert index first
    index = torch.sort(x.detach(), dim=-1, descending=True, stable=True).indices[..., :top_k]
    weights = torch.softmax(x, dim=-1).gather(-1, index)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), index


def validate(logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    check.tensor(OP_ID, "logits", logits)
    check.floating(OP_ID, "logits", logits)
    n_experts = logits.shape[-1]
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise check.OpTypeError(OP_ID, "top_k", f"expected an int, got {check.shown(top_k)}")
    if not 1 <= top_k <= n_experts:
        raise check.OpArgumentError(OP_ID, "top_k", f"expected 1 <= top_k <= {n_experts} (logits' last dim, the experts), got {top_k}")
    if not isinstance(renormalize, bool):
        raise check.OpTypeError(OP_ID, "renormalize", f"expected a bool, got {check.shown(renormalize)}")


def _key(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple:
    """The argument class: it holds everything validity depends on (E and the options), so
    `validate` runs once per class (on the memo miss). The guard holds logits' last dim."""
    return (logits.device, logits.dtype, check.needs_grad(logits), logits.shape[-1], top_k, renormalize)


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def moe_router(logits: torch.Tensor, top_k: int, *, renormalize: bool = True, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, index)``: the ``top_k`` most probable experts of ``softmax(logits)`` per row.

    >>> import torch, polykernel
    >>> weights, index = polykernel.moe_router(torch.tensor([[0.0, 2.0, 1.0, 2.0]]), 2)
    >>> index.tolist(), round(weights.sum().item(), 6)
    ([[1, 3]], 1.0)
    """
    return _dispatch(impl, logits, top_k, renormalize)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# The index is exact (the ranking reads the logits themselves). Each weight is an fp32 softmax
# value: an exp whose argument x - m carries |x - m|·u32 of relative error, divided by a sum of E
# positive terms (relative error λ·√E·u32), then renormalized by a sum of k of them, rounded once
# to the logits' dtype. Backward: dx = p·(g - Σ p·g) (g: the cotangent scattered to the chosen
# experts, through the renormalization when on) cancels: relative to its terms' magnitude, <= 2
# for cotangents |dy| <= 1.
def error_model(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> Bounds:
    _, n = rows_and_len(logits)
    spread = 0.0
    if logits.numel():
        x = logits.detach().double()
        spread = (x.amax(-1) - x.amin(-1)).nan_to_num().max().item()
    weights = ErrorModel(ops=8 + spread, sum_rel=2, n=n)
    d_logits = ErrorModel(ops=8 + spread, cancel=8 + 2 * spread, sum_abs=2, n=n, scale=2.0)
    return Bounds(outputs=(weights,), grads={0: d_logits})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """``shape`` = (T, E, k), k optional (2, or E if smaller): router logits [T, E] (~unit
    variance), the top k of them."""
    t, e, k = (*shape, min(2, shape[1]))[:3]
    logits = torch.randn(t, e, device=device).to(dtype).requires_grad_(requires_grad)
    return Case(f"T{t},E{e},k{k}", (logits, k))


def bytes_moved(logits: torch.Tensor, top_k: int, *_: object, backward: bool = False) -> int:
    """Fewest bytes: read the logits, write k weights and k int64 indices per row; the backward
    reads the logits and the weights' cotangent and writes dlogits."""
    rows, n = rows_and_len(logits)
    elt = logits.element_size()
    fwd = rows * (n * elt + top_k * (elt + 8))
    return fwd + rows * (2 * n * elt + top_k * elt) if backward else fwd


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward routings: ties, k = 1, k = E, no tokens, extra leading dims."""

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype).requires_grad_()

    ties = torch.randint(-2, 3, (9, 16), device=device).to(dtype).requires_grad_()  # integer logits: many exact ties
    out = [
        Case("13x8-k2", (t(13, 8), 2)),
        Case("13x8-k2-raw", (t(13, 8), 2), {"renormalize": False}),
        Case("9x16-k4-ties", (ties, 4)),
        Case("7x5-k1", (t(7, 5), 1)),
        Case("7x5-k1-raw", (t(7, 5), 1), {"renormalize": False}),
        Case("4x6-k6", (t(4, 6), 6)),
        Case("1x1-k1", (t(1, 1), 1)),
        Case("0x8-k2", (t(0, 8), 2)),
        Case("2x3x8-k3", (t(2, 3, 8), 3)),
        Case("11x64-k8-wide", (t(11, 64, scale=8.0), 8)),
    ]
    if large:
        out += [
            Case("8192x128-k8", (t(8192, 128), 8)),
            Case("8192x8-k2-raw", (t(8192, 8), 2), {"renormalize": False}),
        ]
    return out


def outputs(logits: torch.Tensor, top_k: int, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shapes and dtypes, without running it (the first-call check)."""
    shape = torch.Size((*logits.shape[:-1], top_k))
    return ((shape, logits.dtype), (shape, torch.int64))


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n_experts", "top_k", "renormalize"),
    key=_key,
    guard=(LAST, None, None),
    default_key=lambda device, dtype: (device, dtype, False, None, None, True),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # decompose: its one impl is the reference's torch ops, which Inductor may fuse with the
    # router's linear and softmax (not measured: nothing of ours to lose)
    compile_mode="decompose",
    # no DTensor layout: the outputs [..., k] are shaped like no argument (DTensor's own rules run
    # the torch impl)
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
