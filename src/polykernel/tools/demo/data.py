"""The demo's sizes and its data: a synthetic but learnable token stream (nothing is downloaded)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LOSS_TOL", "SETUPS", "DemoSetup", "markov_stream"]


@dataclass(frozen=True)
class DemoSetup:
    """One size: the model shape (``model``: fields shared by the built-in and the Hugging Face
    Llama) and the training run."""

    preset: str
    batch: int
    seq_len: int
    lr: float
    states: int  # tokens the Markov chain visits (a subset of the vocabulary)
    successors: int = 4  # possible next tokens per state
    warmup: int = 5
    model: dict[str, Any] = field(default_factory=dict)


# ``medium`` is the reference run: a Llama-3.2-1B-shaped model (hidden 2048, 16 layers,
# 32/8 heads, MLP 8192, vocab 128256, tied embeddings), bf16, batch 4 x 2048. tiny and small keep
# the built-in presets' shapes.
_MEDIUM = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_layers": 16,
    "num_heads": 32,
    "num_kv_heads": 8,
    "max_seq_len": 2048,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_embeddings": True,
}
SETUPS: dict[str, DemoSetup] = {
    "tiny": DemoSetup("tiny", batch=8, seq_len=128, lr=3e-3, states=128),
    "small": DemoSetup("small", batch=8, seq_len=512, lr=1e-3, states=512),
    "medium": DemoSetup("medium", batch=4, seq_len=2048, lr=6e-4, states=1024, model=_MEDIUM),
}

# Accepted |loss(run) - loss(torch)| per step: atol + rtol * |loss(torch)|. The runs round
# differently (fused kernels vs eager chains) and the difference compounds over optimizer steps.
# fp32: ulp-level differences amplified by Adam over a few dozen steps stay far below 1e-3.
# bf16/fp16: every activation carries a 2^-8 (2^-11) relative rounding that may land either way.
LOSS_TOL = {
    torch.float32: (2e-3, 0.0),
    torch.float64: (1e-6, 0.0),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (1e-2, 5e-3),
}


def markov_stream(vocab: int, n_seqs: int, seq_len: int, *, states: int, successors: int = 4, seed: int = 0) -> tuple[torch.Tensor, float]:
    """``n_seqs`` sequences of ``seq_len + 1`` tokens from a fixed random Markov chain.

    The chain visits ``states`` tokens (a random subset of the vocabulary), each followed by one of
    ``successors`` tokens with fixed random probabilities. Returns the int64 tokens ``[n_seqs,
    seq_len + 1]`` (CPU) and the chain's conditional entropy on this sample in nats: the lowest
    loss any model can reach. Deterministic in ``seed`` on every machine.

    >>> tokens, floor = markov_stream(1000, 2, 16, states=20)
    >>> tokens.shape
    torch.Size([2, 17])
    """
    g = torch.Generator().manual_seed(seed)
    states = min(states, vocab)
    ids = torch.randperm(vocab, generator=g)[:states]
    succ = torch.randint(0, states, (states, successors), generator=g)
    probs = torch.rand(states, successors, generator=g, dtype=torch.float64) + 0.25
    probs /= probs.sum(-1, keepdim=True)
    cum = probs.cumsum(-1)
    cum[:, -1] = 1.0 + 1e-9
    state = torch.randint(0, states, (n_seqs,), generator=g)
    out = torch.empty(n_seqs, seq_len + 1, dtype=torch.int64)
    nll = torch.zeros((), dtype=torch.float64)
    for t in range(seq_len + 1):
        out[:, t] = ids[state]
        choice = torch.searchsorted(cum[state], torch.rand(n_seqs, 1, generator=g, dtype=torch.float64)).squeeze(1)
        if t < seq_len:
            nll -= probs[state, choice].log().sum()
        state = succ[state, choice]
    return out, float(nll) / max(1, n_seqs * seq_len)
