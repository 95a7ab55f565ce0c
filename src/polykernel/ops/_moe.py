"""What the MoE experts ops (``moe_experts``, ``moe_experts_gpt_oss``) share: the routing's and
hidden's checks, the parity cases' routings, the error model's per-pair bookkeeping, FLOPs,
bytes and the declaration's common facts. Each op file keeps its own layout, activation,
biases and clamp (its reference, its parameters' checks, its error model's terms)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from ..core.op import SUM_LAMBDA, TINY, UNIT_ROUNDOFF, Bounds, Case, ErrorModel
from ..distributed.layout import ROWS, Layout, rows_with
from . import _checks as check

INDEX_DTYPES = (torch.int64, torch.int32)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


# -- checks -------------------------------------------------------------------------------------------
def check_hidden(op_id: str, hidden: torch.Tensor) -> int:
    """hidden is a floating ``[T, H]`` tensor; returns H."""
    check.tensor(op_id, "hidden", hidden)
    check.floating(op_id, "hidden", hidden)
    if hidden.dim() != 2:
        raise check.OpArgumentError(op_id, "hidden", f"expected [T, H] (tokens, hidden size), got shape {tuple(hidden.shape)}")
    return hidden.shape[1]


def check_like_hidden(op_id: str, hidden: torch.Tensor, named: tuple[tuple[str, torch.Tensor], ...]) -> None:
    """Each parameter tensor has hidden's dtype and device."""
    for name, tensor in named:
        if tensor.dtype != hidden.dtype:
            raise check.OpTypeError(op_id, name, f"expected hidden's dtype {hidden.dtype}, got {tensor.dtype}")
        check.same_device(op_id, name, tensor, "hidden", hidden)


