"""Liger-Kernel's chunked preference and RL losses (``liger_kernel.chunked_loss``, 0.8.5) on the
signatures of ``polykernel.fused_linear_{dpo,orpo,cpo,simpo,grpo}_loss``.

Liger computes the same losses (checked against our float64 references in
``tests/backends/test_liger_preference.py``), with these differences, which the adapters keep
visible rather than paper over:

- its logits are the inputs' dtype (``input @ weight.T``) upcast to fp32 for the log-softmax,
  ours are fp32 GEMM outputs: in bf16 its log-probs carry the logits' bf16 rounding;
- it returns the NLL only when it adds it to the loss: ``nll_loss`` is NaN otherwise (DPO without
  ``compute_nll_loss``, CPO with ``alpha = 0``);
- DPO: no precomputed reference log-probs (``ref_chosen_logps``) — refused;
- GRPO: it reports the region clip ratio only (``clip_ratio_low``/``_high`` are NaN), and
  token-weighted also for sequence-level importance sampling, where the op's (TRL's) is the mean
  over sequences: with ``importance_sampling_level="sequence"`` ``clip_ratio_region`` is NaN too;
  ``"dapo"`` is handed to Liger as its ``"bnpo"`` (the same loss): Liger's own ``"dapo"``
  all-reduces the mask sum and divides by the world size when torch.distributed is initialised
  (a collective inside the loss; the op divides by this call's masked count);
- KTO: its statistics are batch sums, not KTOOutput's per-sequence values — no adapter.

``compiled=`` (Liger's torch.compile of its per-chunk function) is on for CUDA inputs, as Liger's
default, and off elsewhere. Liger processes one pair (one sequence for GRPO) per chunk.
"""

from __future__ import annotations

import torch
from liger_kernel.chunked_loss.cpo_loss import LigerFusedLinearCPOFunction
from liger_kernel.chunked_loss.dpo_loss import LigerFusedLinearDPOFunction
from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction
from liger_kernel.chunked_loss.orpo_loss import LigerFusedLinearORPOFunction
from liger_kernel.chunked_loss.simpo_loss import LigerFusedLinearSimPOFunction

from ...errors import ImplNotAvailableError
from ...ops.fused_linear_cpo_loss import CPOOutput
from ...ops.fused_linear_dpo_loss import DPOOutput
from ...ops.fused_linear_grpo_loss import GRPOMetrics, GRPOOutput
from ...ops.fused_linear_orpo_loss import ORPOOutput
from ...ops.fused_linear_simpo_loss import SimPOOutput
from .._double_backward import refusing

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_FusedLinearDPO = refusing(LigerFusedLinearDPOFunction, "loss.fused_linear_dpo_loss", "liger", (0, 1, 3), kept=False)
_FusedLinearORPO = refusing(LigerFusedLinearORPOFunction, "loss.fused_linear_orpo_loss", "liger", (0, 1, 3), kept=False)
_FusedLinearCPO = refusing(LigerFusedLinearCPOFunction, "loss.fused_linear_cpo_loss", "liger", (0, 1, 3), kept=False)
_FusedLinearSimPO = refusing(LigerFusedLinearSimPOFunction, "loss.fused_linear_simpo_loss", "liger", (0, 1, 3), kept=False)
_FusedLinearGRPO = refusing(LigerFusedLinearGRPOFunction, "loss.fused_linear_grpo_loss", "liger", (0, 1, 5), kept=False)


def _nan(like: torch.Tensor) -> torch.Tensor:
    return torch.full((), float("nan"), dtype=torch.float32, device=like.device)


def dpo(hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_chosen_logps, ref_rejected_logps, beta, ignore_index,
        average_log_prob, compute_nll_loss) -> DPOOutput:  # fmt: skip
    if ref_chosen_logps is not None:
        raise ImplNotAvailableError(
            "loss.fused_linear_dpo_loss", "liger", "Liger's DPO takes no precomputed reference log-probs", ["torch", "triton"]
        )
    use_ref = ref_hidden is not None
    loss, (c, r, _, _, nll, cr, rr) = _FusedLinearDPO.apply(
        hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ignore_index, beta, compute_nll_loss, hidden.is_cuda,
        use_ref, average_log_prob, 1, "sigmoid", 0.0, 0.05, 1.0,
    )  # fmt: skip
    return DPOOutput(loss, c, r, cr, rr, nll if compute_nll_loss else _nan(loss))


