"""``embedding.mrope``: Qwen2-VL's multimodal rotary position embedding (M-RoPE).

cos/sin are ``[3, B or 1, T, D]``: one table per position axis (time, height, width).
``mrope_section`` (three non-negative ints summing to D/2) says how many rotary pairs each axis
owns: the features of each half of the head are split into sections of those sizes, and
section i reads axis ``i % 3``'s table (transformers' ``apply_multimodal_rotary_pos_emb``,
``mrope_section * 2`` over the full head). The merged ``[B or 1, T, D]`` tables then rotate q and
k exactly as :mod:`polykernel.ops.rope` does (rotate-half, fp32 math, each result in its input's
dtype). Gradients of q and k are the transposed rotation; cos/sin gradients (rarely wanted) come
from autograd in the torch impl, and impls that do not compute them are excluded by a predicate on
the ``rot_grad`` field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..core.hit_guard import SHAPE, dims
from ..core.op import Bounds, Case, ErrorModel, Op
from ..distributed.layout import Layout
from . import _checks as check
from . import rope as _rope

OP_ID = "embedding.mrope"


def merge_sections(table: torch.Tensor, mrope_section: Sequence[int]) -> torch.Tensor:
    """``[3, B, T, D]`` -> ``[B, T, D]``: feature section i (of ``mrope_section * 2``) from axis
    ``i % 3`` (a selection: no value changes)."""
    parts = table.split(list(mrope_section) * 2, dim=-1)
    return torch.cat([m[i % 3] for i, m in enumerate(parts)], dim=-1)


def reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64): rope with the merged tables."""
    return _rope.reference(q, k, merge_sections(cos, mrope_section), merge_sections(sin, mrope_section))


def validate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: Sequence[int]) -> None:
    for name, t in (("q", q), ("k", k)):
        check.tensor(OP_ID, name, t)
        check.floating(OP_ID, name, t)
        if t.dim() != 4:
            raise check.OpArgumentError(OP_ID, name, f"expected 4 dimensions [B, H, T, D], got shape {tuple(t.shape)}")
    b, _, t_len, d = q.shape
    if k.shape[0] != b or k.shape[2] != t_len or k.shape[3] != d:
        raise check.OpArgumentError(OP_ID, "k", f"expected shape [{b}, Hk, {t_len}, {d}] (q's B, T and D), got {tuple(k.shape)}")
    if d == 0 or d % 2:
        raise check.OpArgumentError(OP_ID, "q", f"expected a positive even head dim D, got D={d} (shape {tuple(q.shape)})")
    for name, t in (("cos", cos), ("sin", sin)):
        check.tensor(OP_ID, name, t)
        check.floating(OP_ID, name, t)
        if t.dim() != 4 or t.shape[0] != 3 or t.shape[1] not in (1, b) or t.shape[2] != t_len or t.shape[3] != d:
            raise check.OpArgumentError(
                OP_ID, name, f"expected shape [3, {b} or 1, {t_len}, {d}] ([3, B or 1, T, D] of q), got {tuple(t.shape)}"
            )
    if sin.shape != cos.shape:
        raise check.OpArgumentError(OP_ID, "sin", f"expected cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    sec = mrope_section
    if (
        not isinstance(sec, (list, tuple))
        or len(sec) != 3
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sec)
        or sum(sec) != d // 2
    ):
        raise check.OpArgumentError(
            OP_ID, "mrope_section", f"expected three non-negative ints summing to D/2 = {d // 2}, got {check.shown(sec)}"
        )
    check.same_device(OP_ID, "k", k, "q", q)
    check.same_device(OP_ID, "cos", cos, "q", q)
    check.same_device(OP_ID, "sin", sin, "q", q)


_grad_enabled = torch.is_grad_enabled