def check_routing(op_id: str, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n_experts: int) -> None:
    """The routing's checks: index and weights ``[T, k]`` of hidden's T, their dtypes and device;
    on the CPU also the index values."""
    t = hidden.shape[0]
    check.tensor(op_id, "top_k_index", top_k_index)
    if top_k_index.dtype not in INDEX_DTYPES:
        raise check.OpTypeError(op_id, "top_k_index", f"expected an int64 or int32 tensor of expert indices, got {top_k_index.dtype}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != t or top_k_index.shape[1] == 0:
        raise check.OpArgumentError(
            op_id, "top_k_index", f"expected [T, k] with T = {t} (hidden's rows) and k >= 1, got {tuple(top_k_index.shape)}"
        )
    check.same_device(op_id, "top_k_index", top_k_index, "hidden", hidden)
    check.tensor(op_id, "top_k_weights", top_k_weights)
    check.floating(op_id, "top_k_weights", top_k_weights)
    if top_k_weights.shape != top_k_index.shape:
        raise check.OpArgumentError(
            op_id, "top_k_weights", f"expected top_k_index's shape {tuple(top_k_index.shape)}, got {tuple(top_k_weights.shape)}"
        )
    if top_k_weights.dtype not in (hidden.dtype, torch.promote_types(hidden.dtype, torch.float32)):
        raise check.OpTypeError(op_id, "top_k_weights", f"expected hidden's dtype {hidden.dtype} or float32, got {top_k_weights.dtype}")
    check.same_device(op_id, "top_k_weights", top_k_weights, "hidden", hidden)
    # The values: on the CPU, for plain tensors (a DTensor's would need a collective: its local
    # shards are checked where they are sorted), not while torch.compile traces (fake tensors
    # have none). Off the CPU they would cost a host sync per call: the impls check them on the
    # device instead (polykernel.backends.torch._moe_route).
    if type(top_k_index) in _PLAIN and top_k_index.is_cpu and top_k_index.numel() and not torch.compiler.is_compiling():
        lo, hi = torch.aminmax(top_k_index)
        if int(lo) < 0 or int(hi) >= n_experts:
            bad = int(lo) if int(lo) < 0 else int(hi)
            raise check.OpArgumentError(
                op_id, "top_k_index", f"expert index {bad} is out of range [0, {n_experts}) (E = gate_up_proj.shape[0])"
            )


def routing_agrees(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> bool:
    """The routing's part of an argument class's agreement flag: T and k match."""
    return top_k_index.shape[0] == hidden.shape[0] and top_k_weights.shape == top_k_index.shape


# -- FLOPs and bytes ----------------------------------------------------------------------------------
def routed_flops(top_k_index: torch.Tensor, h: int, inter: int, backward: bool) -> int:
    """Per token-expert pair 2·H·2I (gate/up) + 2·I·H (down): 6·S·H·I forward (S = T·k pairs);
    the backward's dX and dW GEMMs double it: 18·S·H·I fwd+bwd."""
    return (18 if backward else 6) * top_k_index.numel() * h * inter


def routed_bytes(hidden: torch.Tensor, params: tuple[torch.Tensor, ...], backward: bool) -> int:
    """Read hidden and the parameters, write the output; the backward reads them again with the
    cotangent and writes dX and every parameter's gradient."""
    acts = hidden.numel() * hidden.element_size()
    weights = sum(p.numel() * p.element_size() for p in params)
    fwd = 2 * acts + weights
    return fwd + 3 * acts + 2 * weights if backward else fwd


def outputs(hidden: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((hidden.shape, hidden.dtype),)


# The declaration's facts both ops share: the dtypes; "ours" for torch.compile (the reference
# runs every expert on every token, E/k times the routed work); tokens are independent, so
# hidden, the index and the weights shard alike on the token dim and the parameters are
# replicated (their gradients are then partial sums over the shards).
DECLARATION = dict(
    outputs=outputs,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    compile_mode="ours",
    dtensor_layout=Layout(ROWS, rows_with(1, 2), (0,)),
)


# -- error model: the per-pair bookkeeping ------------------------------------------------------------
def gamma(n: int) -> float:
    """λ·√n: a dot product of n terms in fp32 is off by this many u32 of its terms' magnitudes."""
    return SUM_LAMBDA * max(n, 1) ** 0.5


def subnormal_units(dtype: torch.dtype) -> float:
    """A rounding to the dtype is off by u_d·|v| or by up to half the smallest subnormal: the
    latter in units of u_d."""
    return TINY[dtype] / UNIT_ROUNDOFF[dtype] if dtype in TINY else 0.0


class Pairs(NamedTuple):
    """The token-expert pairs in float64, flattened (pair p = token p // k's p % k-th choice)."""

    x: torch.Tensor  # [T, H] hidden
    w: torch.Tensor  # [S] routing weights
    expert: torch.Tensor  # [S]
    token: torch.Tensor  # [S]


def pairs(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Pairs:
    t, k = top_k_index.shape
    x = hidden.detach().double()
    token = torch.arange(t, device=x.device).repeat_interleave(k)
    return Pairs(x, top_k_weights.detach().double().reshape(-1), top_k_index.reshape(-1), token)


def by_expert(expert: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """Each used expert and its pairs' positions."""
    for e in torch.unique(expert).tolist():
        yield e, (expert == e).nonzero().squeeze(1)


def model(c: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> ErrorModel:
    """A bound from its two parts, each the maximum over the output: the u32 terms (``cancel``)
    and the u_d terms (``rounds_abs``)."""
    cmax = c.max().item() if c.numel() else 0.0
    dmax = d.max().item() if d.numel() else 0.0
    return ErrorModel(ops=2, cancel=cmax, rounds_abs=dmax, scale=1.0, inter=dtype)


# Rows of one expert whose float64 intermediates (~20 of [rows, I] or [rows, H]) exist at once.
CHUNK_ROWS = 1024


def chunks(sel: torch.Tensor) -> Iterator[torch.Tensor]:
    """An expert's pair positions, :data:`CHUNK_ROWS` at a time."""
    yield from sel.split(CHUNK_ROWS)


def running_max(acc: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``acc`` (0-d) and the maximum of ``part`` (none where it is empty); a NaN stays NaN."""
    return torch.maximum(acc, part.max()) if part.numel() else acc


class Tally:
    """An MoE error model's bounds, gathered expert by expert and chunk by chunk, in memory of
    ``[T, H]`` and ``[S]`` (S = T·k pairs), never of the parameters' shapes: the output's and d
    hidden's per-pair parts summed into their token, the routing weights' per pair, and each
    parameter's (arguments 3, 4, ...) as its running maximum (only maxima reach the Bounds)."""

    def __init__(self, x: torch.Tensor, k: int, n_params: int) -> None:
        t, h = x.shape
        z = dict(device=x.device, dtype=torch.float64)
        self.k = k
        self.out = (torch.zeros(t, h, **z), torch.zeros(t, h, **z))
        self.d_hidden = (torch.zeros(t, h, **z), torch.zeros(t, h, **z))
        self.d_weights = (torch.zeros(t * k, **z), torch.zeros(t * k, **z))
        self.d_params = [(torch.zeros((), **z), torch.zeros((), **z)) for _ in range(n_params)]

    def pairs(
        self,
        sel: torch.Tensor,
        out: tuple[torch.Tensor, torch.Tensor],
        d_hidden: tuple[torch.Tensor, torch.Tensor],
        d_weights: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Pairs ``sel``'s parts: ``[n, H]`` summed into their tokens (accumulating puts: a token
        may name one expert twice; deterministic where deterministic algorithms are asked for),
        ``[n]`` stored."""
        tok = (sel // self.k,)
        for acc, part in zip((*self.out, *self.d_hidden), (*out, *d_hidden)):
            acc.index_put_(tok, part, accumulate=True)
        for acc, part in zip(self.d_weights, d_weights):
            acc[sel] = part

    def param(self, i: int, c: torch.Tensor, d: torch.Tensor) -> None:
        """Parameter ``i``'s (u32, u_d) parts for one expert (any shape, broadcasts expanded)."""
        mc, md = self.d_params[i]
        self.d_params[i] = (running_max(mc, c), running_max(md, d))

    def bounds(self, dtype: torch.dtype) -> Bounds:
        grads = {0: model(*self.d_hidden, dtype), 2: model(*self.d_weights, dtype)}
        grads.update({3 + i: model(c, d, dtype) for i, (c, d) in enumerate(self.d_params)})
        return Bounds(outputs=(model(*self.out, dtype),), grads=grads)


# -- cases --------------------------------------------------------------------------------------------
def routing(t: int, k: int, n_experts: int, device: torch.device | str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's output: k distinct experts per token (random), positive weights summing to 1."""
    logits = torch.randn(t, n_experts, device=device)
    index = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = torch.softmax(logits, -1).gather(-1, index)
    return index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def routed(
    t: int, h: int, n_experts: int, k: int, index: torch.Tensor | None, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden ``[T, H]``, and the routing: a router's (``index`` None) or ``index`` with
    positive weights summing to 1; the index on ``device``."""
    hidden = torch.randn(t, h, device=device).to(dtype)
    if index is None:
        index, weights = routing(t, k, n_experts, device, dtype)
    else:
        weights = torch.rand(t, k, device=device) + 0.1
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    return hidden, index.to(device), weights


def example(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    requires_grad: bool,
    params: Callable[[int, int, int, torch.device | str, torch.dtype], tuple[torch.Tensor, ...]],
) -> Case:
    """``shape`` = (T, H, I, E, k), trailing sizes optional (I = H, E = 4, k = 2): random tokens,
    a softmax top-k routing, and ``params(E, H, I, device, dtype)``, the op's parameters."""
    t, h, inter, n_experts, k = (*shape, *(shape[1], 4, 2)[len(shape) - 2 :])
    hidden = torch.randn(t, h, device=device).to(dtype)
    index, weights = routing(t, k, n_experts, device, dtype)
    tensors = [a.requires_grad_(requires_grad) for a in (hidden, weights, *params(n_experts, h, inter, device, dtype))]
    return Case(f"T{t},H{h},I{inter},E{n_experts},k{k}", (tensors[0], index, tensors[1], *tensors[2:]))


def skewed(t: int, n_experts: int, hot: int, share: float) -> torch.Tensor:
    """k = 1: ``share`` of the tokens go to expert ``hot``, the rest anywhere."""
    index = torch.randint(0, n_experts, (t, 1))
    index[: round(share * t)] = hot
    return index[torch.randperm(t)]


class Spec(NamedTuple):
    """One case's sizes and routing (None: a router's)."""

    label: str
    t: int
    h: int
    inter: int
    n_experts: int
    k: int
    index: torch.Tensor | None = None


def awkward_routings() -> list[Spec]:
    """The routings every MoE experts op is tested on: one token, none, k = 1, a token naming
    one expert twice, empty experts, 90% of the tokens on one expert."""
    return [
        Spec("1x24x40-E5-k1", 1, 24, 40, 5, 1),
        Spec("0x24x40-E5-k2", 0, 24, 40, 5, 2),
        Spec("5x16x24-E1-k2-twice", 5, 16, 24, 1, 2, torch.zeros(5, 2, dtype=torch.long)),  # both slots: expert 0
        Spec("12x24x40-E8-k2-empty-experts", 12, 24, 40, 8, 2, torch.stack([torch.full((12,), 1), torch.full((12,), 6)], 1)),
        Spec("20x24x40-E5-k1-skew90", 20, 24, 40, 5, 1, skewed(20, 5, 3, 0.9)),
    ]


def large_routings() -> list[Spec]:
    """The large cases both ops share (GPU parity): a skewed k = 1 and odd sizes."""
    return [
        Spec("4096x1024x512-E16-k1-skew90", 4096, 1024, 512, 16, 1, skewed(4096, 16, 5, 0.9)),
        Spec("1031x1000x700-E9-k3-odd", 1031, 1000, 700, 9, 3),
    ]


def int32_fp32_weights(c: Case) -> Case:
    """``c`` with an int32 index and fp32 routing weights (DeepSeek-V3's router)."""
    hidden, index, weights, *params = c.args
    return Case(c.label, (hidden, index.int(), weights.detach().float().requires_grad_(), *params), c.kwargs)
