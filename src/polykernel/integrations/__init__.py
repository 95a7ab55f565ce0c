"""Integrations of polykernel with model libraries.

- :mod:`polykernel.integrations.transformers` — patch Hugging Face ``transformers`` models
  (Llama, Mistral, Qwen2, Qwen3, Gemma) to use polykernel's RMSNorm, gated MLP activations, RoPE
  and (fused linear) cross-entropy.
- :mod:`polykernel.integrations.trl` — TRL's ``DPOTrainer`` and ``GRPOTrainer`` with their loss
  on polykernel's fused LM-head losses (``PolykernelDPOTrainer``, ``PolykernelGRPOTrainer``).

Each integration imports its library only when it is imported itself: ``import polykernel`` and
``import polykernel.integrations`` never import ``transformers`` or ``trl``.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("transformers", "trl")

__all__ = list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'polykernel.integrations' has no attribute {name!r}")
