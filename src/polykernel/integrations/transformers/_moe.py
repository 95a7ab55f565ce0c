"""The routed experts (``<Family>Experts``, Llama 4's ``<Family>Moe``) on polykernel.moe_experts
and moe_experts_gpt_oss."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import polykernel as _pk
from polykernel import _compat

from ._families import _FAMILY_BY_MODULE, _GPT_OSS_EXPERTS, _LLAMA4_EXPERTS
from ._layers import _fallback_once, _gated_activation, _hooked_activation
from ._switches import _has_op

# The ``*Experts`` module gets the router's (top_k_index, top_k_weights) and returns
# Σ_j w[t, j]·expert_e(x[t]): exactly polykernel.moe_experts (transformers' layout) or
# moe_experts_gpt_oss. Their sum is in fp32 and rounded once (transformers rounds each expert's
# weighted output), the same math.
_EXPERTS_ACTIVATION = {("swiglu", None): "silu", ("geglu", "none"): "gelu", ("geglu", "tanh"): "gelu_tanh"}


def _experts_activation(module: nn.Module) -> str | None:
    kind = _gated_activation(getattr(module, "act_fn", None))
    return _EXPERTS_ACTIVATION.get(kind) if kind is not None else None


def _experts_params(module: nn.Module, layout: str) -> tuple[Any, ...]:
    if layout == _GPT_OSS_EXPERTS:
        names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    else:
        names = ("gate_up_proj", "down_proj")
    return tuple(getattr(module, n, None) for n in names)


def _experts_call_ok(hidden: Any, index: Any, weights: Any, params: tuple[Any, ...]) -> bool:
    """The call is one the op takes with the module's semantics: [T, H] tensors of one dtype (the
    routing weights may be fp32), no autocast (the module's matmuls would run in its dtype)."""
    if not all(isinstance(t, torch.Tensor) for t in (hidden, index, weights, *params)):
        return False
    if hidden.dim() != 2 or not hidden.is_floating_point() or torch.is_autocast_enabled(hidden.device.type):
        return False
    return all(p.dtype == hidden.dtype for p in params) and weights.dtype in (hidden.dtype, torch.float32)


def _experts_factory(layout: str) -> Callable[[Callable], Callable]:
    """The forward maker for a family's experts layout (Llama 4: its whole MoE block)."""
    if layout == _LLAMA4_EXPERTS:
        return _llama4_moe_forward
    return lambda base: _experts_forward(base, layout)


def _experts_forward(base: Callable, layout: str) -> Callable:
    @functools.wraps(base)
    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = _experts_params(self, layout)
        # expert parallel (transformers.distributed.expert_parallel): an index equal to E marks a
        # slot routed to another rank, which transformers' code skips and moe_experts rejects
        expert_parallel = getattr(self, "_is_expert_parallel", False)
        if kwargs or len(args) != 2 or expert_parallel or not _experts_call_ok(hidden_states, args[0], args[1], params):
            return base(self, hidden_states, *args, **kwargs)
        index, weights = args
        if layout == _GPT_OSS_EXPERTS:
            return _pk.moe_experts_gpt_oss(hidden_states, index, weights, *params, alpha=self.alpha, limit=self.limit)
        activation = _experts_activation(self)
        if activation is None or _hooked_activation(self, self.act_fn, "moe_experts"):
            return base(self, hidden_states, *args, **kwargs)
        return _pk.moe_experts(hidden_states, index, weights, *params, activation=activation)

    forward._polykernel = "moe_experts"  # type: ignore[attr-defined]
    return forward


def _llama4_moe_forward(base: Callable) -> Callable:
    """``Llama4TextMoe.forward``: every expert runs on every token scaled by its router score,
    ``σ(logit)`` for the top k and ``σ(-inf) = 0`` for the rest, whose expert output is then
    exactly 0 (act(0)·0 = 0, and so is its gradient). So the block is ``shared(x) + Σ_j
    expert_{e_j}(s_j·x)``: moe_experts on the k scaled copies of each token (one pair per row,
    weight 1), its weights' transposed views in transformers' layout, summed over k.

    The block then reads the experts' weights instead of calling ``self.experts``: where that
    call does more (a wrapper such as PEFT's ``target_parameters`` LoRA, accelerate's hooks, a
    forward replaced or hooked), the block runs transformers' forward (logged once)."""

    @functools.wraps(base)
    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        experts = self.experts
        if not _experts_run_as_is(self, experts):
            return base(self, hidden_states, *args, **kwargs)
        params = (experts.gate_up_proj, experts.down_proj)
        activation = _experts_activation(experts)
        x = hidden_states.reshape(-1, self.hidden_dim)
        # (the routing is not made yet: x stands in for it, checking x and the weights)
        if args or kwargs or activation is None or not _experts_call_ok(x, x, x, params):
            return base(self, hidden_states, *args, **kwargs)
        router_scores, router_logits = self.router(x)
        index = torch.topk(router_logits, self.top_k, dim=1).indices  # the router's own call: its choice
        scores = router_scores.gather(1, index)  # σ(top logits), in the logits' dtype
        t, k, h = x.shape[0], index.shape[1], x.shape[1]
        routed = (x[:, None, :] * scores[..., None]).reshape(t * k, h)  # the block's routed_in rows that are not 0
        ones = torch.ones(t * k, 1, dtype=x.dtype, device=x.device)
        out = _pk.moe_experts(routed, index.reshape(t * k, 1), ones, params[0].mT, params[1].mT, activation=activation)
        return self.shared_expert(x) + out.view(t, k, h).sum(1), router_logits

    forward._polykernel = "moe_experts"  # type: ignore[attr-defined]
    return forward


def _experts_run_as_is(block: nn.Module, experts: Any) -> bool:
    """``experts`` is transformers' own experts module, called as it is: the forward of a modeling
    module's class (no wrapper, subclass or instance forward), no hooks on it or its activation."""
    forward = getattr(type(experts), "forward", None)
    if (
        getattr(forward, "__module__", None) in _FAMILY_BY_MODULE
        and "forward" not in experts.__dict__
        and not hasattr(experts, "_hf_hook")
        and not _compat.module_hooks_seen(experts)
    ):
        return not _hooked_activation(block, getattr(experts, "act_fn", None), "moe_experts")
    _fallback_once(type(block).__name__, f"calls experts that are wrapped, replaced or hooked ({type(experts).__name__})", "moe_experts")
    return False


def _experts_supported(module: nn.Module, layout: str) -> str | None:
    """Why this experts module cannot be patched, or None."""
    if layout == _LLAMA4_EXPERTS:
        if not all(hasattr(module, a) for a in ("experts", "router", "shared_expert", "top_k", "hidden_dim")):
            return "it is not the router, experts and shared expert of transformers' Llama4TextMoe"
        module = module.experts
    op = "moe_experts_gpt_oss" if layout == _GPT_OSS_EXPERTS else "moe_experts"
    if not _has_op(op):
        return f"polykernel.{op} is not available in this build"
    params = _experts_params(module, layout)
    if not all(
        isinstance(p, torch.Tensor) and p.dim() == (3 if i % 2 == 0 or layout != _GPT_OSS_EXPERTS else 2) for i, p in enumerate(params)
    ):
        return "its projections are not the 3D expert tensors of transformers' layout"
    if layout == _GPT_OSS_EXPERTS:
        if not all(isinstance(getattr(module, a, None), (int, float)) for a in ("alpha", "limit")):
            return "it has no numeric alpha and limit"
        return None
    if _experts_activation(module) is None:
        return f"its activation {type(getattr(module, 'act_fn', None)).__name__} is not SiLU or GELU"
    return None
