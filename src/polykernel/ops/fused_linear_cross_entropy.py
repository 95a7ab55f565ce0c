"""``loss.fused_linear_cross_entropy``: ``cross_entropy(hidden @ weight.T + bias, target)`` without
ever holding the ``[N, V]`` logits.

``hidden`` is ``[..., H]``, ``weight`` ``[V, H]`` (the LM head), ``bias`` ``[V]`` or None, all of
one floating dtype; ``target`` ``[...]`` int64/int32. The logits are computed in ``hidden``'s
dtype (what ``F.linear`` gives), then the loss follows ``loss.cross_entropy`` exactly (fp32,
``ignore_index``, ``label_smoothing``, ``reduction``, and its options: class weights, here
``ce_weight`` since ``weight`` is the LM head (Liger's name), ``softcap`` and ``z_loss``; see that
op, also for out-of-range targets). ``return_token_accuracy=True`` returns ``(loss, accuracy)``:
the share of scored targets that are their row's argmax logit (the first maximum; the softcap is
monotonic, so it does not change it), a 0-dim fp32 tensor without grad, NaN when no target is
scored. It is a second, no-grad pass over the row chunks (one more ``N·H·V`` matmul): correct
with every impl, since it never touches the loss.

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

import math

import torch
import torch.nn.functional as F

from ..compile.facts import SavedGrads
from ..core.hit_guard import SHAPE
from ..core.op import SUM_LAMBDA, TINY, Bounds, Case, ErrorModel, Op
from ..distributed.layout import ROWS, Layout, rows_with
from . import _autocast
from . import _checks as check
from .cross_entropy import as_smoothing, as_softcap, validate_extras, validate_options, validate_target, weight_matches
from .cross_entropy import reference as _ce_reference

OP_ID = "loss.fused_linear_cross_entropy"


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    ce_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """The semantics, in plain torch (materializes the ``[N, V]`` logits)."""
    return _ce_reference(F.linear(hidden, weight, bias), target, ignore_index, label_smoothing, reduction, ce_weight, softcap, z_loss)


def validate(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    ce_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
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
    validate_extras(OP_ID, ce_weight, softcap, z_loss, weight.shape[0], "hidden", hidden, weight_name="ce_weight")


def _key(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    ce_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> tuple:
    """The argument class. It holds everything validity depends on (the options, target's dtype,
    and whether weight, bias and target agree with hidden in shape, dtype and device as one flag),
    so `validate` runs once per class (on the memo miss), except on the CPU (see
    `loss.cross_entropy`). The guard (``_op``'s ``guard``) recognises a repeat without building
    it: every tensor's whole shape (which the flag relates), so a repeat compares no shape in
    Python."""
    v = weight.shape[0]
    matches = (
        weight.dim() == 2 and weight.shape[1] == hidden.shape[-1] and weight.dtype == hidden.dtype and weight.device == hidden.device
        and (bias is None or (bias.shape == (v,) and bias.dtype == hidden.dtype and bias.device == hidden.device))
        and target.shape == hidden.shape[:-1] and target.device == hidden.device
        and weight_matches(ce_weight, v, hidden.device)
    )  # fmt: skip
    return (
        hidden.device,
        hidden.dtype,
        check.needs_grad(hidden, weight, bias),
        hidden.shape[-1],
        v,
        bias is not None,
        ignore_index,
        label_smoothing,
        reduction,
        target.dtype,
        matches,
        ce_weight is not None,
        softcap,
        z_loss,
    )


_compiling = torch.compiler.is_compiling
_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    ce_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
    return_token_accuracy: bool = False,
    impl: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``target``, logits never materialized.

    ``ce_weight`` (class weights), ``softcap``, ``z_loss`` and ``return_token_accuracy``: see the
    module docstring.

    >>> import torch, polykernel
    >>> h, w = torch.randn(6, 16), torch.randn(100, 16)
    >>> target = torch.tensor([1, 5, -100, 99, 0, 3])
    >>> polykernel.fused_linear_cross_entropy(h, w, target).shape
    torch.Size([])
    >>> loss, acc = polykernel.fused_linear_cross_entropy(h, w, target, softcap=30.0, return_token_accuracy=True)
    >>> acc.shape, acc.dtype
    (torch.Size([]), torch.float32)
    """
    ls = label_smoothing if type(label_smoothing) is float else as_smoothing(label_smoothing)
    cap = softcap if softcap is None or type(softcap) is float else as_softcap(softcap)
    z = z_loss if type(z_loss) is float else as_smoothing(z_loss)
    check.boolean(OP_ID, "return_token_accuracy", return_token_accuracy)
    args = (hidden, weight, target, bias, ignore_index, ls, reduction, ce_weight, cap, z)
    autocast = _any_autocast()
    if autocast:  # the heads as F.linear there (before validation: it takes mixed dtypes then, on every device)
        args = _op.autocast(args)
    if (
        not isinstance(target, torch.Tensor) or target.is_cpu
    ) and not _compiling():  # its values: every call (compiled: the custom op validates)
        validate(*args)  # there (its range): every call
    if autocast:  # every impl alike (ops._autocast): the heads cast above
        loss = _autocast.without(_dispatch, impl, args)
    else:
        loss = _dispatch(impl, *args)  # _op.dispatch; see _key
    if return_token_accuracy:
        return loss, token_accuracy(hidden, weight, target, bias, ignore_index)
    return loss


ACCURACY_CHUNK_BYTES = 256 << 20  # logits of one row chunk of the accuracy pass


def token_accuracy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """Share of scored targets (``!= ignore_index``) that are their row's argmax of ``hidden @
    weight.T + bias`` (first maximum), as a 0-dim fp32 tensor without grad (NaN: none scored).
    Row chunks of ``ACCURACY_CHUNK_BYTES`` logits, never the ``[N, V]`` logits."""
    h = hidden.shape[-1]
    h2 = hidden.detach().reshape(-1, h) if h else hidden.detach().reshape(target.numel(), 0)
    t = target.reshape(-1)
    v = weight.shape[0]
    step = max(1, ACCURACY_CHUNK_BYTES // (max(v, 1) * hidden.element_size()))
    w, b = weight.detach(), None if bias is None else bias.detach()
    correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
    with torch.no_grad():
        for s in range(0, h2.shape[0], step):
            tc = t[s : s + step]
            pred = F.linear(h2[s : s + step], w, b).argmax(-1)
            correct += ((pred == tc) & (tc != ignore_index)).sum()
        scored = (t != ignore_index).sum()
    return (correct.to(torch.float32) / scored.to(torch.float32)).reshape(())


def flops(hidden: torch.Tensor, weight: torch.Tensor, *_: object, backward: bool = False, **__: object) -> int:
    """Matmul FLOPs: 2·N·H·V forward (the logits); fwd+bwd 6·N·H·V (+ dH and dW).

    (The impls' ``reduction="none"`` backward recomputes the logits: 8·N·H·V actually run.)
    """
    n = hidden.numel() // max(hidden.shape[-1], 1)
    return (6 if backward else 2) * n * hidden.shape[-1] * weight.shape[0]


def bytes_moved(hidden: torch.Tensor, weight: torch.Tensor, *_: object, backward: bool = False, **__: object) -> int:
    """Fewest bytes: read hidden and weight (+ write dH and dW in the backward). The op is
    matmul-bound: rate it by ``flops`` (6·N·H·V for fwd+bwd), not by these bytes."""
    n = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    return 2 * n if backward else n


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# The logits z = h·Wᵀ + b are a matmul in the inputs' dtype: rounded to it (u_d) after an fp32 sum
# over H, so each is off by δ <= (u_d + λ·√H·u32)·Z, Z = max|z|. The loss then follows
# cross_entropy's model on z (rows of size Z + 1) plus 2δ (lse moves by at most max δ, z_target by
# δ). Backward: dz = c·(p - onehot - ε/V) moves by 2·δ·c·p plus its rounding to the dtype; dH = dz·W
# sums over V (Σ p = 1: off by ~c·max|W|·(2δ + 2u_d)), dW = dzᵀ·h and db sum over rows, relative to
# their own magnitude. c is 1/(valid rows) for "mean", else 1 (cotangents |dy| <= 1).
def error_model(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    ce_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> Bounds:
    (v, h), n = weight.shape, hidden.numel() // max(1, hidden.shape[-1])
    valid = max(1, int((target != ignore_index).sum()))
    z_max = 0.0
    for rows in hidden.detach().reshape(-1, h).split(1024):  # max|z| without the [N, V] logits at once
        z = torch.nn.functional.linear(rows.float(), weight.detach().float(), None if bias is None else bias.detach().float())
        z_max = max(z_max, z.abs().max().item() if z.numel() else 0.0)
    w_max = weight.detach().abs().max().item() if weight.numel() else 0.0
    big = max(v, h, n)
    # the options (loss.cross_entropy's model): softcap bounds z (tanh's ops), z_loss multiplies
    # lse's error by 1 + 2·z·|lse|, class weights scale sums and gradients by max|w| (a weighted
    # mean by max|w|·rows / |Σ w[t]|)
    zc = min(z_max, softcap) if softcap is not None else z_max
    zf = 1.0 + 2.0 * z_loss * (zc + math.log(max(v, 1)))
    wf = 1.0
    if ce_weight is not None:
        cw = ce_weight.detach().to(torch.float64)
        wf = max(cw.abs().max().item() if cw.numel() else 1.0, 1e-30)
        scored = target.reshape(-1) != ignore_index
        wt = torch.where(scored, cw[torch.where(scored, target.reshape(-1), 0).long()], 0.0) if v else cw[:0]
        if reduction == "mean":
            wf *= valid / (abs(wt.sum().item()) or 1.0)
    extra_ops = 4 if softcap is not None else 0
    loss = ErrorModel(
        ops=4 + extra_ops,
        sum_rel=1,
        rounds_abs=2,
        cancel=6,
        sum_abs=2,
        n=big,
        scale=(z_max + 1) * zf * wf * (valid**0.5 if reduction == "sum" else 1.0),
        inter=hidden.dtype,
    )
    c = (1.0 / valid if reduction == "mean" else 1.0) * zf * wf
    # dz rounded to the inputs' dtype is off by up to TINY absolute where it is subnormal (fp16:
    # c·p ~ 1e-9 at N = 8K, V = 128K), summed with random signs over V (dH) or N rows (dW)
    h_max = hidden.detach().abs().max().item() if hidden.numel() else 0.0
    tiny = TINY[hidden.dtype] if hidden.dtype in TINY else 0.0
    d_hidden = ErrorModel(
        ops=4 + extra_ops,
        rounds_abs=2 * (z_max + 1),
        cancel=8,
        sum_abs=1 + 2 * z_max,
        n=big,
        scale=c * w_max,
        inter=hidden.dtype,
        floor=SUM_LAMBDA * v**0.5 * tiny * w_max,
    )
    # dW may be accumulated in its own dtype over row chunks of >= 256 MiB of logits (the module
    # docstring): one rounding per chunk
    chunks = max(1, -(-n * v * hidden.element_size() // (256 << 20)))
    d_weight = ErrorModel(
        rounds=chunks,
        ops=4 + extra_ops,
        rounds_abs=2 * (z_max + 1),
        cancel=8,
        sum_abs=1 + 2 * z_max,
        n=big,
        inter=hidden.dtype,
        floor=SUM_LAMBDA * n**0.5 * tiny * h_max,
    )
    return Bounds(outputs=(loss,), grads={0: d_hidden, 1: d_weight, 3: d_weight})


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

    def cw(v: int) -> torch.Tensor:  # class weights in [0, 2), a fifth of them 0
        out = 2 * torch.rand(v, device=device)
        return out.masked_fill(torch.rand(v, device=device) < 0.2, 0.0)

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
        # the options (loss.cross_entropy), alone and together; class weights with zeros
        Case("9x16x1000-weight", (hid(9, 16), w(1000, 16), t(1000, 9, ignored=0.2)), {"ce_weight": cw(1000)}),
        Case("8x16x3001-softcap", (hid(8, 16), w(3001, 16, 8.0), t(3001, 8, ignored=0.2)), {"softcap": 6.0}),
        Case("8x16x1000-zloss-sum", (hid(8, 16), w(1000, 16), t(1000, 8)), {"z_loss": 1e-2, "reduction": "sum"}),
        Case(
            "10x16x1500-all-options-none",
            (hid(10, 16), w(1500, 16, 6.0), t(1500, 10, ignored=0.2), b(1500)),
            {"ce_weight": cw(1500), "softcap": 5.0, "z_loss": 1e-3, "label_smoothing": 0.1, "reduction": "none"},
        ),
        Case(
            "12x24x1000-all-options",
            (hid(12, 24), w(1000, 24, 6.0), t(1000, 12, ignored=0.2), b(1000)),
            {"ce_weight": cw(1000), "softcap": 5.0, "z_loss": 1e-3, "label_smoothing": 0.1},
        ),
        Case(
            "9x16x2000-allignored-options",
            (hid(9, 16), w(2000, 16), t(2000, 9, ignored=1.0)),
            {"softcap": 5.0, "z_loss": 1e-3, "ce_weight": cw(2000)},
        ),
    ]
    if large:
        out += [
            Case("8192x4096x128256", (hid(8192, 4096), w(128256, 4096), t(128256, 8192, ignored=0.05))),
            Case("4096x4096x256000-smooth", (hid(4096, 4096), w(256000, 4096), t(256000, 4096, ignored=0.05)), {"label_smoothing": 0.1}),
            Case("2050x2048x128256-bias-sum", (hid(2050, 2048), w(128256, 2048), t(128256, 2050), b(128256)), {"reduction": "sum"}),
            Case("1031x2048x32000-none", (hid(1031, 2048), w(32000, 2048), t(32000, 1031, ignored=0.1)), {"reduction": "none"}),
            # Gemma 2's head: final_logit_softcapping = 30, plus a PaLM z-loss
            Case(
                "4096x2304x256000-softcap-zloss",
                (hid(4096, 2304), w(256000, 2304), t(256000, 4096, ignored=0.05)),
                {"softcap": 30.0, "z_loss": 1e-4},
            ),
        ]
    return out


def outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    ce_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    logits = torch.promote_types(hidden.dtype, weight.dtype)
    shape = target.shape if reduction == "none" else torch.Size()
    return ((shape, torch.promote_types(logits, torch.float32)),)


_op = Op(
    OP_ID,
    fields=(
        "device",
        "dtype",
        "needs_grad",
        "hidden_size",
        "n_classes",
        "has_bias",
        "ignore_index",
        "label_smoothing",
        "reduction",
        "target_dtype",
        "args_match",
        "has_weight",
        "softcap",
        "z_loss",
    ),
    key=_key,
    guard=(SHAPE, SHAPE, SHAPE, SHAPE, None, None, None, SHAPE, None, None),
    default_key=lambda device, dtype: (device, dtype, False, None, None, False, -100, 0.0, "mean", torch.int64, True, False, None, 0.0),
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
    # torch.compile: our custom ops (compile can only run the op by materializing the [N, V]
    # logits). Saves grad_hidden, grad_weight, grad_bias (fp32): computed in the forward for
    # "sum"/"mean", each a placeholder where grad_mask does not ask for it, and all three for
    # "none" (recomputed); for "sum"/"mean" they are the gradients (saved_grads).
    saved=("lead", "sum", "sum"),
    saved_grads=SavedGrads({"hidden": 0, "weight": 1, "bias": 2}, lambda a: a["reduction"] != "none"),
    # target, ignore_index, reduction; ce_weight; weight Shard(0): vocab-parallel (polykernel.distributed.vocab)
    dtensor_layout=Layout(ROWS, rows_with(2), ("loss",), loss_args=(2, 4, 6), loss_weight=7, vocab="weight"),
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
_any_autocast = _autocast.any_autocast
