"""What the serving-layout ops share (issue 25): the fp8 format, the inference-only rule, the
destination checks (``out=`` and in-place arguments) and the overlap test.

The serving ops take their destinations explicitly (``Op.writes``): the public function
allocates the ones the caller did not give, then every impl writes into them and returns them.
So an in-place call allocates nothing, and a call during CUDA-graph capture allocates only what
the public function asks of the caching allocator (the graph's pool).

Checks that depend on the tensors' memory (overlap, the positions' values) run on every call,
before anything is written (the public functions call them before ``Op.dispatch``, whose guard
stands for the rest); they are skipped while ``torch.compile`` traces (fake tensors have no
memory: the custom op's real call checks them), except the strides' self-overlap (:func:`written`).
"""

from __future__ import annotations

import torch

from . import _checks as check

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_FLOOR = 1e-12  # dynamic scales never go below: an all-zero row quantises to zeros, not NaN

_compiling = torch.compiler.is_compiling
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def tokens(n: int) -> int:
    """A call's token count as its argument class holds it: rounded up to a power of two (0 for
    none). The fastest impl of a serving op changes with it (a decode step's few rows against a
    prefill's thousands: measured ranks, ``KernelSpec.rank_for``), and the class stays one per
    size bucket, not one per length.

    >>> [tokens(n) for n in (0, 1, 3, 64, 65, 8192)]
    [0, 1, 4, 64, 128, 8192]
    """
    return 1 << (n - 1).bit_length() if n > 0 else 0


def rows(x: torch.Tensor) -> int:
    """The rows of x ``[..., n]`` (its tokens)."""
    n = x.shape[-1]
    return x.numel() // n if n else int(torch.Size(x.shape[:-1]).numel())


def compiling() -> bool:
    """Whether torch.compile is tracing (memory-dependent checks are skipped then)."""
    return _compiling()


def inference_only(op: str, name: str, t: torch.Tensor) -> None:
    """The serving functions have no autograd: a tensor that needs a gradient is an error, never
    a result silently cut off from the graph."""
    if t.requires_grad and torch.is_grad_enabled():
        raise check.OpArgumentError(
            op, name, "requires grad: the serving functions are inference only (call them under torch.no_grad() or torch.inference_mode())"
        )


