"""Op-specific mutants: an op's reference with ONE realistic bug each (benchmarks/parity_power.py,
tests/core/test_parity_power.py). Each takes the reference's positional arguments, as an impl."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polykernel.ops import cross_entropy, geglu, layer_norm, moe_router, rms_norm, rope, swiglu
from polykernel.ops import fused_add_rms_norm as farn


def _rms(x, weight, eps=1e-6, offset=0.0, casting="fp32", *, outside=False, low=False):
    """rms_norm with eps added outside the sqrt (``outside``) or the mean of squares in x's dtype (``low``)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    ms = x.pow(2).mean(-1, keepdim=True).to(acc) if low else xf.pow(2).mean(-1, keepdim=True)
    xhat = xf / (ms.sqrt() + eps) if outside else xf * torch.rsqrt(ms + eps)
    if casting == "llama":
        xhat = xhat.to(x.dtype).to(acc)
    return (xhat * (weight.to(acc) + offset)).to(x.dtype)


def _ln(x, weight=None, bias=None, eps=1e-5, *, low=False):
    """layer_norm with the variance in x's dtype (``low``)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    xc = xf - xf.mean(-1, keepdim=True)
    var = xc.to(x.dtype).pow(2).mean(-1, keepdim=True).to(acc) if low else xc.pow(2).mean(-1, keepdim=True)
    y = xc * torch.rsqrt(var + eps)
    y = y if weight is None else y * weight.to(acc)
    return (y if bias is None else y + bias.to(acc)).to(x.dtype)


def _ce_denominator(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", weight=None, softcap=None, z_loss=0.0):
    """The mean over every row, ignored ones included."""
    out = cross_entropy.reference(logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss)
    if reduction != "mean" or weight is not None:
        return out
    t = target.reshape(-1)
    return out * (t != ignore_index).sum() / max(t.numel(), 1)


def _ce_softcap_twice(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", weight=None, softcap=None, z_loss=0.0):
    if softcap is not None:
        logits = (softcap * torch.tanh(logits.float() / softcap)).to(logits.dtype)
    return cross_entropy.reference(logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss)


def _ce_smoothing(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", weight=None, softcap=None, z_loss=0.0):
    """The uniform term spread over V - 1 classes instead of V: ε·V/(V-1)."""
    v = logits.shape[-1]
    eps = min(1.0, label_smoothing * v / (v - 1)) if v > 1 else label_smoothing
    return cross_entropy.reference(logits, target, ignore_index, eps, reduction, weight, softcap, z_loss)


def _ce_low(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", weight=None, softcap=None, z_loss=0.0):
    """The log-softmax in the logits' dtype (bf16), not fp32."""
    if logits.dtype == torch.float32 or weight is not None or softcap is not None or z_loss:
        return cross_entropy.reference(logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss)
    v = logits.shape[-1]
    t = target.reshape(-1).long()
    x = torch.where((t != ignore_index)[:, None], logits.reshape(-1, v), 0.0)
    lp = torch.log_softmax(x, -1).float()  # bf16 log-softmax
    out = F.nll_loss(lp, t, ignore_index=ignore_index, reduction=reduction)
    if label_smoothing:
        smooth = torch.where(t != ignore_index, -lp.mean(-1), 0.0)
        smooth = smooth if reduction == "none" else smooth.sum() / ((t != ignore_index).sum() if reduction == "mean" else 1)
        out = (1 - label_smoothing) * out + label_smoothing * smooth
    return out.reshape(target.shape) if reduction == "none" else out


def _rope_swap(q, k, cos, sin, rotary_dim=None, interleaved=False):
    return rope.reference(q, k, cos, sin, rotary_dim, not interleaved)


def _moe_router_topk_softmax(logits, top_k, renormalize=True):
    """Softmax over the top-k logits only: equal to softmax-gather-renormalize (not a bug then)."""
    if not renormalize:
        return moe_router.reference(logits, top_k, renormalize)
    acc = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(acc)
    index = torch.sort(x.detach(), dim=-1, descending=True, stable=True).indices[..., :top_k]
    return torch.softmax(x.gather(-1, index), -1).to(logits.dtype), index


