"""A tiny Llama (hidden 64, 4 heads over 2 KV heads, vocab 96) for tests that need a real
transformers model but not its numbers: retention, recompiles, the inference patch."""

from __future__ import annotations

import torch

VOCAB = 96


def tiny_llama(layers: int = 2, seed: int = 0) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()
