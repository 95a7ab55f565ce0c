"""Small reference models built from :mod:`polykernel.nn` (the demo's and the tests' workloads).

- :mod:`polykernel.tools.models.llama`: a Llama-style causal LM with a switch between polykernel and
  plain PyTorch, so the two can be compared step by step;
- :mod:`polykernel.tools.models.distributed`: one DDP / FSDP2 training step with and without
  polykernel, compared (``python -m polykernel.tools.models.distributed``).
"""

from .llama import PRESETS, LlamaConfig, LlamaForCausalLM

__all__ = ["PRESETS", "LlamaConfig", "LlamaForCausalLM"]
