"""``embedding.rope``: rotary position embedding, Hugging Face rotate-half convention.

``q_rot = q · cos + rotate_half(q) · sin`` (same for k), where ``rotate_half(x) =
cat(-x[..., D/2:], x[..., :D/2])``. q is ``[B, Hq, T, D]``, k is ``[B, Hk, T, D]`` (grouped-query
attention: ``Hq != Hk`` is fine), cos/sin are ``[B or 1, T, R]`` and broadcast over the heads (a
batch of 1 also broadcasts over B).

Options: ``rotary_dim`` (R, default ``cos.shape[-1]``, which it must equal) rotates only the first
R features of each head; features R.. pass through unchanged (partial rotary: Phi, GLM, NeoX).
``interleaved=True`` pairs features (2i, 2i+1) (GPT-J, GLM) instead of (i, i + R/2):
``rotate_interleaved(x)[2i] = -x[2i+1]``, ``[2i+1] = x[2i]``, and the tables are laid out like the
features (``cos[2i]`` multiplies feature 2i: GPT-J tables repeat each angle twice).

Math in fp32; each result has its input's dtype. The gradient of q (and k) is the transposed
rotation: ``dq = g · cos - rotate_half(g · sin)`` (pass-through features: ``g`` itself). Gradients
of cos/sin (rarely wanted: they are usually buffers) come from autograd in the torch impl; impls
that do not compute them are excluded by a predicate on the ``rot_grad`` field.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.hit_guard import SHAPE, dims
from ..core.op import Bounds, Case, ErrorModel, Op
from ..distributed.layout import Layout
from . import _checks as check

OP_ID = "embedding.rope"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x[..., D/2:], x[..., :D/2])`` (Hugging Face's ``rotate_half``)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Pairs (2i, 2i+1) -> (-x[2i+1], x[2i]) (GPT-J's ``rotate_every_two``)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64).

    cos/sin are converted once and shared by q and k, so their gradients (when they require
    grad) are summed over both in fp32 and rounded once. Pass-through features are copied as
    they are (no rounding)."""
    tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
    rd = cos.shape[-1]
    turn = rotate_interleaved if interleaved else rotate_half

    def rot(x: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        if acc not in tables:
            tables[acc] = (cos.unsqueeze(1).to(acc), sin.unsqueeze(1).to(acc))
        c, s = tables[acc]
        if rd == x.shape[-1]:
            xf = x.to(acc)
            return (xf * c + turn(xf) * s).to(x.dtype)
        xf = x[..., :rd].to(acc)
        return torch.cat(((xf * c + turn(xf) * s).to(x.dtype), x[..., rd:]), dim=-1)

    return rot(q), rot(k)


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int | None = None,
    interleaved: bool = False,
) -> None:
    for name, t in (("q", q), ("k", k)):
        check.tensor(OP_ID, name, t)
        check.floating(OP_ID, name, t)
        if t.dim() != 4:
            raise check.OpArgumentError(OP_ID, name, f"expected 4 dimensions [B, H, T, D], got shape {tuple(t.shape)}")
    b, _, t_len, d = q.shape
    if k.shape[0] != b or k.shape[2] != t_len or k.shape[3] != d:
        raise check.OpArgumentError(OP_ID, "k", f"expected shape [{b}, Hk, {t_len}, {d}] (q's B, T and D), got {tuple(k.shape)}")
    check.boolean(OP_ID, "interleaved", interleaved)
    if rotary_dim is not None and (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int)):
        raise check.OpTypeError(OP_ID, "rotary_dim", f"expected an int or None, got {check.shown(rotary_dim)}")
    if rotary_dim is not None and (rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d):
        raise check.OpArgumentError(OP_ID, "rotary_dim", f"expected a positive even int <= the head dim D={d}, got {rotary_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        check.tensor(OP_ID, name, t)
        check.floating(OP_ID, name, t)
        if t.dim() != 3 or t.shape[0] not in (1, b) or t.shape[1] != t_len:
            raise check.OpArgumentError(OP_ID, name, f"expected shape [{b} or 1, {t_len}, R] ([B or 1, T] of q), got {tuple(t.shape)}")
    rd = cos.shape[2]
    if rotary_dim is not None and rotary_dim != rd:
        raise check.OpArgumentError(OP_ID, "rotary_dim", f"expected cos's last dim {rd} (or None), got {rotary_dim}")
    if rd == d and (d == 0 or d % 2):  # full rotary: the head dim itself is what cannot pair up
        raise check.OpArgumentError(OP_ID, "q", f"expected a positive even head dim D, got D={d} (shape {tuple(q.shape)})")
    if rd == 0 or rd % 2 or rd > d:
        raise check.OpArgumentError(
            OP_ID, "cos", f"expected a positive even last dim R <= the head dim D={d} (the rotary dim), got shape {tuple(cos.shape)}"
        )
    if sin.shape != cos.shape:
        raise check.OpArgumentError(OP_ID, "sin", f"expected cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    check.same_device(OP_ID, "k", k, "q", q)
    check.same_device(OP_ID, "cos", cos, "q", q)
    check.same_device(OP_ID, "sin", sin, "q", q)


_grad_enabled = torch.is_grad_enabled


def _key(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int | None = None,
    interleaved: bool = False,
) -> tuple:
    """The argument class. It holds everything validity depends on: the four dtypes, and whether
    the shapes agree and share a device as one flag (``args_match``), so that a new sequence length
    needs no new decision; `validate` runs once per class (on the memo miss). The guard (``_op``'s
    ``guard``) recognises a repeat without building it: it pins q's and k's B, T and D (the sizes
    the shape checks relate; their head counts stay free) and the tables' whole shapes, so a
    repeat compares no shape in Python. A new T (or B, D) takes the slow path once: the class in
    Python (a memo hit) and a guard for that T, kept among the op's recent ones. The options are
    held as given; ``partial`` (the tables narrower than the head) is what impls without
    pass-through features need to know, and the guard's pinned sizes fix it."""
    grad = _grad_enabled()
    rot_grad = grad and (cos.requires_grad or sin.requires_grad)
    needs = rot_grad or (grad and (q.requires_grad or k.requires_grad))
    partial = cos.dim() == 3 and q.dim() == 4 and cos.shape[2] != q.shape[3]
    return (
        q.device, q.dtype, needs, rot_grad, k.dtype, cos.dtype, sin.dtype, rotary_dim, interleaved, partial,
        _args_match(q, k, cos, sin, rotary_dim),
    )  # fmt: skip


def _args_match(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None) -> bool:
    """q ``[B, Hq, T, D]``, k ``[B, Hk, T, D]``, cos and sin ``[B or 1, T, R]`` (R even, 0 < R <= D,
    ``rotary_dim`` None or R), all on one device: `validate`'s shape and device conditions, as one
    field of the class (the option types are the class's own fields, checked there)."""
    qs, ks, cs = q.shape, k.shape, cos.shape
    return (
        len(qs) == 4 and len(ks) == 4 and len(cs) == 3
        and ks[0] == qs[0] and ks[2] == qs[2] and ks[3] == qs[3]
        and (cs[0] == 1 or cs[0] == qs[0]) and cs[1] == qs[2] and 0 < cs[2] <= qs[3] and cs[2] % 2 == 0 and sin.shape == cs
        and (rotary_dim is None or rotary_dim == cs[2])
        and q.device == k.device == cos.device == sin.device
    )  # fmt: skip


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embedding to ``q`` and ``k``; returns ``(q_rot, k_rot)``.

    ``rotary_dim`` (default ``cos.shape[-1]``) rotates only the first features of each head (the
    rest pass through); ``interleaved`` pairs features (2i, 2i+1) (GPT-J) instead of rotate-half.

    >>> import torch, polykernel
    >>> q, k = torch.randn(2, 8, 16, 64), torch.randn(2, 2, 16, 64)  # 8 query heads, 2 kv heads
    >>> cos, sin = torch.randn(1, 16, 64), torch.randn(1, 16, 64)
    >>> q_rot, k_rot = polykernel.rope(q, k, cos, sin)
    >>> q_rot.shape, k_rot.shape
    (torch.Size([2, 8, 16, 64]), torch.Size([2, 2, 16, 64]))
    >>> q_rot, k_rot = polykernel.rope(q, k, cos[..., :32], sin[..., :32], interleaved=True)  # GPT-J, half the dims
    """
    return _dispatch(impl, q, k, cos, sin, rotary_dim, interleaved)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# Each output element is x·cos ± x'·sin in fp32, rounded once: the sum of two products may cancel,
# so a kernel that fuses a multiply-add (one rounding fewer) differs by ~u32 of the terms'
# magnitude, max|x|·max(|cos| + |sin|). The backward has the same form (dy·cos ∓ dy'·sin, |dy| <= 1);
# cos/sin gradients sum dy·x over the heads of q and k (and over B when cos/sin are shared).
# Pass-through features are copied exactly, so the bounds hold for partial rotary as they are.
def error_model(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_: object, **__: object) -> Bounds:
    def amax(t: torch.Tensor) -> float:
        return t.detach().abs().max().item() if t.numel() else 0.0

    cs = amax(cos.detach().double().abs() + sin.detach().double().abs())
    heads = (q.shape[1] + k.shape[1]) * max(1, q.shape[0] // max(1, cos.shape[0]))
    table = ErrorModel(ops=2, cancel=2, sum_abs=1, n=heads)
    return Bounds(
        outputs=(ErrorModel(ops=2, cancel=2, scale=amax(q) * cs), ErrorModel(ops=2, cancel=2, scale=amax(k) * cs)),
        grads={0: ErrorModel(ops=2, cancel=2, scale=cs), 1: ErrorModel(ops=2, cancel=2, scale=cs), 2: table, 3: table},
    )


def _rope_tables(
    b: int, t: int, d: int, dtype: torch.dtype, device: torch.device | str, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face style cos/sin ``[b, t, d]`` (``cat(freqs, freqs)``), positions offset per batch."""
    inv = 1.0 / base ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    pos = torch.arange(t, device=device, dtype=torch.float32)[None, :] + 7.0 * torch.arange(b, device=device)[:, None]
    freqs = pos[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random arguments for a q shape ``[B, Hq, T, D]``; k gets ``max(1, Hq // 4)`` heads (GQA)."""
    b, hq, t, d = shape
    hk = max(1, hq // 4)
    q = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    k = torch.randn((b, hk, t, d), dtype=dtype, device=device, requires_grad=requires_grad)
    cos, sin = _rope_tables(1, t, d, dtype, device)
    return Case(f"{'x'.join(map(str, shape))}-k{hk}", (q, k, cos, sin))


def bytes_moved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: forward reads q, k, cos, sin and writes q_rot, k_rot; the backward moves the
    same again (reads dq_rot, dk_rot, cos, sin; writes dq, dk)."""
    n = 2 * (q.numel() * q.element_size() + k.numel() * k.element_size())
    n += cos.numel() * cos.element_size() + sin.numel() * sin.element_size()
    return 2 * n if backward else n


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and layouts, sized for the CPU interpreter unless ``large``."""

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device, dtype=dtype).requires_grad_()

    def tables(b: int, tl: int, d: int, cdtype: torch.dtype = dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return _rope_tables(b, tl, d, cdtype, device)

    def rand_tables(b: int, tl: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        # halves that differ: catches a kernel that assumes cos[:D/2] == cos[D/2:]
        return torch.rand(b, tl, d, device=device).to(dtype) * 2 - 1, torch.rand(b, tl, d, device=device).to(dtype) * 2 - 1

    def hf(b: int, tl: int, h: int, d: int) -> torch.Tensor:
        # how HF models produce q/k: a [B, T, H*D] projection viewed [B, T, H, D], transposed
        return t(b, tl, h * d).view(b, tl, h, d).transpose(1, 2)

    qkv = t(2, 9, (4 + 2 * 2) * 16)  # a fused QKV projection: q and k are strided views of it
    out = [
        Case("1x1x1x2-D2", (t(1, 1, 1, 2), t(1, 1, 1, 2), *tables(1, 1, 2))),
        Case("2x4x1x64-T1", (t(2, 4, 1, 64), t(2, 2, 1, 64), *tables(1, 1, 64))),
        Case("1x3x7x32-B1", (t(1, 3, 7, 32), t(1, 3, 7, 32), *tables(1, 7, 32))),
        Case("3x4x5x16-cosB", (t(3, 4, 5, 16), t(3, 1, 5, 16), *tables(3, 5, 16))),
        Case("2x6x13x24-gqa", (t(2, 6, 13, 24), t(2, 2, 13, 24), *tables(1, 13, 24))),
        Case("2x4x11x20-randtables", (t(2, 4, 11, 20), t(2, 3, 11, 20), *rand_tables(2, 11, 20))),
        Case("2x8x33x64-hf-transposed", (hf(2, 33, 8, 64), hf(2, 33, 2, 64), *tables(2, 33, 64))),
        Case(
            "2x4x9x16-fused-qkv",
            (
                qkv[..., : 4 * 16].view(2, 9, 4, 16).transpose(1, 2),
                qkv[..., 4 * 16 : 6 * 16].view(2, 9, 2, 16).transpose(1, 2),
                *tables(1, 9, 16),
            ),
        ),
        Case("2x3x10x32-strided-d", (t(2, 3, 10, 64)[..., ::2], t(2, 1, 10, 32), *tables(2, 10, 32))),
        Case(
            "2x2x6x16-strided-cos",
            (t(2, 2, 6, 16), t(2, 2, 6, 16), *(x[:, ::2] for x in rand_tables(2, 12, 16))),
        ),
        Case("2x4x5x32-fp32-tables", (t(2, 4, 5, 32), t(2, 1, 5, 32), *tables(1, 5, 32, torch.float32))),
        Case("2x2x0x16-empty-T", (t(2, 2, 0, 16), t(2, 1, 0, 16), *tables(1, 0, 16))),
        Case("2x3x4x8-no-k-heads", (t(2, 3, 4, 8), t(2, 0, 4, 8), *tables(2, 4, 8))),
        Case("1x40x3x256-many-heads", (t(1, 40, 3, 256), t(1, 5, 3, 256), *tables(1, 3, 256))),
        Case("1x2x3x272-long-D", (t(1, 2, 3, 272), t(1, 3, 3, 272), *rand_tables(1, 3, 272))),
        # the options: partial rotary (the tail passes through), GPT-J pairs, both, awkward shapes
        Case("2x4x7x32-partial16", (t(2, 4, 7, 32), t(2, 2, 7, 32), *tables(1, 7, 16)), {"rotary_dim": 16}),
        Case("1x3x5x24-partial8-randtables", (t(1, 3, 5, 24), t(1, 1, 5, 24), *rand_tables(1, 5, 8))),
        Case("2x6x9x20-interleaved", (t(2, 6, 9, 20), t(2, 2, 9, 20), *rand_tables(2, 9, 20)), {"interleaved": True}),
        Case(
            "2x4x11x64-interleaved-partial32-hf",
            (hf(2, 11, 4, 64), hf(2, 11, 1, 64), *rand_tables(1, 11, 32)),
            {"rotary_dim": 32, "interleaved": True},
        ),
        Case("1x2x3x10-odd-pass-interleaved", (t(1, 2, 3, 10), t(1, 2, 3, 10), *rand_tables(1, 3, 6)), {"interleaved": True}),
        Case("2x3x5x9-odd-D-partial8", (t(2, 3, 5, 9), t(2, 1, 5, 9), *rand_tables(1, 5, 8))),
        Case("2x2x4x272-partial256", (t(2, 2, 4, 272), t(2, 1, 4, 272), *rand_tables(2, 4, 256)), {"rotary_dim": 256}),
    ]
    if large:
        out += [
            Case("4x32x4096x128-k8", (t(4, 32, 4096, 128), t(4, 8, 4096, 128), *tables(1, 4096, 128))),
            Case("2x32x2048x128-hf-cosB", (hf(2, 2048, 32, 128), hf(2, 2048, 8, 128), *tables(2, 2048, 128))),
            Case("1x40x1000x80-k8-odd", (t(1, 40, 1000, 80), t(1, 8, 1000, 80), *tables(1, 1000, 80))),
            Case("64x32x1x128-decode", (t(64, 32, 1, 128), t(64, 8, 1, 128), *tables(64, 1, 128))),
            Case("2x12x777x256-randtables", (t(2, 12, 777, 256), t(2, 4, 777, 256), *rand_tables(2, 777, 256))),
            Case("2x32x2048x128-partial64-hf", (hf(2, 2048, 32, 128), hf(2, 2048, 2, 128), *tables(1, 2048, 64)), {"rotary_dim": 64}),
            Case("2x32x1000x128-interleaved", (t(2, 32, 1000, 128), t(2, 8, 1000, 128), *rand_tables(1, 1000, 128)), {"interleaved": True}),
        ]
    return out


def _dtensor_expect(args: tuple[Any, ...], d: int) -> dict[int, int | None]:
    """DTensor placements (the layout's ``expect``) for q and k sharded on dim ``d``: cos/sin follow
    q's batch (a batch-1 table is shared), are shared by every head, and follow the sequence on
    their dim 1."""
    q, _, cos, _ = args[:4]
    if d == 0:  # batch: per-batch tables follow q, a batch-1 table is shared
        table = 0 if cos.shape[0] == q.shape[0] and q.shape[0] != 1 else None
    elif d == 1:  # heads: the tables are the same for every head
        table = None
    else:  # sequence: the tables' T dim is their dim 1
        table = 1
    return {0: d, 1: d, 2: table, 3: table}


def outputs(q: torch.Tensor, k: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shapes and dtypes, without running it (the first-call check)."""
    return ((q.shape, q.dtype), (k.shape, k.dtype))


_op = Op(
    OP_ID,
    fields=(
        "device",
        "dtype",
        "needs_grad",
        "rot_grad",
        "k_dtype",
        "cos_dtype",
        "sin_dtype",
        "rotary_dim",
        "interleaved",
        "partial",
        "args_match",
    ),
    key=_key,
    guard=(dims(0, 2, 3), dims(0, 2, 3), SHAPE, SHAPE, None, None),
    default_key=lambda device, dtype: (device, dtype, False, False, dtype, dtype, dtype, None, False, False, True),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # torch.compile: Inductor's code is faster than ours here (the torch.compile rows of
    # benchmarks/results/h200-2026-11-30-graph.json): the op decomposes and Inductor fuses it
    compile_mode="decompose",
    dtensor_layout=Layout((0, 1, 2), _dtensor_expect, (0, 1), "it is the head dim D, which the rotation mixes"),
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