def destination(op: str, name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A given destination (``out=``): a tensor of exactly ``shape`` and ``dtype`` on ``like``'s
    device, with no gradient (it is written in place)."""
    check.tensor(op, name, t, min_dim=0)
    assert isinstance(t, torch.Tensor)
    if tuple(t.shape) != tuple(shape):
        raise check.OpArgumentError(op, name, f"expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise check.OpTypeError(op, name, f"expected dtype {dtype}, got {t.dtype}")
    check.same_device(op, name, t, "x", like)
    inference_only(op, name, t)
    written(op, name, t)
    return t


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements may share memory (``expand()``'s stride 0, or strides that
    interleave). Conservative: True unless each dim's stride, smallest first, steps past all the
    elements the smaller dims span (the sufficient test; every dense or sliced layout passes)."""
    if t.is_contiguous():  # the usual case, one C call (validate runs on every serving call)
        return False
    # (stride, size) of each dim with more than one element, smallest first: an insertion sort,
    # which a trace follows on symbolic sizes too (Dynamo cannot sort them)
    dims: list[tuple[int, int]] = []
    for size, stride in zip(t.shape, t.stride()):
        if size > 1:
            pair, i = (abs(stride), size), 0
            while i < len(dims) and (dims[i][0] < pair[0] or (dims[i][0] == pair[0] and dims[i][1] <= pair[1])):
                i += 1
            dims.insert(i, pair)
    extent = 0  # how far (in elements) the dims seen so far reach from the first element
    for stride, size in dims:
        if stride <= extent:
            return True
        extent += (size - 1) * stride
    return False


def written(op: str, name: str, t: torch.Tensor | None) -> None:
    """A tensor the op writes (a destination or an in-place argument) must hold each element in
    its own memory: a kernel writing a stride-0 tensor row by row would leave the last row's
    values everywhere (a silently wrong result), so it is an error before anything is written.
    Strides are metadata: a trace checks it too (its fake tensors have them, symbolic or not), so
    a compiled call raises this error, not the compiler's own on the mutated input."""
    if t is not None and self_overlapping(t):
        # (a trace's message names no sizes: they may be symbols, which its error node cannot hold)
        layout = "" if _compiling() else f" (strides {tuple(t.stride())} for shape {tuple(t.shape)})"
        raise check.OpArgumentError(
            op,
            name,
            f"has elements that share memory{layout}, e.g. from expand(): it is written in place; "
            "pass a tensor of its own memory (.contiguous())",
        )


def _rows(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows, width, row stride) of ``t`` seen as rows of ``width`` consecutive elements (every
    dim after the first dense, last stride 1, rows apart by at least their width), or None."""
    if t.dim() == 2:  # the usual case, without a loop
        (m, n), (s0, s1) = t.shape, t.stride()
        if (s1 != 1 and n != 1) or (m > 1 and s0 < n):
            return None
        return m, n, s0 if m > 1 else n
    if t.dim() == 0:
        return 1, 1, 1
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
    if t.dim() > 1 and t.shape[-1] != 1 and t.stride(-1) != 1:
        return None
    if t.dim() == 1:
        return (1, t.shape[0], t.shape[0]) if t.shape[0] <= 1 or t.stride(0) == 1 else None
    if t.shape[0] > 1 and t.stride(0) < expected:
        return None
    return t.shape[0], expected, t.stride(0) if t.shape[0] > 1 else expected


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] that ``t``'s elements occupy (``t`` not empty)."""
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    base, es = t.data_ptr(), t.element_size()
    return base + lo * es, base + (hi + 1) * es


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share an element. Exact for tensors in disjoint byte ranges
    and for two row layouts of one row stride (q, k and v slices of one fused projection, which
    interleave without sharing an element); True (conservative) for other interleavings."""
    if a.numel() == 0 or b.numel() == 0 or type(a) not in _PLAIN or type(b) not in _PLAIN:
        return False  # a subclass (DTensor, a wrapper) has no memory of its own here; it runs the torch impl
    sa, sb = a.untyped_storage(), b.untyped_storage()
    s0, t0 = sa.data_ptr(), sb.data_ptr()
    if s0 + sa.nbytes() <= t0 or t0 + sb.nbytes() <= s0:  # the usual case, in ~0.3 µs: disjoint allocations
        return False
    es = a.element_size()
    if a.dim() == 2 and b.dim() == 2 and b.element_size() == es:  # the usual layouts: element arithmetic
        (ta, wa), (sa0, sa1) = a.shape, a.stride()
        (tb, wb), (sb0, sb1) = b.shape, b.stride()
        delta, rem = divmod(b.data_ptr() - a.data_ptr(), es)
        if not rem and sa1 == sb1 == 1 and sa0 == sb0 >= max(wa, wb):
            return _rows_meet((ta, wa, sa0), (tb, wb, sb0), delta)
    if b.element_size() != es or (b.data_ptr() - a.data_ptr()) % es:
        return True
    ra = _rows(a)
    rb = _rows(b) if ra is not None else None
    if ra is None or rb is None:  # not row layouts: overlap of the byte ranges (conservative)
        (a0, a1), (b0, b1) = _span(a), _span(b)
        return a0 < b1 and b0 < a1
    return _rows_meet(ra, rb, (b.data_ptr() - a.data_ptr()) // es)


def _rows_meet(ra: tuple[int, int, int], rb: tuple[int, int, int], delta: int) -> bool:
    """Whether rows (t, w, s) of a at offset 0 and of b at element offset ``delta`` share an
    element: a holds r·s + [0, wa), b holds delta + r'·s + [0, wb); they meet iff
    delta - wa < k·s < delta + wb for some k = r - r' in [-(tb - 1), ta - 1]."""
    (ta, wa, sa), (tb, wb, sb) = ra, rb
    if ta > 1 and tb > 1 and sa != sb:  # two row strides: their byte ranges (conservative)
        return delta < (ta - 1) * sa + wa and 0 < delta + (tb - 1) * sb + wb
    s = sa if ta > 1 else sb if tb > 1 else max(wa, wb, 1)
    if wa > s or wb > s:  # a single row wider than the other's row stride: their byte ranges
        return delta < (ta - 1) * sa + wa and 0 < delta + (tb - 1) * sb + wb
    k_lo = max(-(tb - 1), (delta - wa) // s + 1)
    k_hi = min(ta - 1, -((-(delta + wb)) // s) - 1)
    return k_lo <= k_hi


def no_overlap(op: str, name: str, t: torch.Tensor | None, other_name: str, other: torch.Tensor | None) -> None:
    if t is not None and other is not None and not _compiling() and overlaps(t, other):
        raise check.OpArgumentError(op, name, f"overlaps {other_name!r} in memory: the op would read what it has already written")


# -- fp8 quantisation (dynamic_quant_fp8, static_quant_fp8, rms_norm_quant_fp8) ------------------


def fp8_like(x: torch.Tensor) -> torch.Tensor | None:
    """A new fp8 tensor of x's shape on x's device (like x: a subclass stays one); None where x is
    no tensor (the dispatcher's validate names it)."""
    try:
        return x.new_empty(x.shape, dtype=FP8)
    except (AttributeError, TypeError):
        return None


def quantised(v: torch.Tensor, scale: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """``clamp(v / scale, ±FP8_MAX)`` written into ``q`` (rounded to e4m3 by the copy), or, with
    no ``q``, returned: in fp8, or unrounded when ``v`` is float64 (the exact result the parity
    harness compares with)."""
    qv = (v / scale.to(v.dtype)).clamp(-FP8_MAX, FP8_MAX)  # clamp keeps NaN
    if q is not None:
        return q.copy_(qv)
    return qv if v.dtype == torch.float64 else qv.to(FP8)


def validate_scale(op: str, scale: object, x: torch.Tensor) -> None:
    """A static scale: fp32, one value (shape () or (1,)) or one per row of x (``[..., 1]``)."""
    check.tensor(op, "scale", scale, min_dim=0)
    assert isinstance(scale, torch.Tensor)
    if scale.dtype != torch.float32:
        raise check.OpTypeError(op, "scale", f"expected a float32 scale (as the dynamic ops return it), got {scale.dtype}")
    per_row = (*x.shape[:-1], 1)
    if tuple(scale.shape) not in ((), (1,), per_row):
        raise check.OpArgumentError(op, "scale", f"expected shape () or (1,) (per tensor) or {per_row} (per row), got {tuple(scale.shape)}")
    check.same_device(op, "scale", scale, "x", x)
    inference_only(op, "scale", scale)


def fp8_outputs(x: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    return (x.shape, FP8)
