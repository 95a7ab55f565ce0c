"""A small Llama-style causal LM built from :mod:`polykernel.nn`, with a switch to plain PyTorch.

The same class runs two ways from the same parameters (so one state dict serves both):

- ``use_polykernel=True``: RMSNorm, SwiGLU, RoPE and the loss go through polykernel (the
  dispatcher picks each kernel; ``fused_loss=True`` never materializes the ``[N, V]`` logits);
- ``use_polykernel=False``: the same math in plain PyTorch, as a Hugging Face model writes it
  (RMSNorm in fp32 then cast, ``F.silu(g) * u``, rotate-half RoPE, ``F.cross_entropy`` on
  materialized fp32 logits).

Attention is ``torch.nn.functional.scaled_dot_product_attention`` (causal) either way.

    >>> import torch
    >>> from polykernel.tools.models import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig.preset("tiny")
    >>> model = LlamaForCausalLM(cfg)
    >>> ids = torch.randint(0, cfg.vocab_size, (2, 16))
    >>> loss = model(ids[:, :-1], targets=ids[:, 1:])
    >>> model.use_polykernel = False  # the same weights through plain PyTorch
    >>> torch.allclose(loss, model(ids[:, :-1], targets=ids[:, 1:]), atol=1e-5)
    True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ... import nn as pnn

__all__ = ["PRESETS", "LlamaConfig", "LlamaForCausalLM"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of the model. ``head_dim = hidden_size // num_heads``; ``num_kv_heads`` < ``num_heads``
    is grouped-query attention. ``norm_casting`` is the RMSNorm rounding order (``"fp32"`` like
    ``torch.nn.RMSNorm``, ``"llama"`` like Hugging Face Llama) used by both paths."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 352
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    norm_casting: str = "fp32"
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE)")
        if self.norm_casting not in ("fp32", "llama"):
            raise ValueError(f"norm_casting must be 'fp32' or 'llama', got {self.norm_casting!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def preset(cls, name: str, **overrides: object) -> LlamaConfig:
        """``"tiny"`` (CPU, seconds), ``"small"`` (a laptop GPU), ``"medium"`` (~1.4B, one H200)."""
        try:
            base = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None
        return dataclasses.replace(base, **overrides)

    def num_parameters(self) -> int:
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        block = attn + 3 * h * i + 2 * h
        return self.num_layers * block + h + v * h * (1 if self.tie_embeddings else 2)


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "small": LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=4, max_seq_len=1024
    ),
    "medium": LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=16,
        num_heads=16,
        num_kv_heads=8,
        max_seq_len=2048,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
}


# ------------------------------------------------------------------------------------------------
# The two code paths. Each takes the polykernel.nn module (for its parameters) and the input.


class _Polykernel:
    """Every call goes through polykernel's dispatcher (via the polykernel.nn modules)."""

    name = "polykernel"

    @staticmethod
    def norm(mod: pnn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return mod(x)

    @staticmethod
    def mlp(mod: pnn.SwiGLU, x: torch.Tensor) -> torch.Tensor:
        return mod(x)

    @staticmethod
    def rope(
        mod: pnn.RotaryEmbedding, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import polykernel

        return polykernel.rope(q, k, cos, sin, impl=mod.impl)

    @staticmethod
    def loss(model: LlamaForCausalLM, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if model.fused_loss:
            return model.flce(h, model.lm_head.weight, targets)
        return model.ce(model.lm_head(h), targets)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Torch:
    """The same math in plain PyTorch (what a Hugging Face model does), no polykernel call."""

    name = "torch"

    @staticmethod
    def norm(mod: pnn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + mod.eps)
        if mod.casting == "llama":
            return ((mod.weight + mod.offset) * xhat.to(x.dtype)).to(x.dtype)
        return (xhat * (mod.weight.float() + mod.offset)).to(x.dtype)

    @staticmethod
    def mlp(mod: pnn.SwiGLU, x: torch.Tensor) -> torch.Tensor:
        return mod.down_proj(F.silu(mod.gate_proj(x)) * mod.up_proj(x))

    @staticmethod
    def rope(
        mod: pnn.RotaryEmbedding, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos[:, None], sin[:, None]  # [B or 1, 1, T, D]: broadcast over heads
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    @staticmethod
    def loss(model: LlamaForCausalLM, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model.lm_head(h).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


# ------------------------------------------------------------------------------------------------
# Modules


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = {"bias": False, "device": device}
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, **kw)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, **kw)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, **kw)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, **kw)

    def forward(self, x: torch.Tensor, rotary: pnn.RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor, path: type) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = path.rope(rotary, q, k, cos, sin)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.input_layernorm = pnn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, casting=cfg.norm_casting, device=device)
        self.self_attn = Attention(cfg, device)
        self.post_attention_layernorm = pnn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, casting=cfg.norm_casting, device=device)
        self.mlp = pnn.SwiGLU(cfg.hidden_size, cfg.intermediate_size, device=device)

    def forward(self, x: torch.Tensor, rotary: pnn.RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor, path: type) -> torch.Tensor:
        x = x + self.self_attn(path.norm(self.input_layernorm, x), rotary, cos, sin, path)
        return x + path.mlp(self.mlp, path.norm(self.post_attention_layernorm, x))


class LlamaForCausalLM(nn.Module):
    """Embedding, ``num_layers`` pre-norm decoder layers, final RMSNorm and LM head.

    ``forward(input_ids [B, T], targets=None)``: the mean next-token loss (fp32 scalar) against
    ``targets [B, T]`` (already shifted; ``-100`` is ignored) when given, else the logits
    ``[B, T, V]``. ``use_polykernel`` (a plain attribute: flip it at will) selects the code path;
    ``fused_loss`` selects fused linear cross-entropy over cross-entropy on materialized logits
    (polykernel path only: the torch path always materializes them).

    Parameters are created in fp32 and initialized from the current torch seed (normal with
    ``init_std``, norms at one); cast with ``.to(dtype)`` afterwards, so both paths and every dtype
    start from the same numbers.
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        use_polykernel: bool = True,
        fused_loss: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.use_polykernel = use_polykernel
        self.fused_loss = fused_loss
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, device) for _ in range(config.num_layers))
        self.norm = pnn.RMSNorm(config.hidden_size, config.rms_norm_eps, casting=config.norm_casting, device=device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = pnn.RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta, device=device)
        self.flce = pnn.FusedLinearCrossEntropyLoss()
        self.ce = pnn.CrossEntropyLoss()
        self.reset_parameters()

    @property
    def path(self) -> type:
        return _Polykernel if self.use_polykernel else _Torch

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=std)
        self.rotary.reset_parameters()

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        path = self.path
        t = input_ids.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}")
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(torch.arange(t, device=input_ids.device), h.dtype)
        for layer in self.layers:
            h = layer(h, self.rotary, cos, sin, path)
        h = path.norm(self.norm, h)
        if targets is None:
            return self.lm_head(h)
        return path.loss(self, h, targets)

    def extra_repr(self) -> str:
        return f"path={self.path.name}, fused_loss={self.fused_loss}, parameters={self.config.num_parameters():,}"
