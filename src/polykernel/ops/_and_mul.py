"""What the merged-layout activations (silu_and_mul, gelu_and_mul) share: x ``[..., 2d]`` holds
the gate in its first half and the up projection in its second (one fused gate/up matmul's
output, vLLM's/SGLang's/FlashInfer's layout); the result ``[..., d]`` is ``act(gate) · up``.

Each op file keeps its own semantics (reference, error model, impls); the math is the gated
activations' (swiglu, geglu), whose kernels the impls share.
"""

from __future__ import annotations

import torch

from ..core.op import Case
from . import _checks as check
from . import _serving as serving


def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views of x's two halves."""
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def out_shape(x: torch.Tensor) -> tuple[int, ...]:
    return (*x.shape[:-1], x.shape[-1] // 2)


def validate_and_mul(op_id: str, x: torch.Tensor, out: torch.Tensor | None) -> None:
    """x: a floating tensor ``[..., 2d]``; out (optional): ``[..., d]`` of x's dtype and device,
    sharing no memory with x."""
    check.tensor(op_id, "x", x)
    check.floating(op_id, "x", x)
    if x.shape[-1] % 2:
        raise check.OpArgumentError(op_id, "x", f"expected an even last dim [..., 2d] (gate, then up), got shape {tuple(x.shape)}")
    serving.inference_only(op_id, "x", x)
    if out is not None:
        serving.destination(op_id, "out", out, out_shape(x), x.dtype, x)
        serving.no_overlap(op_id, "out", out, "x", x)


def check_memory(op_id: str, x: object, out: object) -> None:
    """The checks of a given ``out`` that read memory (its strides, its addresses against x's), on
    every call before anything is written: the dispatcher's guard stands for the rest (a repeat
    of a validated call's metadata)."""
    if isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and not serving.compiling():
        serving.written(op_id, "out", out)
        serving.no_overlap(op_id, "out", out, "x", x)


def allocate(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor | None:
    """``out``, or a new ``[..., d]`` tensor like x (a subclass stays one); None for an x that
    cannot be read as ``[..., 2d]`` (not a tensor, 0-d): the dispatcher's validate names it."""
    if out is not None:
        return out
    try:
        return x.new_empty(out_shape(x))
    except (AttributeError, IndexError, TypeError):
        return None


def key(x: torch.Tensor, *options: object) -> tuple:
    """The argument class (device, dtype, needs_grad, n, *options, tokens); the op validates every
    call its guard does not recognise (``validate_each_call``): a destination's fit is not in it."""
    return (x.device, x.dtype, False, x.shape[-1], *options, serving.tokens(serving.rows(x)))


def outputs(x: torch.Tensor, *args: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The output's shape and dtype, without running anything (the first-call check)."""
    return ((torch.Size(out_shape(x)), x.dtype),)


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random x of one shape ``[..., 2d]`` (benchmarks, ``explain --shape``, the demo)."""
    return Case(f"{'x'.join(map(str, shape))}", (torch.randn(shape, dtype=dtype, device=device),))


def bytes_moved(x: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: reads x ([..., 2d]) and writes the [..., d] result."""
    return 3 * (x.numel() // 2) * x.element_size()


def and_mul_cases(device: torch.device | str, dtype: torch.dtype, large: bool, extra: dict | None = None) -> list[Case]:
    """Awkward shapes and layouts of x (no grad: inference only); sized for the CPU interpreter
    unless ``large``."""
    kw = dict(extra or {})

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype)

    out = [
        Case("1x2", (t(1, 2),), kw),
        Case("3x14-odd-d", (t(3, 14),), kw),
        Case("2x5x66", (t(2, 5, 66),), kw),
        Case("0x16-no-tokens", (t(0, 16),), kw),
        Case("4x0", (t(4, 0),), kw),
        Case("9002-1d", (t(9002),), kw),
        Case("5x1000-wide-range", (t(5, 1000, scale=8.0),), kw),
        # rows of a larger buffer (row stride > 2d): no copy of x
        Case("6x600-rowstrided", (t(6, 900)[:, 100:700],), kw),
        Case("7x64-colstrided", (t(7, 128)[:, ::2],), kw),
        Case("3x4x34-permuted", (t(4, 34, 3).permute(2, 0, 1),), kw),
        Case("2x8194-long", (t(2, 8194),), kw),  # d = 4097: more than one program per row
    ]
    if large:
        out += [
            Case("8192x28672", (t(8192, 28672),), kw),  # Llama-3 8B's MLP at prefill
            Case("64x28672", (t(64, 28672),), kw),
            Case("1x22016", (t(1, 22016),), kw),
        ]
    return out
