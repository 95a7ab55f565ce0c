"""The error model of the fused preference and RL losses (``fused_linear_{dpo,orpo,cpo,simpo,kto,grpo}_loss``):
each op file's ``error_model = error_model_for(reference, ...)``. Apart from :mod:`._preference` (the
losses' shared checks, reference and cases), which it reads."""

from __future__ import annotations

import math
from typing import Any

import torch

from . import _preference, _preference_reference
from ._preference import _capture, keeps_g, reference_token_logps, sequence_logps, units_per_chunk

# Every loss is a formula of the per-token log-probs logp = z[t] − lse(z), z = (h·W + b)/temperature
# an fp32 GEMM result of the inputs' values: off by δ <= λ·√H·u32 of Σ_k |h_k·W_k| (<= ‖h‖·‖W_v‖,
# Cauchy-Schwarz), so logp is off by ε <= 2δ/t + 4·u32·(|z| + |lse|). The loss moves by
# Σ_t |∂L/∂logp_t|·ε (first order; g = ∂L/∂logp from the float64 reference by autograd) plus its
# own fp32 arithmetic on terms of magnitude A = Σ_t |g_t|·(|logp_t| + 1). A per-sequence statistic
# is a sum of up to T log-probs (T·ε + λ·√T·u32 of their magnitude), times its gain (β for the
# rewards); a mean over its n scored tokens (ORPO's, ``average``) divides the n·ε and the sum's
# error by n: ε + (λ·√T + 1)·u32 of the largest |logp| + 1 (T: the sum's length, kept for its order). Backward: dz = g/t·(onehot − softmax) is off by ε relative (softmax) plus g's own
# error (its slope through the formula: β·margin's error, a ratio's log-probs' error), rounded
# to the inputs' dtype; dH = dz·W sums over V (scale max|W|·max_t Σ_v|dz|), dW = dzᵀ·h over the
# rows (max|h|·max_v Σ_t|dz|, accumulated in the weight's dtype once per chunk), db = Σ_t dz.
# A unit (up to a pair of rows) over the chunk budget keeps G = softmax − onehot rounded to the
# inputs' dtype and puts s = g/t on the [rows, H] side after (dW = Gᵀ·(s·h), dH = s·(G·W), db =
# Gᵀ·s): one more rounding of each gradient, relative (dH, db's outputs) or through the sum (s·h,
# db's rounded s), so `rounds` and `rounds_abs` + 1 when a pair might be over it; G's subnormal
# floor is then scaled by s (up to s_max = max|g|/t) and s·h's is not (+1 on the floor's scale).


