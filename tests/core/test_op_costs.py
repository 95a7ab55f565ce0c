"""Every op's ``bytes_moved`` (and ``flops`` where it declares one) against figures derived by hand.

The convention (``docs/contributing.md``, ``polykernel bench``'s docstring): the fewest bytes an
ideal kernel moves, each input read once and each output written once at its dtype's size; the
forward+backward figure (``backward=True``) adds what a separate backward reads (the saved inputs
or outputs it needs, the cotangents) and writes (the gradients), the norms' per-row statistics
recomputed (not counted), a parameter read again and its gradient written (3x its size). Small
side tensors each op file says it leaves out are not counted: integer targets and labels (O(N)),
the routing of the MoE experts, scalar scales, dyt's alpha, poly_norm's four parameters, the
heads' biases. Matmul FLOPs are 2·M·N·K per GEMM; elementwise ops declare none.

Each figure is written as arithmetic from the shapes (bf16 2 bytes, fp32 4, fp8 1, int64 8), not
by calling the formula again: a formula change must change this table too. Pure arithmetic, no
kernel runs.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from polykernel.core import registry

BF, F32, I64 = torch.bfloat16, torch.float32, torch.int64


def e(*shape: int, dtype: torch.dtype = BF, grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype).requires_grad_(grad)


M, N = 6, 16  # rows and row length of the row-wise ops
V = 40  # the losses' vocabulary
T, H, FF, E, K = 8, 16, 12, 4, 2  # MoE: tokens, hidden, intermediate, experts, top-k
R, S, Hr = 2, 3, 24  # the preference losses' sequences and tokens; a reference head's width

# (op, args, kwargs, forward bytes, forward+backward bytes or None for an inference-only op)
BYTES = [
    # norms: x read, y written; backward: x and dy read, dx written; weight (fp32 here) read, read
    # again, dweight written
    ("rms_norm", (e(M, N), e(N, dtype=F32)), {}, M * N * 2 + M * N * 2 + N * 4, M * N * 2 * 2 + M * N * 2 * 3 + N * 4 * 3),
    # x, residual read, y, s written; backward: s, dy, d(s_out) read, one ds written (x's and residual's)
    ("fused_add_rms_norm", (e(M, N), e(M, N), e(N)), {}, 4 * M * N * 2 + N * 2, 4 * M * N * 2 + 4 * M * N * 2 + 3 * N * 2),
    ("fused_add_rms_norm_", (e(M, N), e(M, N), e(N)), {}, 2 * M * N * 2 + 2 * M * N * 2 + N * 2, None),  # both read, both written in place
    ("layer_norm", (e(M, N), e(N), e(N)), {}, 2 * M * N * 2 + 2 * N * 2, 5 * M * N * 2 + 3 * 2 * N * 2),
    ("layer_norm", (e(M, N),), {}, 2 * M * N * 2, 5 * M * N * 2),  # no weight, no bias
    ("group_norm", (e(2, 8, 4, 4), 4, e(8), e(8)), {}, 2 * 256 * 2 + 2 * 8 * 2, 5 * 256 * 2 + 3 * 2 * 8 * 2),  # per-channel parameters
    ("dyt", (e(M, N), e(1), e(N), e(N)), {}, 2 * M * N * 2 + 2 * N * 2, 5 * M * N * 2 + 3 * 2 * N * 2),
    ("dyt", (e(M, N), e(1), e(N)), {}, 2 * M * N * 2 + N * 2, 5 * M * N * 2 + 3 * N * 2),  # bias None
    ("poly_norm", (e(M, N), e(3), e()), {}, 2 * M * N * 2, 5 * M * N * 2),
    ("rms_norm_quant_fp8", (e(M, N), e(N), e(1, dtype=F32)), {}, M * N * 2 + N * 2 + M * N * 1, None),  # q in fp8
    # gated and elementwise activations
    (
        "swiglu",
        (e(M, N), e(M, N)),
        {},
        2 * M * N * 2 + M * N * 2,
        3 * M * N * 2 + 3 * M * N * 2 + 2 * M * N * 2,
    ),  # bwd: gate, up, dy; dgate, dup
    ("geglu", (e(M, N), e(M, N)), {}, 3 * M * N * 2, 8 * M * N * 2),
    ("silu_and_mul", (e(M, 2 * N),), {}, M * 2 * N * 2 + M * N * 2, None),
    ("gelu_and_mul", (e(M, 2 * N),), {}, M * 2 * N * 2 + M * N * 2, None),
    ("relu_squared", (e(M, N),), {}, 2 * M * N * 2, 2 * M * N * 2 + 3 * M * N * 2),
    ("softmax", (e(M, N),), {}, 2 * M * N * 2, 2 * M * N * 2 + 3 * M * N * 2),  # bwd: y, dy read, dx written
    ("sparsemax", (e(M, N),), {}, 2 * M * N * 2, 5 * M * N * 2),
    # fp8 quantisation: x read, q written (1 byte), the fp32 scales
    ("dynamic_quant_fp8", (e(M, N),), {}, M * N * 2 + M * N * 1 + M * 4, None),  # one scale per row
    ("dynamic_quant_fp8", (e(M, N), False), {}, M * N * 2 + M * N * 1 + 4, None),  # one scale per tensor
    ("dynamic_quant_fp8", (e(M, N),), {"per_token": False}, M * N * 2 + M * N * 1 + 4, None),
    ("static_quant_fp8", (e(M, N), e(1, dtype=F32)), {}, M * N * 2 + M * N * 1, None),
    # rotary: q [B, Hq, T, D], k [B, Hk, T, D] read and written, the [1, T, D] tables read; the
    # backward the same again (dq_rot, dk_rot, cos, sin read; dq, dk written)
    (
        "rope",
        (e(2, 4, 5, 8), e(2, 2, 5, 8), e(1, 5, 8), e(1, 5, 8)),
        {},
        2 * (320 + 160) * 2 + 2 * 40 * 2,
        2 * (2 * (320 + 160) * 2 + 2 * 40 * 2),
    ),
    # M-RoPE: [3, B, T, D] tables, each feature reads one axis's: a third of them
    (
        "mrope",
        (e(2, 4, 5, 8), e(2, 2, 5, 8), e(3, 2, 5, 8), e(3, 2, 5, 8), [1, 1, 2]),
        {},
        2 * (320 + 160) * 2 + 2 * 80 * 2,
        2 * (2 * (320 + 160) * 2 + 2 * 80 * 2),
    ),
    # vLLM's layout: T = 5 tokens, 4 query and 2 key heads of 16, rotary_dim 8 (partial: the rest
    # untouched), each token's cache row (fp32) and its int64 position read
    (
        "rotary_embedding_",
        (e(5, dtype=I64), e(5, 64), e(5, 32), 16, e(100, 8, dtype=F32)),
        {},
        2 * 5 * (4 + 2) * 8 * 2 + 5 * (8 * 4 + 8),
        None,
    ),
    ("rotary_embedding_", (e(5, dtype=I64), e(5, 4, 16), None, 16, e(100, 8, dtype=F32)), {}, 2 * 5 * 4 * 8 * 2 + 5 * (8 * 4 + 8), None),
    # router: logits read, k weights (logits' dtype) and k int64 indices written; backward: logits
    # and the weights' cotangent read, dlogits written
    (
        "moe_router",
        (e(M, E * 4), K),
        {},
        M * 16 * 2 + M * K * 2 + M * K * 8,
        M * 16 * 2 + M * K * (2 + 8) + M * 16 * 2 + M * K * 2 + M * 16 * 2,
    ),
    # losses over [M, V] logits: read once per pass, dlogits written
    ("cross_entropy", (e(M, V), e(M, dtype=I64)), {}, M * V * 2, M * V * 2 + M * V * 2 + M * V * 2),
    ("cross_entropy", (e(M, V), e(M, dtype=I64)), {"softcap": 30.0}, M * V * 2, 3 * M * V * 2),
    # distillation: both [M, V] inputs read; the gradient computed in the forward, written once
    ("kl_div", (e(M, V, grad=True), e(M, V, dtype=F32)), {}, M * V * (2 + 4), M * V * (2 + 4) + M * V * 2),
    ("kl_div", (e(M, V, grad=True), e(M, V, grad=True)), {}, 2 * M * V * 2, 2 * M * V * 2 + 2 * M * V * 2),  # + d_target
    # "none": the fp32 loss written; the backward reads the fp32 cotangent and target, writes d_input
    (
        "kl_div",
        (e(M, V, grad=True), e(M, V)),
        {"reduction": "none"},
        2 * M * V * 2 + M * V * 4,
        2 * M * V * 2 + M * V * 4 + M * V * 2 + M * V * (4 + 2),
    ),
    ("jsd", (e(M, V, grad=True), e(M, V), e(M, dtype=I64)), {}, 2 * M * V * 2, 2 * M * V * 2 + M * V * 2),
    ("tvd", (e(M, V, grad=True), e(M, V), e(M, dtype=I64)), {}, 2 * M * V * 2, 2 * M * V * 2 + M * V * 2),
    (
        "tvd",
        (e(M, V, grad=True), e(M, V)),
        {"reduction": "none"},
        2 * M * V * 2 + M * V * 4,
        2 * M * V * 2 + M * V * 4 + M * V * 2 + M * V * (2 + 2 + 4),
    ),
    # fused linear heads: hidden [N, H] and weight [V, H] read, no [N, V] logits; dH, dW written
    ("fused_linear_cross_entropy", (e(M, H), e(V, H), e(M, dtype=I64)), {}, M * H * 2 + V * H * 2, 2 * (M * H * 2 + V * H * 2)),
    # the teacher (Ht = 24, fp32) read, no gradient
    (
        "fused_linear_jsd",
        (e(M, H), e(V, H), e(M, Hr, dtype=F32), e(V, Hr, dtype=F32)),
        {},
        M * H * 2 + V * H * 2 + M * Hr * 4 + V * Hr * 4,
        2 * (M * H * 2 + V * H * 2) + M * Hr * 4 + V * Hr * 4,
    ),
    # MoE experts: hidden read and out written, every expert's weights read once per call (not per
    # routed token); backward: hidden and dy read, dX written, the weights read again, dW written
    (
        "moe_experts",
        (e(T, H), e(T, K, dtype=I64), e(T, K), e(E, 2 * FF, H), e(E, H, FF)),
        {},
        2 * T * H * 2 + (E * 2 * FF * H + E * H * FF) * 2,
        2 * T * H * 2 + 3 * T * H * 2 + 3 * (E * 2 * FF * H + E * H * FF) * 2,
    ),
    (
        "moe_experts_gpt_oss",
        (e(T, H), e(T, K, dtype=I64), e(T, K), e(E, H, 2 * FF), e(E, 2 * FF), e(E, FF, H), e(E, H)),
        {},
        2 * T * H * 2 + (E * H * 2 * FF + E * 2 * FF + E * FF * H + E * H) * 2,
        5 * T * H * 2 + 3 * (E * H * 2 * FF + E * 2 * FF + E * FF * H + E * H) * 2,
    ),
]

_HEAD = (e(R, S, H), e(V, H), e(R, S, dtype=I64))  # the policy's hidden [R, S, H], weight [V, H], targets
_REF = (e(R, S, Hr), e(V, Hr))  # a reference model's head (no gradient)
_POLICY = R * S * H * 2 + V * H * 2
BYTES += [(f"fused_linear_{n}_loss", _HEAD, {}, _POLICY, 2 * _POLICY) for n in ("dpo", "orpo", "cpo", "simpo", "kto", "grpo")]
# DPO and KTO with a reference head: its hidden states and weight read once, in both modes
_WITH_REF = _POLICY + R * S * Hr * 2 + V * Hr * 2
BYTES += [
    ("fused_linear_dpo_loss", _HEAD, {"ref_hidden": _REF[0], "ref_weight": _REF[1]}, _WITH_REF, 2 * _POLICY + R * S * Hr * 2 + V * Hr * 2),
    ("fused_linear_dpo_loss", (*_HEAD, None, *_REF), {}, _WITH_REF, 2 * _POLICY + R * S * Hr * 2 + V * Hr * 2),  # positional
    ("fused_linear_kto_loss", (*_HEAD, e(R, dtype=torch.bool), None, *_REF), {}, _WITH_REF, 2 * _POLICY + R * S * Hr * 2 + V * Hr * 2),
]


def _id(row: tuple) -> str:
    return row[0] + ("-" + "-".join(f"{k}" for k in row[2]) if row[2] else "") + f"-{len(row[1])}args"


def test_the_table_covers_every_op():
    assert {r[0] for r in BYTES} == {op_id.rpartition(".")[2] for op_id in registry.all_op_ids()}


@pytest.mark.parametrize("row", BYTES, ids=[_id(r) for r in BYTES])
def test_bytes_moved(row):
    name, args, kwargs, fwd, fwd_bwd = row
    op = registry.get_op(name)
    assert op.bytes_moved(*args, backward=False, **kwargs) == fwd
    if fwd_bwd is not None:
        assert not op.writes
        assert op.bytes_moved(*args, backward=True, **kwargs) == fwd_bwd
    else:
        assert op.writes  # inference only: bench times the forward alone


# (op, args, kwargs, forward FLOPs, forward+backward FLOPs): the matmul-bound ops
_POLICY_FLOPS = 2 * R * S * H * V  # the policy head's logits [R·S, V] = hidden @ weight.T
FLOPS = [
    # logits 2·N·H·V; backward dH = dlogits @ W and dW = dlogitsᵀ @ h, 2·N·H·V each
    ("fused_linear_cross_entropy", (e(M, H), e(V, H), e(M, dtype=I64)), {}, 2 * M * H * V, 2 * M * H * V + 2 * 2 * M * H * V),
    # both heads forward (the teacher's of width Hr), the student's two GEMMs backward
    (
        "fused_linear_jsd",
        (e(M, H), e(V, H), e(M, Hr), e(V, Hr)),
        {},
        2 * M * H * V + 2 * M * Hr * V,
        2 * M * H * V + 2 * M * Hr * V + 4 * M * H * V,
    ),
    # per routed (token, expert) pair: gate/up [2·FF, H] and down [H, FF] GEMMs; backward dX and dW of each
    (
        "moe_experts",
        (e(T, H), e(T, K, dtype=I64), e(T, K), e(E, 2 * FF, H), e(E, H, FF)),
        {},
        T * K * (2 * H * 2 * FF + 2 * FF * H),
        3 * T * K * (2 * H * 2 * FF + 2 * FF * H),
    ),
    (
        "moe_experts_gpt_oss",
        (e(T, H), e(T, K, dtype=I64), e(T, K), e(E, H, 2 * FF), e(E, 2 * FF), e(E, FF, H), e(E, H)),
        {},
        T * K * (2 * H * 2 * FF + 2 * FF * H),
        3 * T * K * (2 * H * 2 * FF + 2 * FF * H),
    ),
    *[(f"fused_linear_{n}_loss", _HEAD, {}, _POLICY_FLOPS, 3 * _POLICY_FLOPS) for n in ("dpo", "orpo", "cpo", "simpo", "kto", "grpo")],
    # a reference head runs forward only: + 2·R·S·Hr·V in both modes
    (
        "fused_linear_dpo_loss",
        _HEAD,
        {"ref_hidden": _REF[0], "ref_weight": _REF[1]},
        _POLICY_FLOPS + 2 * R * S * Hr * V,
        3 * _POLICY_FLOPS + 2 * R * S * Hr * V,
    ),
    ("fused_linear_dpo_loss", (*_HEAD, None, *_REF), {}, _POLICY_FLOPS + 2 * R * S * Hr * V, 3 * _POLICY_FLOPS + 2 * R * S * Hr * V),
    (
        "fused_linear_kto_loss",
        (*_HEAD, e(R, dtype=torch.bool), None, *_REF),
        {},
        _POLICY_FLOPS + 2 * R * S * Hr * V,
        3 * _POLICY_FLOPS + 2 * R * S * Hr * V,
    ),
    (
        "fused_linear_kto_loss",
        (*_HEAD, e(R, dtype=torch.bool)),
        {"ref_hidden": _REF[0], "ref_weight": _REF[1]},
        _POLICY_FLOPS + 2 * R * S * Hr * V,
        3 * _POLICY_FLOPS + 2 * R * S * Hr * V,
    ),
]


@pytest.mark.parametrize("row", FLOPS, ids=[_id(r) for r in FLOPS])
def test_flops(row):
    name, args, kwargs, fwd, fwd_bwd = row
    flops = importlib.import_module(f"polykernel.ops.{name}").flops
    assert flops(*args, backward=False, **kwargs) == fwd
    assert flops(*args, backward=True, **kwargs) == fwd_bwd


def test_bench_rates_the_losses_by_the_op_files_flops():
    # bench's TFLOP/s for a preference loss comes from the op file's flops with the row's options:
    # DPO's reference head counts (it took the policy head's alone)
    from polykernel.tools import bench

    op = registry.get_op("fused_linear_dpo_loss")
    kwargs = {"ref_hidden": _REF[0], "ref_weight": _REF[1]}
    for mode, want in (("fwd", _POLICY_FLOPS + 2 * R * S * Hr * V), ("fwd+bwd", 3 * _POLICY_FLOPS + 2 * R * S * Hr * V)):
        row = {"mode": mode, "ms": 1.0}
        bench._perf(row, op, (R, S, H, V), _HEAD, kwargs, copy=1.0)
        assert row["TFLOP/s"] == pytest.approx(want / 1e-3 / 1e12)
        assert row["size"] == pytest.approx((_POLICY_FLOPS + 2 * R * S * Hr * V) / 1e9)
    # bench's own FLOP table for the fused linear heads agrees with the op files' (shape (N, H, V))
    for name in bench._FLOPS:
        flops = importlib.import_module(f"polykernel.ops.{name}").flops
        args = (e(M, H), e(V, H), e(M, H), e(V, H)) if name == "fused_linear_jsd" else (e(M, H), e(V, H))
        for backward in (False, True):
            assert bench._FLOPS[name](M, H, V, backward) == flops(*args, backward=backward)
