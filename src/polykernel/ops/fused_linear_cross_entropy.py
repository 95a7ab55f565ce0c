"""``loss.fused_linear_cross_entropy``: ``cross_entropy(hidden @ weight.T + bias, target)`` without
ever holding the ``[N, V]`` logits.

``hidden`` is ``[..., H]``, ``weight`` ``[V, H]`` (the LM head), ``bias`` ``[V]`` or None, all of
one floating dtype; ``target`` ``[...]`` int64/int32. The logits are computed in ``hidden``'s
dtype (what ``F.linear`` gives), then the loss follows ``loss.cross_entropy`` exactly (fp32,
``ignore_index``, ``label_smoothing``, ``reduction``; see that op for out-of-range targets).

Impls walk the rows in chunks whose logits stay small (``CHUNK_BYTES`` in
``polykernel.backends.torch.fused_linear_cross_entropy``, 256 MiB by default), and, when inputs
require grad and the reduction is mean/sum, compute the gradients during the forward: per chunk
``dlogits`` (written over the chunk's logits), ``grad_hidden[chunk] = dlogits @ weight``,
``grad_weight += dlogits.T @ hidden[chunk]`` (accumulated in weight's dtype, one rounding per
chunk), ``grad_bias += dlogits.sum(0)`` (fp32). The backward scales them by grad_output (skipped
when it is exactly 1; that check syncs, except while a CUDA graph is captured), so the graph can
be back-propagated once (``retain_graph`` double backward raises). With ``reduction="none"`` the
per-row grad_output is only known in the backward, which recomputes the chunk logits instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..op import Case, Op, Tol, Tolerances
from ..spec import CapabilityRequirement, FormatSignature, KernelSpec
from . import _checks as check
from .cross_entropy import reference as _ce_reference
from .cross_entropy import validate_options, validate_target

OP_ID = "loss.fused_linear_cross_entropy"


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """The semantics, in plain torch (materializes the ``[N, V]`` logits)."""
    return _ce_reference(F.linear(hidden, weight, bias), target, ignore_index, label_smoothing, reduction)


def validate(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
) -> None:
    check.tensor(OP_ID, "hidden", hidden)
    check.floating(OP_ID, "hidden", hidden)
    check.tensor(OP_ID, "weight", weight)
    check.floating(OP_ID, "weight", weight)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise check.OpArgumentError(
            OP_ID, "weight", f"expected shape (V, {hidden.shape[-1]}) to match hidden's last dim, got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise check.OpArgumentError(OP_ID, "weight", "expected at least one class (V >= 1), got V = 0")
    if weight.dtype != hidden.dtype:
        raise check.OpTypeError(OP_ID, "weight", f"expected hidden's dtype {hidden.dtype}, got {weight.dtype}")
    check.same_device(OP_ID, "weight", weight, "hidden", hidden)
    if bias is not None:
        check.tensor(OP_ID, "bias", bias)
        if bias.dtype != hidden.dtype:
            raise check.OpTypeError(OP_ID, "bias", f"expected hidden's dtype {hidden.dtype}, got {bias.dtype}")
        if bias.shape != (weight.shape[0],):
            raise check.OpArgumentError(
                OP_ID, "bias", f"expected shape ({weight.shape[0]},) to match weight's first dim, got {tuple(bias.shape)}"
            )
        check.same_device(OP_ID, "bias", bias, "hidden", hidden)
    validate_options(OP_ID, ignore_index, label_smoothing, reduction)
    validate_target(OP_ID, target, hidden.shape[:-1], weight.shape[0], ignore_index, "hidden", hidden)


def _key(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None, *_: object, **__: object
) -> tuple:
    return (hidden.device, hidden.dtype, check.needs_grad(hidden, weight, bias), hidden.shape[-1], weight.shape[0], bias is not None)


_op: Op  # defined below, after the public function it serves


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    impl: str | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``target``, logits never materialized.

    >>> import torch, polykernel
    >>> h, w = torch.randn(6, 16), torch.randn(100, 16)
    >>> target = torch.tensor([1, 5, -100, 99, 0, 3])
    >>> polykernel.fused_linear_cross_entropy(h, w, target).shape
    torch.Size([])
    """
    validate(hidden, weight, target, bias, ignore_index, label_smoothing, reduction)
    return _op.call(
        impl,
        (hidden.device, hidden.dtype, check.needs_grad(hidden, weight, bias), hidden.shape[-1], weight.shape[0], bias is not None),
        hidden,
        weight,
        target,
        bias,
        ignore_index,
        float(label_smoothing),
        reduction,
    )


