"""What the fused preference and RL losses' test files share (tests/ops/test_fused_linear_<loss>_loss.py,
tests/ops/test_preference_losses.py): small chunks, a random head and targets, and the float64
formulas written from TRL's and the papers' definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polykernel.backends import _linear_logps

IMPLS = ["torch", "triton"]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """About one unit per chunk at these sizes, so the walk takes several chunks (autouse in each
    module that imports it)."""
    monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", 2 * 7 * 97 * 6)
    monkeypatch.setattr(_linear_logps, "UNIT_BYTES", 0)  # a unit over the chunk budget: the two-pass walk


def token_logps(h, w, b, t, ignore=-100, temperature=1.0):
    z = h.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    lp = (z / temperature).log_softmax(-1)
    valid = t != ignore
    return torch.where(valid, lp.gather(-1, t.clamp(min=0)[..., None]).squeeze(-1), 0.0), valid


def head(r, t, h, v, *, bias=True, dtype=torch.float32):
    hid = torch.randn(r, t, h).to(dtype).requires_grad_()
    w = (torch.randn(v, h) * 2 / h**0.5).to(dtype).requires_grad_()
    b = (torch.randn(v) * 0.1).to(dtype).requires_grad_() if bias else None
    return hid, w, b


def targets(r, t, v, ignored=0.2):
    tg = torch.randint(0, v, (r, t))
    return tg.masked_fill(torch.rand(r, t) < ignored, -100)


def tol(dtype):
    return {torch.float32: (2e-5, 2e-4), torch.bfloat16: (2e-2, 5e-2), torch.float64: (1e-10, 1e-10)}[dtype]


def assert_grads(got, want, params, dtype):
    g1 = torch.autograd.grad(got, [p for p in params if p is not None])
    g2 = torch.autograd.grad(want, [p for p in params if p is not None])
    rtol, atol = tol(dtype)
    for a, b in zip(g1, g2):
        scale = b.abs().max().clamp(min=1e-30)
        torch.testing.assert_close(a.double() / scale, b.double() / scale, rtol=rtol, atol=atol)


def dpo_formula(h, w, b, t, *, ref=None, beta=0.1, average=False, nll=False):
    lp, valid = token_logps(h, w, b, t)
    seq = lp.sum(-1) / (valid.sum(-1) if average else 1)
    k = h.shape[0] // 2
    c, r = seq[:k], seq[k:]
    cr, rr = (0.0, 0.0) if ref is None else ref
    loss = -F.logsigmoid(beta * ((c - r) - (cr - rr))).mean()
    nll_loss = -lp[:k].sum() / valid[:k].sum()
    return (loss + nll_loss if nll else loss), c, r, beta * (c - cr), beta * (r - rr), nll_loss


def grpo_formula(h, w, b, ids, mask, adv, *, ref=None, old=None, beta=0.04, eps_low=0.2, eps_high=0.2, loss_type="grpo",
                 level="token", temperature=1.0, max_len=None, bias_correction=False):  # fmt: skip
    """TRL 1.16's GRPOTrainer._compute_loss, transcribed (float masks, products)."""
    lp, _ = token_logps(h, w, b, ids, ignore=-(10**9), temperature=temperature)
    m = mask.double()
    old = lp.detach() if old is None else old.double()
    log_ratio = lp - old
    if level == "token":
        liw = log_ratio
    else:
        liw = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    c1 = torch.exp(liw)
    c2 = torch.clamp(c1, 1 - eps_low, 1 + eps_high)
    a = adv.double().unsqueeze(1)
    ptl = -torch.min(c1 * a, c2 * a)
    if beta != 0.0:
        kl = torch.exp(ref.double() - lp) - (ref.double() - lp) - 1
        ptl = ptl + beta * (kl * c1 if bias_correction else kl)  # use_bias_correction_kl: the ratio, differentiable
    if loss_type == "grpo":
        return ((ptl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (ptl * m).sum() / m.sum().clamp(min=1.0)
    return (ptl * m).sum() / (ptl.size(0) * (max_len or ids.shape[1]))


def pair_seq(h, w, b, t, average):
    lp, valid = token_logps(h, w, b, t)
    seq = lp.sum(-1) / (valid.sum(-1) if average else 1)
    k = h.shape[0] // 2
    return seq[:k], seq[k:], -lp[:k].sum() / valid[:k].sum()


def orpo_formula(h, w, b, t, beta=0.1, nll=True):
    c, r, nll_loss = pair_seq(h, w, b, t, True)
    lo = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    loss = -beta * F.logsigmoid(lo).mean() + (nll_loss if nll else 0.0)
    return loss, c, r, beta * c, beta * r, nll_loss, F.logsigmoid(lo).mean(), lo.mean()


def cpo_formula(h, w, b, t, beta=0.1, alpha=1.0, eps=0.0, average=False):
    c, r, nll_loss = pair_seq(h, w, b, t, average)
    z = beta * (c - r)
    loss = (-(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)).mean() + alpha * nll_loss
    return loss, c, r, beta * c, beta * r, nll_loss


def simpo_formula(h, w, b, t, beta=2.0, gamma=0.5, eps=0.0):
    c, r, _ = pair_seq(h, w, b, t, True)
    z = beta * (c - r) - gamma
    return (-(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)).mean(), c, r, beta * c, beta * r


def kto_formula(h, w, b, t, labels, ref=None, kl=0.0, beta=0.1, average=False):
    lp, valid = token_logps(h, w, b, t)
    seq = lp.sum(-1) / (valid.sum(-1) if average else 1)
    logr = seq - (0.0 if ref is None else ref)
    loss = torch.where(labels, 1 - torch.sigmoid(beta * (logr - kl)), 1 - torch.sigmoid(beta * (kl - logr))).mean()
    return loss, seq[labels], seq[~labels], beta * logr[labels], beta * logr[~labels]