def _key(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: Sequence[int]) -> tuple:
    """The argument class, as rope's (see ``ops/rope.py``'s ``_key``) plus the sections as a
    tuple; the guard pins q's and k's B, T, D and the tables' whole shapes."""
    grad = _grad_enabled()
    rot_grad = grad and (cos.requires_grad or sin.requires_grad)
    needs = rot_grad or (grad and (q.requires_grad or k.requires_grad))
    sec = tuple(mrope_section) if isinstance(mrope_section, (list, tuple)) else mrope_section
    return (q.device, q.dtype, needs, rot_grad, k.dtype, cos.dtype, sin.dtype, sec, _args_match(q, k, cos, sin, sec))


def _args_match(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sec: Any) -> bool:
    """`validate`'s shape, section and device conditions, as one field of the class."""
    qs, ks, cs = q.shape, k.shape, cos.shape
    return (
        len(qs) == 4 and len(ks) == 4 and len(cs) == 4
        and ks[0] == qs[0] and ks[2] == qs[2] and ks[3] == qs[3] and qs[3] > 0 and qs[3] % 2 == 0
        and cs[0] == 3 and (cs[1] == 1 or cs[1] == qs[0]) and cs[2] == qs[2] and cs[3] == qs[3] and sin.shape == cs
        and isinstance(sec, tuple) and len(sec) == 3
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sec) and sum(sec) == qs[3] // 2
        and q.device == k.device == cos.device == sin.device
    )  # fmt: skip


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: Sequence[int],
    *,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL's multimodal rotary embedding of ``q`` and ``k``; returns ``(q_rot, k_rot)``.

    >>> import torch, polykernel
    >>> q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)
    >>> cos, sin = torch.randn(3, 1, 6, 16), torch.randn(3, 1, 6, 16)  # time, height, width tables
    >>> q_rot, k_rot = polykernel.mrope(q, k, cos, sin, [2, 3, 3])  # pairs per axis, summing to D/2
    >>> q_rot.shape
    torch.Size([1, 4, 6, 16])
    """
    return _dispatch(impl, q, k, cos, sin, mrope_section)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# rope's (ops/rope.py): the merge only selects table values. Each output element is x·cos ± x'·sin
# in fp32, rounded once; |cos| + |sin| is taken over all three tables (a bound for the merged one);
# a table element's gradient sums dy·x over the heads of q and k and over B when the tables are shared.
def error_model(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_: object, **__: object) -> Bounds:
    def amax(t: torch.Tensor) -> float:
        return t.detach().abs().max().item() if t.numel() else 0.0

    cs = amax(cos.detach().double().abs() + sin.detach().double().abs())
    heads = (q.shape[1] + k.shape[1]) * max(1, q.shape[0] // max(1, cos.shape[1]))
    table = ErrorModel(ops=2, cancel=2, sum_abs=1, n=heads)
    return Bounds(
        outputs=(ErrorModel(ops=2, cancel=2, scale=amax(q) * cs), ErrorModel(ops=2, cancel=2, scale=amax(k) * cs)),
        grads={0: ErrorModel(ops=2, cancel=2, scale=cs), 1: ErrorModel(ops=2, cancel=2, scale=cs), 2: table, 3: table},
    )


def sections_for(d: int) -> list[int]:
    """Qwen2-VL's proportions (16, 24, 24 of 64 pairs) for another head dim."""
    half = d // 2
    s0 = half // 4
    s1 = (half - s0) // 2
    return [s0, s1, half - s0 - s1]


