"""The demo's contenders, each a model plus how to get a step's loss from it, built from the same
seed (so the same initial weights) on the same device:

- ``torch``: the plain model;
- ``polykernel``: the same model on polykernel's ops (``polykernel.integrations.transformers.patch``
  for a Hugging Face model, the built-in model's polykernel path otherwise);
- ``liger``: Liger-Kernel's own patch of the Hugging Face model (``apply_liger_kernel_to_llama``);
- ``compile``: ``torch.compile`` of the plain model;
- ``polykernel+compile``: ``torch.compile`` of the polykernel-patched model (ask for it with
  ``--compare``; issue 14's comparison).

The model is a ``transformers`` Llama built from a config (random init, nothing downloaded) when
``transformers`` is installed, else the built-in :mod:`polykernel.tools.models.llama`.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from polykernel.errors import missing_extra

__all__ = ["VARIANTS", "Variant", "build", "default_compare", "model_kind", "parse_compare"]

# contender -> (on polykernel's ops, under torch.compile); liger is patched separately
_CONTENDERS = {
    "torch": (False, False),
    "polykernel": (True, False),
    "liger": (False, False),
    "compile": (False, True),
    "polykernel+compile": (True, True),
}
VARIANTS = tuple(_CONTENDERS)


@dataclass
class Variant:
    """One contender: ``model`` holds the parameters to optimize, ``loss(batch)`` runs a forward
    on ``batch`` (``[B, T + 1]`` token ids) and returns the mean next-token loss; ``close()``
    undoes process-wide changes (Liger's patch of the modeling module)."""

    name: str
    model: torch.nn.Module
    loss: Callable[[torch.Tensor], torch.Tensor]
    close: Callable[[], None] = field(default=lambda: None)


def model_kind(requested: str = "auto") -> str:
    """``hf`` (a transformers Llama) when transformers is installed, else ``builtin``."""
    if requested == "auto":
        return "hf" if importlib.util.find_spec("transformers") is not None else "builtin"
    if requested == "hf" and importlib.util.find_spec("transformers") is None:
        raise ValueError(str(missing_extra("polykernel demo --model hf", "transformers")))
    return requested


def default_compare(device: torch.device, kind: str) -> list[str]:
    """torch and polykernel everywhere; on CUDA also Liger-Kernel (when installed, on a Hugging
    Face model) and torch.compile. On the CPU torch.compile is left out by default: Inductor's C++
    compile of a whole model takes longer than the rest of the tiny demo together (ask for it with
    ``--compare``), and Liger's kernels need a GPU."""
    out = ["torch", "polykernel"]
    if device.type == "cuda":
        if kind == "hf" and importlib.util.find_spec("liger_kernel") is not None:
            out.append("liger")
        out.append("compile")
    return out


def parse_compare(text: str | None, device: torch.device, kind: str) -> list[str]:
    """``--compare torch,polykernel,...`` checked before anything runs (torch always first: it is
    the baseline the other runs' losses and speeds are compared with)."""
    if not text:
        return default_compare(device, kind)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"polykernel demo --compare: unknown run {', '.join(unknown) or repr(text)}; choose from {', '.join(VARIANTS)}")
    if "liger" in names:
        if kind != "hf":
            raise ValueError("polykernel demo --compare liger: Liger-Kernel patches Hugging Face models; install transformers")
        if importlib.util.find_spec("liger_kernel") is None:
            raise ValueError(str(missing_extra("polykernel demo --compare liger", "liger")))
        if device.type != "cuda":
            raise ValueError("polykernel demo --compare liger: Liger-Kernel's kernels need a CUDA device")
    return ["torch", *dict.fromkeys(n for n in names if n != "torch")]


def build(
    name: str, kind: str, shape: dict[str, Any], *, device: torch.device, dtype: torch.dtype, seed: int, fused_loss: bool = True
) -> Variant:
    """Build contender ``name`` on ``device`` in ``dtype`` from ``seed`` (the same weights for every name)."""
    torch.manual_seed(seed)
    if kind == "hf":
        return _hf(name, shape, device, dtype, fused_loss)
    return _builtin(name, shape, device, dtype, fused_loss)


def _builtin(name: str, shape: dict[str, Any], device: torch.device, dtype: torch.dtype, fused_loss: bool) -> Variant:
    from polykernel.tools.models import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.preset(shape["preset"], **{k: v for k, v in shape.items() if k != "preset"})
    use_polykernel, compiled = _CONTENDERS[name]
    model = LlamaForCausalLM(cfg, use_polykernel=use_polykernel, fused_loss=fused_loss, device=device).to(dtype)
    fwd = torch.compile(model) if compiled else model
    return Variant(name, model, lambda b: fwd(b[:, :-1], targets=b[:, 1:]))


def hf_config(shape: dict[str, Any]) -> Any:
    """A transformers ``LlamaConfig`` for the demo's model shape (SDPA attention, no KV cache)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        max_position_embeddings=shape["max_seq_len"],
        rope_theta=shape["rope_theta"],
        rms_norm_eps=shape["rms_norm_eps"],
        tie_word_embeddings=shape["tie_embeddings"],
        attn_implementation="sdpa",
        use_cache=False,
    )


def _hf(name: str, shape: dict[str, Any], device: torch.device, dtype: torch.dtype, fused_loss: bool) -> Variant:
    import transformers

    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config(shape)).to(dtype)
    use_polykernel, compiled = _CONTENDERS[name]
    close: Callable[[], None] = lambda: None
    if use_polykernel:
        from polykernel.integrations.transformers import patch

        patch(model, fused_linear_cross_entropy=fused_loss)
    elif name == "liger":
        close = _liger_patch(model)
    fwd: Any = torch.compile(model) if compiled else model

    # HF convention: labels are the inputs, shifted inside the model (T - 1 predictions per row)
    def loss(b: torch.Tensor) -> torch.Tensor:
        ids = b[:, :-1]
        return fwd(input_ids=ids, labels=ids).loss

    return Variant(name, model, loss, close)


def _liger_patch(model: torch.nn.Module) -> Callable[[], None]:
    """Liger-Kernel's patch of one Llama instance (RoPE, RMSNorm, SwiGLU, fused linear CE). Liger
    also swaps module-level names in transformers' modeling_llama (the RoPE function, the norm and
    MLP classes) that every Llama in the process sees: the returned function puts them back, so
    the runs after this one are not silently on Liger's kernels."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    saved = {n: getattr(modeling_llama, n) for n in names}
    saved_forward = modeling_llama.LlamaForCausalLM.forward
    apply_liger_kernel_to_llama(model=model)

    def close() -> None:
        for n, v in saved.items():
            setattr(modeling_llama, n, v)
        modeling_llama.LlamaForCausalLM.forward = saved_forward

    return close


@contextlib.contextmanager
def built(name: str, kind: str, shape: dict[str, Any], **kw: Any) -> Iterator[Variant]:
    """:func:`build` as a context: the variant's process-wide changes are undone on exit."""
    v = build(name, kind, shape, **kw)
    try:
        yield v
    finally:
        v.close()