MUTANTS: dict = {
    "norm.rms_norm": {
        "eps outside sqrt": lambda x, w, eps, offset, casting: _rms(x, w, eps, offset, casting, outside=True),
        "eps x10": lambda x, w, eps, offset, casting: rms_norm.reference(x, w, eps * 10, offset, casting),
        "eps ignored": lambda x, w, eps, offset, casting: rms_norm.reference(x, w, 0.0, offset, casting),
        "offset dropped": lambda x, w, eps, offset, casting: rms_norm.reference(x, w, eps, 0.0, casting),
        "llama casting ignored": lambda x, w, eps, offset, casting: rms_norm.reference(x, w, eps, offset, "fp32"),
        "mean of squares in x dtype": lambda x, w, eps, offset, casting: _rms(x, w, eps, offset, casting, low=True),
    },
    "norm.fused_add_rms_norm": {
        "eps x10": lambda x, r, w, eps, offset: farn.reference(x, r, w, eps * 10, offset),
        "offset dropped": lambda x, r, w, eps, offset: farn.reference(x, r, w, eps, 0.0),
        "residual not added": lambda x, r, w, eps, offset: (farn.reference(x, r * 0, w, eps, offset)[0], x + r),
        "sum kept fp32 (unrounded)": lambda x, r, w, eps, offset: (
            rms_norm.reference(x.float() + r.float(), w, eps, offset, "fp32").to(x.dtype),
            x + r,
        ),
    },
    "norm.layer_norm": {
        "bias dropped": lambda x, w, b, eps: layer_norm.reference(x, w, None, eps),
        "weight dropped": lambda x, w, b, eps: layer_norm.reference(x, None, b, eps),
        "eps x10": lambda x, w, b, eps: layer_norm.reference(x, w, b, eps * 10),
        "eps ignored": lambda x, w, b, eps: layer_norm.reference(x, w, b, 0.0),
        "variance in x dtype": lambda x, w, b, eps: _ln(x, w, b, eps, low=True),
    },
    "activation.swiglu": {"gate/up swapped": lambda g, u: swiglu.reference(u, g)},
    "activation.geglu": {
        "gate/up swapped": lambda g, u, a: geglu.reference(u, g, a),
        "approximate ignored": lambda g, u, a: geglu.reference(g, u, "none" if a == "tanh" else "tanh"),
    },
    "activation.softmax": {"softmax in x dtype": lambda x: torch.softmax(x, -1)},
    "loss.cross_entropy": {
        "ignored rows in mean denominator": _ce_denominator,
        "z_loss dropped": lambda lg, t, ii, ls, red, w, sc, z: cross_entropy.reference(lg, t, ii, ls, red, w, sc, 0.0),
        "softcap twice": _ce_softcap_twice,
        "softcap ignored": lambda lg, t, ii, ls, red, w, sc, z: cross_entropy.reference(lg, t, ii, ls, red, w, None, z),
        "smoothing over V-1": _ce_smoothing,
        "log-softmax in bf16": _ce_low,
    },
    "embedding.rope": {
        "neox/gptj swapped": _rope_swap,
        "sin negated": lambda q, k, c, s, rd, il: rope.reference(q, k, c, -s, rd, il),
    },
    "moe.moe_router": {
        "renormalize ignored": lambda lg, k, rn: moe_router.reference(lg, k, False),
        "softmax over top-k (equivalent)": _moe_router_topk_softmax,
    },
}


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the gradient by ``s``."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


def grad_scaled(ref, i: int, s: float):
    """``ref`` with the gradient of its argument ``i`` scaled by ``s`` (one gradient wrong)."""

    def impl(*args):
        args = list(args)
        if isinstance(args[i], torch.Tensor) and args[i].requires_grad:
            args[i] = _ScaleGrad.apply(args[i], s)
        return ref(*args)

    return impl


def out_scaled(ref, s: float):
    """``ref`` with its (first) output scaled by ``s``."""

    def impl(*args):
        out = ref(*args)
        return (out[0] * s, *out[1:]) if isinstance(out, tuple) else out * s

    return impl