def orpo(hidden, weight, target, bias, beta, ignore_index, compute_nll_loss) -> ORPOOutput:
    loss, (c, r, _, _, nll, cr, rr, lor, loc) = _FusedLinearORPO.apply(
        hidden, weight, target, bias, ignore_index, beta, compute_nll_loss, None, hidden.is_cuda, 1
    )
    return ORPOOutput(loss, c, r, cr, rr, nll if compute_nll_loss else _nan(loss), lor, loc)


def cpo(hidden, weight, target, bias, beta, alpha, label_smoothing, ignore_index, average_log_prob) -> CPOOutput:
    nll_on = alpha != 0.0
    loss, (c, r, _, _, nll, cr, rr) = _FusedLinearCPO.apply(
        hidden, weight, target, bias, ignore_index, beta, alpha, label_smoothing, nll_on, hidden.is_cuda, average_log_prob, 1
    )
    return CPOOutput(loss, c, r, cr, rr, nll if nll_on else _nan(loss))


def simpo(hidden, weight, target, bias, beta, gamma, label_smoothing, ignore_index) -> SimPOOutput:
    loss, (c, r, _, _, _, cr, rr) = _FusedLinearSimPO.apply(
        hidden, weight, target, bias, ignore_index, beta, 1.0, label_smoothing, False, hidden.is_cuda, gamma, 1
    )
    return SimPOOutput(loss, c, r, cr, rr)


def grpo(hidden, weight, ids, mask, advantages, bias, ref, old, beta, eps_low, eps_high, loss_type, level, temperature,
         max_completion_length) -> GRPOOutput:  # fmt: skip
    m = (mask != 0).to(torch.float32)
    max_len = ids.shape[1] if max_completion_length is None else max_completion_length
    # the op's "dapo" is this call's masked token mean: Liger's "bnpo" (its "dapo" all-reduces the
    # count across ranks under torch.distributed: chunked_loss/fused_linear_ppo._compute_dapo_normalizer)
    liger_type = "bnpo" if loss_type == "dapo" else loss_type
    loss, metrics = _FusedLinearGRPO.apply(
        hidden, weight, ids, m, advantages, bias, ref, old, None, None, None, beta, eps_low, eps_high, liger_type, max_len, level,
        1.0, 1.05, temperature, hidden.is_cuda, ref is not None, 1,  # use_ref_model: Liger reads ref only then
    )  # fmt: skip
    kl, clip = (metrics[0], metrics[1]) if beta != 0.0 else (None, metrics[0])
    if level == "sequence":  # Liger's is token-weighted; the op's a mean over sequences
        clip = _nan(loss)
    return GRPOOutput(loss, GRPOMetrics(kl, _nan(loss), _nan(loss), clip))


# -- the registered impls, on the ops' positional arguments (validated by the public functions) ----


def fused_linear_dpo_loss(hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_chosen_logps, ref_rejected_logps, beta,
                          ignore_index, average_log_prob, compute_nll_loss) -> DPOOutput:  # fmt: skip
    return dpo(hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_chosen_logps, ref_rejected_logps, float(beta),
               ignore_index, average_log_prob, compute_nll_loss)  # fmt: skip


def fused_linear_orpo_loss(hidden, weight, target, bias, beta, ignore_index, compute_nll_loss) -> ORPOOutput:
    return orpo(hidden, weight, target, bias, float(beta), ignore_index, compute_nll_loss)


def fused_linear_cpo_loss(hidden, weight, target, bias, beta, alpha, label_smoothing, ignore_index, average_log_prob) -> CPOOutput:
    return cpo(hidden, weight, target, bias, float(beta), float(alpha), float(label_smoothing), ignore_index, average_log_prob)


def fused_linear_simpo_loss(hidden, weight, target, bias, beta, gamma, label_smoothing, ignore_index) -> SimPOOutput:
    return simpo(hidden, weight, target, bias, float(beta), float(gamma), float(label_smoothing), ignore_index)


def fused_linear_grpo_loss(hidden, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
                           old_per_token_logps, beta, epsilon_low, epsilon_high, loss_type, importance_sampling_level, temperature,
                           max_completion_length, use_bias_correction_kl=False) -> GRPOOutput:  # fmt: skip
    if use_bias_correction_kl and beta != 0.0:  # (the op's predicate refuses it first)
        raise ImplNotAvailableError(
            "loss.fused_linear_grpo_loss", "liger", "Liger's GRPO has no importance-weighted KL", ["torch", "triton"]
        )
    return grpo(hidden, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps, old_per_token_logps,
                float(beta), float(epsilon_low), float(epsilon_high), loss_type, importance_sampling_level, float(temperature),
                max_completion_length)  # fmt: skip