def flops(hidden: torch.Tensor, weight: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Matmul FLOPs: 2·N·H·V forward (the logits); fwd+bwd 6·N·H·V (+ dH and dW).

    (The impls' ``reduction="none"`` backward recomputes the logits: 8·N·H·V actually run.)
    """
    n = hidden.numel() // max(hidden.shape[-1], 1)
    return (6 if backward else 2) * n * hidden.shape[-1] * weight.shape[0]


def bytes_moved(hidden: torch.Tensor, weight: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: read hidden and weight (+ write dH and dW in the backward). The op is
    matmul-bound: rate it by ``flops`` (6·N·H·V for fwd+bwd), not by these bytes."""
    n = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    return 2 * n if backward else n


# -- tolerances: measured errors of the impls against `reference`, with headroom ----------------
# Forward: the chunk matmul may round a logit differently from the full one (another blocking):
# an ulp of the logits' dtype moves a row's loss by ~ulp·|logit| at worst, averaged by the mean.
# Backward: dlogits are rounded to the dtype as in the reference, but a 1-ulp flip of one dlogit
# (Triton's exp2 vs torch's exp; grad_output applied after the matmuls, i.e. after that
# rounding, for mean/sum) goes through the matmuls, and dH = Σ_j dlogit_j·W_j cancels (softmax
# minus one-hot sums to 0): the error is ~2^-8 (bf16) / 2^-11 (fp16) of the *terms*, so of the
# gradient's scale, not of each element. dW also takes one rounding per row chunk. Measured on
# the CPU cases (gradients up to ~5): bf16 up to 3.1e-2 absolute where |ref| ~ 2 (1.5% of it),
# 1.6e-2 on small elements; fp16 up to 2e-3. fp32: matmul accumulation order only (~1e-7 of
# the gradient's scale here, ~sqrt(V)·2^-24 of it at V = 128K).
TOLERANCES = Tolerances(
    forward={
        torch.float32: Tol(atol=2e-5, rtol=2e-5),
        torch.float64: Tol(atol=1e-10, rtol=1e-10),
        torch.bfloat16: Tol(atol=2e-3, rtol=2e-3),
        torch.float16: Tol(atol=5e-4, rtol=5e-4),
    },
    backward={
        # H200, N=2050 H=2048 V=128256, reduction='sum' with bias (bias grad sums 2050 rows): the
        # Triton impl measured 1.74x (fp32) and 1.43x (fp16) of the previous 2e-6/2e-5 and 1.5e-3/4e-3.
        torch.float32: Tol(atol=5e-6, rtol=5e-5),
        torch.float64: Tol(atol=1e-12, rtol=1e-10),
        torch.bfloat16: Tol(atol=1e-2, rtol=2e-2),
        torch.float16: Tol(atol=3e-3, rtol=8e-3),
    },
)


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """``shape`` = (N, H, V): hidden [N, H], weight [V, H] (~unit-variance logits), ~5% ignored."""
    n, h, v = shape
    hidden = torch.randn(n, h, device=device).to(dtype).requires_grad_(requires_grad)
    weight = (torch.randn(v, h, device=device) / h**0.5).to(dtype).requires_grad_(requires_grad)
    target = torch.randint(0, v, (n,), device=device).masked_fill(torch.rand(n, device=device) < 0.05, -100)
    return Case(f"{n}x{h}x{v}", (hidden, weight, target))


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""

    def hid(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device).to(dtype).requires_grad_()

    def w(v: int, h: int, scale: float = 2.0) -> torch.Tensor:
        return (scale * torch.randn(v, h, device=device) / h**0.5).to(dtype).requires_grad_()

    def b(v: int) -> torch.Tensor:
        return torch.randn(v, device=device).to(dtype).requires_grad_()

    def t(v: int, *shape: int, ignored: float = 0.0) -> torch.Tensor:
        out = torch.randint(0, v, shape, device=device)
        return out.masked_fill(torch.rand(shape, device=device) < ignored, -100)

    out = [
        Case("1x8x1000", (hid(1, 8), w(1000, 8), t(1000, 1))),
        Case("0x8x1000", (hid(0, 8), w(1000, 8), t(1000, 0))),
        Case("0x8x1000-sum", (hid(0, 8), w(1000, 8), t(1000, 0)), {"reduction": "sum"}),
        Case("17x32x3001-ignored", (hid(17, 32), w(3001, 32), t(3001, 17, ignored=0.3))),
        Case("9x16x2000-allignored", (hid(9, 16), w(2000, 16), t(2000, 9, ignored=1.0))),
        Case("12x24x1000-bias-smooth", (hid(12, 24), w(1000, 24), t(1000, 12, ignored=0.2), b(1000)), {"label_smoothing": 0.1}),
        Case("10x16x4999-sum-bias", (hid(10, 16), w(4999, 16), t(4999, 10), b(4999)), {"reduction": "sum"}),
        Case("10x16x1500-none", (hid(10, 16), w(1500, 16), t(1500, 10, ignored=0.2)), {"reduction": "none"}),
        Case("8x16x1200-none-bias-smooth", (hid(8, 16), w(1200, 16), t(1200, 8), b(1200)), {"reduction": "none", "label_smoothing": 0.3}),
        Case("2x3x16x800-3d", (hid(2, 3, 16), w(800, 16), t(800, 2, 3))),
        Case("7x16x1000-strided", (hid(7, 32)[:, ::2], w(1000, 32)[:, ::2], t(1000, 7))),
        Case("6x8x20000-longV", (hid(6, 8), w(20000, 8), t(20000, 6)), {"label_smoothing": 0.05}),
    ]
    if large:
        out += [
            Case("8192x4096x128256", (hid(8192, 4096), w(128256, 4096), t(128256, 8192, ignored=0.05))),
            Case("4096x4096x256000-smooth", (hid(4096, 4096), w(256000, 4096), t(256000, 4096, ignored=0.05)), {"label_smoothing": 0.1}),
            Case("2050x2048x128256-bias-sum", (hid(2050, 2048), w(128256, 2048), t(128256, 2050), b(128256)), {"reduction": "sum"}),
            Case("1031x2048x32000-none", (hid(1031, 2048), w(32000, 2048), t(32000, 1031, ignored=0.1)), {"reduction": "none"}),
        ]
    return out


_TRITON_DTYPES = FormatSignature(supported_dtypes=("float32", "bfloat16", "float16"))

# Peers (Liger-Kernel 0.8.5, QuACK 0.6.5): adapters in polykernel/backends/{liger,quack}/<op>.py,
# predicates in backends/{liger,quack}/_gates.py. Ranks are static until measured selection
# lands; the figures are ../shared/gpu/README.md's (H200, bf16, CUDA-graph replays, TB/s).
IMPLS = [
    KernelSpec(
        OP_ID,
        "torch",
        "polykernel.backends.torch.fused_linear_cross_entropy:fused_linear_cross_entropy",
        rank=100,
        description="row chunks: torch matmul + row-chunked torch cross-entropy, gradients during the forward",
    ),
    KernelSpec(
        OP_ID,
        "triton",
        "polykernel.backends.triton.fused_linear_cross_entropy:fused_linear_cross_entropy",
        capabilities=frozenset({CapabilityRequirement.CUDA}),
        requires_modules=("triton",),
        format_signature=_TRITON_DTYPES,
        rank=10,
        description="row chunks: torch matmul + the Triton cross-entropy kernel (loss and dlogits in one launch, in place)",
    ),
    # Liger: 54.9 ms vs our 39.6 ms per call fwd+bwd (N=8192 H=4096 V=128256), 63 MiB vs 251 MiB
    # extra memory; a host sync per call (not CUDA-graph safe). Behind Triton.
    # QuACK's chunked linear cross-entropy (quack.linear_cross_entropy) is not registered: on the
    # H200 stack it fails with a CuTeDSL epilogue ContextVar error.
    KernelSpec(
        OP_ID,
        "liger",
        "polykernel.backends.liger.fused_linear_cross_entropy:fused_linear_cross_entropy",
        capabilities=frozenset({CapabilityRequirement.CUDA}),
        requires_modules=("liger_kernel", "triton"),
        format_signature=_TRITON_DTYPES,
        rank=30,
        cuda_graph_safe=False,
        description="Liger LigerFusedLinearCrossEntropyFunction (grads in the forward, fp32 dW accumulation); host sync per call",
    ),
]

_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "hidden_size", "n_classes", "has_bias"),
    key=_key,
    default_key=lambda device, dtype: (device, dtype, False, None, None, False),
    reference=reference,
    tolerances=TOLERANCES,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    impls=IMPLS,
)
