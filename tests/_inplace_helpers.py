"""Calls of the ops that write into tensors the caller gives (``Op.writes``: in-place arguments and
``out=``), for the checks that such writes behave as torch's in-place ops under autograd
(tests/ops/test_serving_inplace.py, tests/reliability/test_reliability_inplace.py)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

import polykernel as pk
from polykernel.core import registry
from polykernel.ops import OP_MODULES
from polykernel.ops.rotary_embedding_ import rope_cache

# op -> make(tokens, width, dtype, rows_strided) -> (call(impl), {written name: tensor})
Maker = Callable[[int, int, torch.dtype, bool], tuple[Callable[[Any], Any], dict[str, torch.Tensor]]]


def _t(tokens: int, width: int, dtype: torch.dtype, rows_strided: bool) -> torch.Tensor:
    """[tokens, width] of random values, every other row of a larger buffer when ``rows_strided``."""
    if rows_strided:
        return torch.randn(2 * tokens, width).to(dtype)[::2]
    return torch.randn(tokens, width).to(dtype)


def _fused(tokens: int, width: int, dtype: torch.dtype, strided: bool):
    x, r, w = _t(tokens, width, dtype, strided), _t(tokens, width, dtype, False), torch.ones(width, dtype=dtype)
    return (lambda impl: pk.fused_add_rms_norm_(x, r, w, impl=impl)), {"x": x, "residual": r}


def _rope(tokens: int, width: int, dtype: torch.dtype, strided: bool):
    head = 2 * max(1, width // 2)  # even: rotate-half pairs
    q, k = _t(tokens, 2 * head, dtype, strided), _t(tokens, head, dtype, False)
    pos, cache = torch.randint(0, 16, (tokens,)), rope_cache(16, head, dtype=dtype)
    return (lambda impl: pk.rotary_embedding_(pos, q, k, head, cache, impl=impl)), {"query": q, "key": k}


def _silu(tokens: int, width: int, dtype: torch.dtype, strided: bool):
    x, out = _t(tokens, 2 * width, dtype, False), _t(tokens, width, dtype, strided)
    return (lambda impl: pk.silu_and_mul(x, out=out, impl=impl)), {"out": out}


def _gelu(tokens: int, width: int, dtype: torch.dtype, strided: bool):
    x, out = _t(tokens, 2 * width, dtype, False), _t(tokens, width, dtype, strided)
    return (lambda impl: pk.gelu_and_mul(x, out=out, impl=impl)), {"out": out}


CALLS: dict[str, Maker] = {
    "serving.fused_add_rms_norm_": _fused,
    "serving.rotary_embedding_": _rope,
    "serving.silu_and_mul": _silu,
    "serving.gelu_and_mul": _gelu,
}


def ops_taking_destinations() -> list[str]:
    """Every op whose public function takes a tensor it writes (its ``Op.writes`` among the
    function's parameters); the others (fp8 quantisation) write only tensors they allocate."""
    out = []
    for op_id in sorted(OP_MODULES):
        op = registry.get_op(op_id)
        public = getattr(pk, op.name, None)
        if op.writes and public is not None and set(op.writes) & set(inspect.signature(public).parameters):
            out.append(op_id)
    return out


def save_for_backward(t: torch.Tensor) -> torch.Tensor:
    """A loss whose backward needs ``t``'s values as they are now (mul saves t for w's gradient)."""
    w = torch.randn(t.shape[-1], requires_grad=True)
    return (t * w.to(t.dtype)).sum()
