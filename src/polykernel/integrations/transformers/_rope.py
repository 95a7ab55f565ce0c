"""Drop-ins for the modeling modules' rotary functions that run polykernel.rope where it has the
same semantics (each family's layout: :mod:`._families`), and the original function elsewhere."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

import polykernel as _pk

from ._families import _CAST_BACK, _COMPLEX, _GLM, _HALF_TABLES, _PAIRS, _PARTIAL_OK, _ROTATE_HALF, _VISION


def _rope_function(orig: Callable, layout: str = _ROTATE_HALF) -> Callable:
    """A drop-in for a modeling module's rotary function (``layout``: how it maps onto
    polykernel.rope) that runs polykernel.rope where it has the same semantics."""
    orig = getattr(orig, "_polykernel_orig", orig)
    try:
        extra_names = [p.name for p in inspect.signature(orig).parameters.values()][4:]
    except (TypeError, ValueError):
        extra_names = ["unsqueeze_dim"]

    if layout == _COMPLEX:
        return _complex_rope_function(orig)

    @functools.wraps(orig)
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any):
        if args or kwargs:  # (DeepSeek's interleaved function takes position_ids too, and ignores them)
            extra = dict(zip(extra_names, args))
            extra.update(kwargs)
            if len(args) > len(extra_names) or extra.get("unsqueeze_dim", 1) != 1:
                return orig(q, k, cos, sin, *args, **kwargs)
        if layout == _VISION:  # [S, H, D] -> a [1, H, S, D] view, and back (the caller transposes it again)
            if not _vision_rope_supported(q, k, cos, sin):
                return orig(q, k, cos, sin, *args, **kwargs)
            q, k = _pk.rope(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0))
            return q[0].transpose(0, 1), k[0].transpose(0, 1)
        tables = _rope_tables(q, k, cos, sin, layout)
        if tables is None:
            return orig(q, k, cos, sin, *args, **kwargs)
        if layout == _PAIRS:
            # DeepSeek rotates the pairs (x0, x1), (x2, x3)... and returns [evens', odds']: that is
            # rotate-half on [evens, odds] (the same products, a permutation of the input)
            q = torch.cat((q[..., 0::2], q[..., 1::2]), dim=-1)
            k = torch.cat((k[..., 0::2], k[..., 1::2]), dim=-1)
        return _pk.rope(q, k, *tables, interleaved=layout == _GLM)

    apply_rotary_pos_emb._polykernel = "rope"  # type: ignore[attr-defined]
    apply_rotary_pos_emb._polykernel_orig = orig  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _rope_tables(q: Any, k: Any, cos: Any, sin: Any, layout: str = _ROTATE_HALF) -> tuple[torch.Tensor, torch.Tensor] | None:
    """polykernel.rope's ``[B or 1, T, D]`` cos/sin for this call, or None where it does not have the
    original's semantics. q/k ``[B, H, T, D]``; the tables of q's dtype (HF's output dtype follows
    promotion otherwise) and, as the layout takes them, of the full rotary dim D:

    - ``rotate_half``: ``[B, T, D]``, as they come;
    - ``rotate_half_cast_back`` (Olmo): the same, also fp32 tables with other q/k: the original
      computes in the promoted dtype and casts back to q's, which is polykernel.rope's math;
    - ``half_tables`` (gpt-oss): ``[B, T, D/2]``, one angle per half-pair: ``cat((cos, cos))``;
    - ``interleaved_pairs`` (DeepSeek): ``[B, T, D]`` of which the original reads the first half.
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return None
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return None
    b, _, t, d = q.shape
    width = d // 2 if layout == _HALF_TABLES else d
    if layout in _PARTIAL_OK and 0 < cos.shape[2] <= d and cos.shape[2] % 2 == 0:
        width = cos.shape[2]  # partial rotary: R features rotate, the rest pass through
    if not (
        k.shape[0] == b
        and k.shape[2] == t
        and k.shape[3] == d
        and cos.shape[0] in (1, b)
        and cos.shape[1] == t
        and cos.shape[2] == width
        and d > 0
        and d % 2 == 0
        and q.dtype == k.dtype
        and cos.dtype == sin.dtype
        and (cos.dtype == q.dtype or (layout == _CAST_BACK and cos.dtype == torch.float32))
    ):
        return None
    if layout == _HALF_TABLES:
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if layout == _PAIRS:
        c, s = cos[..., : d // 2], sin[..., : d // 2]
        return torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
    if layout == _GLM:  # HF's own conversion: the first R/2 angles, each repeated for its pair
        half = width // 2
        return cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)
    return cos, sin


def _complex_rope_function(orig: Callable) -> Callable:
    """Llama4's ``apply_rotary_emb(xq, xk, freqs_cis)``: q/k ``[B, T, H, D]`` read as complex pairs
    (x[2i], x[2i+1]) times ``freqs_cis [B, T, D/2]``, in fp32, cast back to q's dtype. That is
    polykernel.rope with ``interleaved=True`` and the real/imaginary parts, each repeated for its
    pair, as cos/sin (q/k viewed ``[B, H, T, D]``: no copy)."""

    @functools.wraps(orig)
    def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, *args: Any, **kwargs: Any):
        if args or kwargs or not _complex_rope_supported(xq, xk, freqs_cis):
            return orig(xq, xk, freqs_cis, *args, **kwargs)
        cos = freqs_cis.real.repeat_interleave(2, dim=-1)
        sin = freqs_cis.imag.repeat_interleave(2, dim=-1)
        q, k = _pk.rope(xq.transpose(1, 2), xk.transpose(1, 2), cos, sin, interleaved=True)
        return q.transpose(1, 2), k.transpose(1, 2)

    apply_rotary_emb._polykernel = "rope"  # type: ignore[attr-defined]
    apply_rotary_emb._polykernel_orig = orig  # type: ignore[attr-defined]
    return apply_rotary_emb


def _complex_rope_supported(xq: Any, xk: Any, freqs_cis: Any) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (xq, xk, freqs_cis)):
        return False
    if xq.dim() != 4 or xk.dim() != 4 or freqs_cis.dim() != 3 or freqs_cis.dtype != torch.complex64:
        return False
    b, t, _, d = xq.shape
    return (
        xk.shape[0] == b
        and xk.shape[1] == t
        and xk.shape[3] == d
        and d > 0
        and d % 2 == 0
        and xq.dtype == xk.dtype
        and xq.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and freqs_cis.shape[0] in (1, b)
        and freqs_cis.shape[1] == t
        and freqs_cis.shape[2] == d // 2
    )


def _vision_rope_supported(q: Any, k: Any, cos: Any, sin: Any) -> bool:
    """Qwen2-VL's ``apply_rotary_pos_emb_vision``: q/k ``[S, H, D]``, cos/sin ``[S, D]``. It computes
    in fp32 and casts back, as polykernel.rope does, so fp32 tables with other q/k are the same math."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if q.dim() != 3 or k.dim() != 3 or cos.dim() != 2 or sin.shape != cos.shape:
        return False
    s, _, d = q.shape
    return (
        k.shape[0] == s
        and k.shape[2] == d
        and tuple(cos.shape) == (s, d)
        and d > 0
        and d % 2 == 0
        and q.dtype == k.dtype
        and cos.dtype == sin.dtype
        and cos.dtype in (q.dtype, torch.float32)
    )