def error_bounds(reference: Any, args: tuple, kwargs: dict, *, grads: dict[str, int], beta: float = 1.0, gain: float = 1.0,
                 temperature: float = 1.0, average: bool = False) -> Any:  # fmt: skip
    """The op's :class:`~polykernel.core.op.Bounds` for one call (see the comment above):
    ``grads`` maps hidden/weight/bias to their positions; ``gain``: the statistics' largest
    slope in the sequences' log-probs; ``average``: the statistics are the sequences' mean
    log-probs (every call), not their sums."""
    from ..core.op import SUM_LAMBDA, TINY, Bounds, ErrorModel

    hidden, weight = args[grads["hidden"]], args[grads["weight"]]
    bias = args[grads["bias"]] if len(args) > grads["bias"] else kwargs.get("bias")
    # leaves in the call's dtypes: the reference computes in float64 from them (exact conversions),
    # a block at a time, so no float64 copy of a [V, H] weight is made
    leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    _capture.append([])
    try:
        with torch.enable_grad():
            out = reference(*leaves, **kwargs)
    finally:
        got = _capture.pop()
    loss = out[0]
    r, t, h = hidden.shape
    u32 = 2.0**-24
    hd = hidden.detach().double()
    h_norm = hd.norm(dim=-1).max().item() if hd.numel() else 0.0
    w_norm, w_max = _row_norm_and_max(weight.detach())
    b_max = bias.detach().abs().max().item() if bias is not None and bias.numel() else 0.0
    delta = SUM_LAMBDA * h**0.5 * (h_norm * w_norm + b_max) * u32
    eps = tok = 0.0
    g_abs = a_mag = s_max = 0.0
    dz_row = dz_col_max = 0.0
    if got and loss.requires_grad:
        entry = got[-1]
        (gl,) = torch.autograd.grad(loss, [entry["logps"]], materialize_grads=True)
        eps = 2 * delta / temperature + 4 * u32 * (entry["z_max"] + entry["lse_max"])
        g = gl.detach()
        lpd = entry["logps"].detach()
        g_abs = g.abs().sum().item()
        s_max = g.abs().amax().item() / temperature if g.numel() else 0.0
        a_mag = (g.abs() * (lpd.abs() + 1)).sum().item()
        tok = lpd.abs().amax().item() if lpd.numel() else 0.0
        dz_row, dz_col_max = _preference_reference.dlogit_magnitudes(entry, g)
    lam_t = SUM_LAMBDA * max(t, 1) ** 0.5
    loss_err = 2 * g_abs * eps + (8 + lam_t) * u32 * a_mag
    seq_err = eps + (lam_t + 1) * u32 * (tok + 1) if average else t * eps + lam_t * u32 * t * (tok + 1)
    loss_model = ErrorModel(rounds=1, ops=8, cancel=loss_err / u32, scale=1.0)
    stat = ErrorModel(rounds=1, ops=8, cancel=gain * seq_err / u32, scale=1.0)
    budget = _preference.CHUNK_BYTES  # read per call, as the driver reads its own: tests shrink both
    v, elt, sub = weight.shape[0], hidden.element_size(), _preference.SUB_BYTES
    chunks = max(1, r // units_per_chunk(r, 1, t, v, elt, budget))  # the chunking's rounds of dW
    # the kept-G walk's rounding, where it may run (pairs or sequences)
    kept = int(keeps_g(max(r // 2, 1), 2, t, v, elt, budget, sub) or keeps_g(r, 1, t, v, elt, budget, sub))
    # g's own error: a sigmoid of β·margin moves its slope by at most β per unit of margin (two
    # sequences per margin); GRPO's ratios and KL move by at most their log-probs' error (`beta`
    # is then 0: no margin)
    slope = 2 * float(beta) * seq_err + 2 * eps
    tiny = TINY.get(hidden.dtype, 0.0)

    def grad(rounds: float, d: float, w_max: float, terms: int, inter: torch.dtype) -> ErrorModel:
        fl = w_max * (1 + s_max) + 1 if kept else w_max
        return ErrorModel(rounds=rounds + kept, ops=4, rounds_abs=2 + kept, cancel=8 + slope / u32, sum_abs=1, n=max(terms, 1),
                          scale=w_max * d, inter=inter, floor=SUM_LAMBDA * terms**0.5 * tiny * fl + kept * tiny * s_max)  # fmt: skip

    h_max = hd.abs().max().item() if hd.numel() else 0.0
    bounds = {grads["hidden"]: grad(2, dz_row, w_max, weight.shape[0], hidden.dtype),
              grads["weight"]: grad(chunks + 1, dz_col_max, h_max, r * t, hidden.dtype)}  # fmt: skip
    if bias is not None:
        bounds[grads["bias"]] = grad(2, dz_col_max, 1.0, r * t, hidden.dtype)
    return Bounds(outputs=(loss_model, stat), grads=bounds)


def _row_norm_and_max(weight: torch.Tensor) -> tuple[float, float]:
    """The largest row norm and the largest magnitude of ``weight``, in float64 a block of rows at
    a time (no float64 copy of a [V, H] head)."""
    norm = top = 0.0
    step = _preference_reference.REFERENCE_VOCAB_BLOCK
    for s in range(0, weight.shape[0], step):
        block = weight[s : s + step].double()
        if block.numel():
            norm = max(norm, block.norm(dim=-1).max().item())
            top = max(top, block.abs().max().item())
    return norm, top


def error_model_for(reference: Any, grads: dict[str, int], *, beta: str | None = "beta", gain: Any = None, curv: Any = None,
                    average: bool = False) -> Any:  # fmt: skip
    """``Op(error_model=)``: :func:`error_bounds` with the call's ``beta`` (how fast the formula's
    slope moves with a margin; ``curv(arguments)`` instead where given, None: no margin), the
    statistics' ``gain(arguments)`` (default max(1, β)) and ``average`` (the loss always takes
    the sequences' mean log-probs: ORPO)."""
    import inspect

    sig = inspect.signature(reference)

    def error_model(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        b = float(a[beta]) if beta is not None else 0.0
        g = gain(a) if gain is not None else max(1.0, b)
        c = curv(a) if curv is not None else b
        return error_bounds(reference, args, kwargs, grads=grads, beta=c, gain=g, temperature=float(a.get("temperature", 1.0)),
                            average=average)  # fmt: skip

    return error_model


def orpo_curv(arguments: dict) -> float:
    """ORPO's loss, β·logσ(log-odds ratio): its slope in a sequence's average log-prob moves with
    it by up to β·(the log-odds' slope)² + the log-odds' own curvature, both within orpo_gain²."""
    return float(arguments["beta"]) * orpo_gain(arguments) ** 2 / max(2.0, float(arguments["beta"])) ** 2 + orpo_gain(arguments)


def orpo_gain(arguments: dict) -> float:
    """ORPO's statistics: log-odds ``c − log(1 − e^c)`` have slope ``1/(1 − e^c)``; with the
    rewards' β. Bounded from the float64 average log-probs (at least 2)."""
    with torch.no_grad():
        lp = reference_token_logps(arguments["hidden"].detach(), arguments["weight"].detach(),
                                   None if arguments["bias"] is None else arguments["bias"].detach(), arguments["target"],
                                   arguments["ignore_index"])  # fmt: skip
        mask = arguments["target"] != arguments["ignore_index"]
        seq = sequence_logps(lp, mask, True).nan_to_num(nan=-1.0)
        top = seq.max().item() if seq.numel() else -1.0
    return max(2.0, float(arguments["beta"])) * (1.0 + 1.0 / max(-math.expm1(top), 1e-12))
