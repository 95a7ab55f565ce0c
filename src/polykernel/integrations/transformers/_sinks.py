"""Attention with sinks (gpt_oss: a learned logit per head joins each row's softmax and is
dropped after it) on torch's own fused attention kernels, where transformers runs it eagerly
(``_supports_sdpa = False``: every layer materialises the scores per head and softmaxes them).

The sink is folded into the log-sum-exp: with ``lse`` a row's log-sum-exp of its masked, scaled
scores and ``s`` the head's sink, ``lse' = logaddexp(lse, s)`` and the output is
``O · exp(lse − lse')``. The fused backward, given ``(O', lse')`` for ``(O, lse)``, recomputes the
sink-normalised probabilities ``exp(S − lse')``, and its ``D = rowsum(dO' ∘ O')`` is the extended
softmax's too (the sink's value row is zero), so its dq, dk, dv are exact; the sink's gradient is
``−Σ_{b,q} exp(s − lse') · D``. Kernels: the memory-efficient attention on CUDA (it takes the
model's additive mask as a bias and returns the log-sum-exp), the flash attention for CPUs on
the CPU.

``patch``'s ``attention_sinks`` switch puts :func:`eager_with_sinks` in place of gpt_oss's
``eager_attention_forward`` (its GPU test, ``tests/integrations/test_sink_attention.py``, passed on
an H100: benchmarks/results/h100-2026-12-06-twentieth/; notes/PERF.md, 2026-12-06). Where the fused
kernels do not apply, or transformers collects the attention weights (``output_attentions``),
transformers' own eager attention runs.

>>> import torch
>>> q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
>>> sink_attention(q, k, v, torch.zeros(2), None, 8**-0.5).shape
torch.Size([1, 2, 5, 8])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_BIAS_ALIGN = 16  # the memory-efficient kernel reads its bias rows in blocks of 16 elements


def _aligned_bias(bias: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """``bias`` ([1 or B, 1 or H, Lq, Lk]) as the CUDA kernel reads it: broadcast to ``batch`` and
    ``heads`` without a copy, its rows in storage padded to a multiple of 16 elements (the values
    past Lk are never read)."""
    b, h, lq, lk = bias.shape
    if lk % _BIAS_ALIGN or bias.stride(-1) != 1:
        padded = bias.new_zeros(b, h, lq, -(-lk // _BIAS_ALIGN) * _BIAS_ALIGN)
        padded[..., :lk] = bias
        bias = padded[..., :lk]
    return bias.expand(batch, heads, lq, lk)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float) -> tuple[Any, ...]:
    """The fused kernel's output, its log-sum-exp (fp32; on CUDA padded to a multiple of 32 rows)
    and what its backward needs besides."""
    if q.device.type == "cuda":
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False, scale=scale)
        return out, lse, (seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, bias is None, attn_mask=bias, scale=scale)
    return out, lse, None


def _backward(
    go: torch.Tensor, saved: tuple[torch.Tensor, ...], bias: torch.Tensor | None, state: Any, scale: float
) -> tuple[torch.Tensor, ...]:
    q, k, v, out, lse = saved
    if q.device.type == "cuda":
        seed, offset = state
        grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            go, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=scale
        )
        return grads[:3]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        go, q, k, v, out, lse, 0.0, bias is None, attn_mask=bias, scale=scale
    )


def _acc(x: torch.Tensor) -> torch.dtype:
    """The sink's arithmetic: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, bias: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        out, lse, state = _forward(q, k, v, bias, scale)
        rows, acc = q.shape[-2], _acc(q)
        lse_q = lse[..., :rows].to(acc)
        with_sink = torch.logaddexp(lse_q, sinks.to(acc).view(1, -1, 1))
        o = (out.to(acc) * torch.exp(lse_q - with_sink).unsqueeze(-1)).to(out.dtype)
        lse = lse.clone()  # the backward's log-sum-exp: the sink's (its padding rows as they were)
        lse[..., :rows] = with_sink.to(lse.dtype)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.bias, ctx.state, ctx.scale = bias, state, scale
        return o

    @staticmethod
    def backward(ctx: Any, go: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse, sinks = ctx.saved_tensors
        go = go.contiguous()
        dq, dk, dv = _backward(go, (q, k, v, o, lse), ctx.bias, ctx.state, ctx.scale)
        rows, acc = q.shape[-2], _acc(q)
        d = (go.to(acc) * o.to(acc)).sum(-1)  # [B, H, Lq]
        p_sink = torch.exp(sinks.to(acc).view(1, -1, 1) - lse[..., :rows].to(acc))
        dsinks = -(p_sink * d).sum((0, 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None


def sink_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Softmax attention whose every row also normalises over ``sinks[h]`` (a logit with a zero
    value row): [B, H, Lq, D] from query [B, H, Lq, D], key and value [B, H, Lk, D] (as many heads),
    ``mask`` an additive [1 or B, 1 or H, Lq, Lk] bias (transformers' eager mask) or None (causal)."""
    q, k, v = (t.contiguous() for t in (query, key, value))
    bias = None
    if mask is not None:
        bias = mask.to(q.dtype)
        batch, heads = q.shape[:2]
        bias = _aligned_bias(bias, batch, heads) if q.device.type == "cuda" else bias.expand(batch, heads, *bias.shape[-2:])
    return _SinkAttention.apply(q, k, v, sinks, bias, scale)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def sink_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None] | None:
    """gpt_oss's ``eager_attention_forward`` on the fused kernels: ``(output [B, Lq, H, D], None)``,
    or None where they do not apply (dropout, a CUDA call without a mask, no ``sinks`` on the
    module): the caller then runs transformers' own."""
    sinks = getattr(module, "sinks", None)
    if dropout or sinks is None or (attention_mask is None and query.device.type == "cuda"):
        return None
    groups = getattr(module, "num_key_value_groups", query.shape[1] // key.shape[1])
    k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)
    mask = None if attention_mask is None else attention_mask[:, :, :, : k.shape[-2]]
    out = sink_attention(query, k, v, sinks, mask, scaling)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _collector() -> Any:
    """transformers' collector of the outputs a forward was asked for, or None where this
    transformers has none (its attention weights then come back only when the model asks)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def _weights_wanted() -> bool:
    """Whether transformers is collecting the attention weights (``output_attentions=True``): the
    fused kernels return none, so the eager attention runs. (Under ``torch.compile`` not asked:
    transformers' collector is not traced there.)"""
    if torch.compiler.is_compiling():
        return False
    collector = _collector()
    if collector is None:
        return False
    collected = collector.get()
    return bool(collected) and "attentions" in collected


def eager_with_sinks(eager: Callable) -> Callable:
    """``eager`` (gpt_oss's ``eager_attention_forward``) run on the fused kernels where they apply
    (:func:`sink_attention_forward`), else ``eager`` itself; the attention weights it returns are
    None then, as SDPA's are."""

    def eager_attention_forward(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        # (eager's arguments, passed on as given: sink_attention_forward names them)
        if not _weights_wanted():
            fused = sink_attention_forward(module, *args, **kwargs)
            if fused is not None:
                return fused
        return eager(module, *args, **kwargs)

    eager_attention_forward._polykernel = "attention_sinks"  # type: ignore[attr-defined]
    eager_attention_forward._polykernel_eager = eager  # type: ignore[attr-defined]
    return eager_attention_forward