def _tables(b: int, t: int, d: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """[3, b, t, d] tables in HF's style: each axis its own positions (text tokens: all equal)."""
    cos, sin = zip(*(_rope._rope_tables(b, t, d, dtype, device, base=10000.0 + 1000.0 * axis) for axis in range(3)))
    return torch.stack(cos), torch.stack(sin)


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random arguments for a q shape ``[B, Hq, T, D]``; k gets ``max(1, Hq // 4)`` heads (GQA)."""
    b, hq, t, d = shape
    hk = max(1, hq // 4)
    q = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    k = torch.randn((b, hk, t, d), dtype=dtype, device=device, requires_grad=requires_grad)
    return Case(f"{'x'.join(map(str, shape))}-k{hk}", (q, k, *_tables(b, t, d, dtype, device), sections_for(d)))


def bytes_moved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: forward reads q, k and the tables' selected third, writes q_rot, k_rot; the
    backward moves the same again."""
    n = 2 * (q.numel() * q.element_size() + k.numel() * k.element_size())
    n += (cos.numel() * cos.element_size() + sin.numel() * sin.element_size()) // 3
    return 2 * n if backward else n


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and sections, sized for the CPU interpreter unless ``large``."""

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device, dtype=dtype).requires_grad_()

    def rand_tables(b: int, tl: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        # every axis and half different: a kernel that reads the wrong axis or half fails
        return tuple(torch.rand(3, b, tl, d, device=device).mul(2).sub(1).to(dtype) for _ in range(2))  # type: ignore[return-value]

    def hf(b: int, tl: int, h: int, d: int) -> torch.Tensor:
        return t(b, tl, h * d).view(b, tl, h, d).transpose(1, 2)

    out = [
        Case("1x1x1x2-D2", (t(1, 1, 1, 2), t(1, 1, 1, 2), *rand_tables(1, 1, 2), [1, 0, 0])),
        Case("2x4x7x16-qwen-proportions", (t(2, 4, 7, 16), t(2, 2, 7, 16), *_tables(2, 7, 16, dtype, device), sections_for(16))),
        Case("1x3x5x32-B1-randtables", (t(1, 3, 5, 32), t(1, 1, 5, 32), *rand_tables(1, 5, 32), [4, 6, 6])),
        Case("3x6x9x24-gqa-broadcast-B", (t(3, 6, 9, 24), t(3, 2, 9, 24), *rand_tables(1, 9, 24), (3, 4, 5))),
        Case("2x4x11x64-hf-transposed", (hf(2, 11, 4, 64), hf(2, 11, 1, 64), *rand_tables(2, 11, 64), [8, 12, 12])),
        Case("2x2x6x20-empty-section", (t(2, 2, 6, 20), t(2, 2, 6, 20), *rand_tables(2, 6, 20), [0, 10, 0])),
        Case("2x2x0x16-empty-T", (t(2, 2, 0, 16), t(2, 1, 0, 16), *rand_tables(1, 0, 16), [2, 3, 3])),
        Case("1x2x3x8-fp32-tables", (t(1, 2, 3, 8), t(1, 1, 3, 8), *(x.float() for x in rand_tables(1, 3, 8)), [1, 2, 1])),
    ]
    if large:
        out += [
            Case("2x28x4096x128-k4", (hf(2, 4096, 28, 128), hf(2, 4096, 4, 128), *_tables(2, 4096, 128, dtype, device), [16, 24, 24])),
            Case("1x16x1000x80-k2-odd", (t(1, 16, 1000, 80), t(1, 2, 1000, 80), *rand_tables(1, 1000, 80), sections_for(80))),
        ]
    return out


def _dtensor_expect(args: tuple[Any, ...], d: int) -> dict[int, int | None]:
    """DTensor placements for q and k sharded on dim ``d``: as rope's, the tables' dims one later."""
    q, _, cos, _ = args[:4]
    if d == 0:
        table = 1 if cos.shape[1] == q.shape[0] and q.shape[0] != 1 else None
    elif d == 1:
        table = None
    else:
        table = 2
    return {0: d, 1: d, 2: table, 3: table}


def outputs(q: torch.Tensor, k: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shapes and dtypes, without running it (the first-call check)."""
    return ((q.shape, q.dtype), (k.shape, k.dtype))


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "rot_grad", "k_dtype", "cos_dtype", "sin_dtype", "mrope_section", "args_match"),
    key=_key,
    guard=(dims(0, 2, 3), dims(0, 2, 3), SHAPE, SHAPE, None),
    default_key=lambda device, dtype: (device, dtype, False, False, dtype, dtype, dtype, (16, 24, 24), True),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # torch.compile: rope's reason (Inductor fuses the elementwise rotation); the merge decomposes too
    compile_mode="decompose",
    dtensor_layout=Layout((0, 1, 2), _dtensor_expect, (0, 1), "it is the head dim D, which the rotation mixes"),
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
