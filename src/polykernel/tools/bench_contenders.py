"""The contenders of one ``polykernel bench`` case (:mod:`polykernel.tools.bench`): the automatic
choice, every registered impl, the eager reference, ``torch.compile`` of it, and transformers' own
MoE experts where they apply. ``polykernel.tools.bench`` re-exports these names (benchmarks/ import
``transformers_experts`` from there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _contenders(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    compiled: Callable[..., Any] | None,
    device: str = "cuda",
) -> dict[str, Callable[[], Any]]:
    """Name -> a no-argument call of one contender on the same inputs."""
    import polykernel
    from polykernel.core import registry

    public = getattr(polykernel, op.name)
    # The automatic choice first: as a user calls it (static ranks, or the tuning store's choice).
    out: dict[str, Callable[[], Any]] = {"polykernel": lambda: public(*args, **kwargs)}
    # Every registered impl runnable here, the peers included (impl="liger", impl="quack"): a peer
    # is measured through its adapter, as polykernel runs it. An impl whose predicate refuses these
    # arguments (Liger at N > 65536) raises ImplNotAvailableError: its row records the reason.
    runnable = polykernel.available_impls(op.id, device=device, dtype=dtype)
    # An installed peer whose import raised (found by available_impls) gets its row too: its error
    # says why it did not run, so a report never reads as if the peer were simply not installed.
    broken = [n for n, s in registry.specs_for(op).items() if n not in runnable and s.failed_import()]
    for impl in [*runnable, *broken]:
        out[f"polykernel:{impl}"] = lambda impl=impl: public(*args, impl=impl, **kwargs)
    out["eager reference"] = lambda: op.reference(*args, **kwargs)
    if op.name == "moe_experts":
        out.update(transformers_experts(args, kwargs))
    if op.name == "moe_experts_gpt_oss":
        out.update(transformers_gpt_oss_experts(args, kwargs))
    if compiled is not None:
        out["torch.compile"] = lambda: compiled(*args, **kwargs)
    return out


def transformers_experts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """transformers' experts on the same tensors (issue 24's baselines): its ``grouped_mm``
    implementation and its eager loop (``Qwen3MoeExperts.forward``). Empty without transformers
    or where its MoE integration differs from 5.x's."""
    import types

    try:
        from transformers.activations import ACT2FN
        from transformers.integrations import moe as hf_moe
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except Exception:  # not installed, or another layout
        return {}
    hidden, index, weights, gate_up, down = args
    act = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[kwargs.get("activation", "silu")]

    def experts(implementation: str) -> Any:
        # the attributes transformers' use_experts_implementation gives an Experts module
        self = types.SimpleNamespace(
            num_experts=gate_up.shape[0], gate_up_proj=gate_up, down_proj=down, act_fn=ACT2FN[act],
            has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True, has_post_expert_norm=False,
            _is_expert_parallel=False, config=types.SimpleNamespace(_experts_implementation=implementation),
        )  # fmt: skip
        self._apply_gate = lambda gate_up_out: hf_moe._default_apply_gate(self, gate_up_out)
        return self

    grouped, eager = experts("grouped_mm"), experts("eager")
    return {
        "transformers grouped_mm": lambda: hf_moe.grouped_mm_experts_forward(grouped, hidden, index, weights),
        "transformers eager": lambda: Qwen3MoeExperts.forward(eager, hidden, index, weights),
    }


def transformers_gpt_oss_experts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """transformers' ``GptOssExperts`` on the same tensors: its eager loop and its ``grouped_mm``
    experts implementation. Empty without transformers or where its MoE integration differs."""
    import types

    try:
        from transformers.integrations import moe as hf_moe
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except Exception:  # not installed, or another layout
        return {}
    hidden, index, weights, gate_up, gate_up_bias, down, down_bias = args[:7]
    self = types.SimpleNamespace(
        num_experts=gate_up.shape[0], gate_up_proj=gate_up, gate_up_proj_bias=gate_up_bias, down_proj=down,
        down_proj_bias=down_bias, alpha=kwargs.get("alpha", 1.702), limit=kwargs.get("limit", 7.0), has_gate=True,
        has_bias=True, is_transposed=True, is_concatenated=False, has_post_expert_norm=False, _is_expert_parallel=False,
        config=types.SimpleNamespace(_experts_implementation="grouped_mm"),
    )  # fmt: skip
    self._apply_gate = lambda gate_up_out: GptOssExperts._apply_gate(self, gate_up_out)
    eager = getattr(GptOssExperts.forward, "__wrapped__", GptOssExperts.forward)  # the loop, not the dispatching wrapper
    out = {"transformers eager": lambda: eager(self, hidden, index, weights)}
    if hasattr(hf_moe, "grouped_mm_experts_forward"):
        out["transformers grouped_mm"] = lambda: hf_moe.grouped_mm_experts_forward(self, hidden, index, weights)
    return out
