"""Fused DPO and GRPO losses, forward+backward: polykernel (triton, torch) vs Liger's chunked
losses vs the TRL-style plain loss (full [N, V] logits, TRL's ``selective_log_softmax``).

Issue 22's shape (H200, bf16): DPO over 4 pairs of 1024 tokens and GRPO over 8 sequences of
1024 tokens (N = 2×4×1024 tokens), H = 2048, V = 128256. Per candidate: the median fwd+bwd time
(gradients of hidden and weight), the peak memory above what was allocated before the call
(CUDA only), the loss value (the candidates must agree).

    PYTHONPATH=src python benchmarks/kernels/preference_losses.py --json out.json          # H200
    PYTHONPATH=src python benchmarks/kernels/preference_losses.py --tiny --json out.json   # CPU smoke
    ... --chunk-mib 512 --only triton    # a smaller budget: below one pair, the two-pass token walk
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

# each candidate is timed by name; Liger's NaN fields (statistics it does not report) would fail
# the first-use verification, and the loss values below are compared across candidates instead
os.environ.setdefault("POLYKERNEL_VERIFY", "off")

import polykernel
from polykernel.tools.rows import RowFile, announce

try:
    from trl.trainer.utils import selective_log_softmax
except ImportError:  # TRL not installed: its naive equivalent

    def selective_log_softmax(logits, index):
        return logits.log_softmax(-1).gather(-1, index[..., None]).squeeze(-1)


def plain_logps(hidden, weight, target, ignore_index=-100):
    """TRL's way: the whole [R, T, V] logits in the inputs' dtype, then log-softmax + gather."""
    logits = hidden @ weight.T
    valid = target != ignore_index
    lp = selective_log_softmax(logits.float(), torch.where(valid, target, 0))
    return torch.where(valid, lp, 0.0)


def plain_dpo(hidden, weight, target, beta=0.1):
    seq = plain_logps(hidden, weight, target).sum(-1)
    b = hidden.shape[0] // 2
    return -F.logsigmoid(beta * (seq[:b] - seq[b:])).mean()


def plain_grpo(hidden, weight, ids, mask, adv, ref, old, beta=0.04, eps=0.2):
    lp = plain_logps(hidden, weight, ids)
    coef_1 = torch.exp(lp - old)
    coef_2 = coef_1.clamp(1 - eps, 1 + eps)
    a = adv[:, None]
    ptl = -torch.min(coef_1 * a, coef_2 * a) + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    m = mask.float()
    return ((ptl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def measure(fn, params, device, reps):
    """(median ms of fwd+bwd, peak extra MiB or None, loss value)."""

    def step():
        loss = fn()
        loss = loss[0] if isinstance(loss, tuple) else loss
        torch.autograd.grad(loss, params)
        return loss

    cuda = device.type == "cuda"
    loss = step()  # warm-up (compiles, autotunes)
    step()
    times = []
    peak = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), peak, float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes (a smoke test)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", default="", help="comma-separated candidate names to run (default: all)")
    ap.add_argument("--chunk-mib", type=int, help="polykernel's chunk budget (default: _linear_logps.CHUNK_BYTES, 1 GiB)")
    args = ap.parse_args()
    if args.chunk_mib:
        from polykernel.backends import _linear_logps

        _linear_logps.CHUNK_BYTES = args.chunk_mib << 20
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pairs, t, h, v = (2, 16, 32, 1000) if args.tiny else (4, 1024, 2048, 128256)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reps = 2 if args.tiny else args.reps
    torch.manual_seed(0)
    w = (torch.randn(v, h, device=device) / h**0.5).to(dtype).requires_grad_()
    out = RowFile(args.json)  # {"complete": ..., "rows": [...]}, rewritten per row: a cut run keeps its rows
    announce(2 * 4, 10 + reps * 0.5, "rows", args.json)  # dpo, grpo x (triton, torch, liger, trl): first calls + reps

    def run(loss, name, fn, params, shape):
        if args.only and name not in args.only.split(","):
            return
        try:
            ms, peak, value = measure(fn, params, device, reps)
            row = {"loss": loss, "impl": name, "shape": shape, "dtype": str(dtype), "ms": ms, "peak_extra_mib": peak, "loss_value": value}
        except Exception as exc:  # one failing candidate must not hide the others
            row = {"loss": loss, "impl": name, "shape": shape, "dtype": str(dtype), "error": f"{type(exc).__name__}: {exc}"[:300]}
        row["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        out.add(row, json.dumps(row))

    # DPO: [chosen 4; rejected 4] x 1024 tokens, ~10% of them (the prompt) ignored
    hid = torch.randn(2 * pairs, t, h, device=device).to(dtype).requires_grad_()
    tgt = torch.randint(0, v, (2 * pairs, t), device=device)
    tgt[:, : t // 10] = -100
    shape = f"R={2 * pairs},T={t},H={h},V={v}"
    for impl in ("triton", "torch", "liger"):
        if impl == "triton" and device.type != "cuda" and not args.tiny:
            continue
        run("dpo", impl, lambda impl=impl: polykernel.fused_linear_dpo_loss(hid, w, tgt, impl=impl), (hid, w), shape)
    run("dpo", "trl-plain", lambda: plain_dpo(hid, w, tgt), (hid, w), shape)

    # GRPO: 8 completions x 1024 tokens, old and reference log-probs given, beta = 0.04
    b = 2 * pairs
    hid_g = torch.randn(b, t, h, device=device).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (b, t), device=device)
    mask = (torch.rand(b, t, device=device) > 0.1).long()
    adv = torch.randn(b, device=device)
    with torch.no_grad():
        lp = plain_logps(hid_g, w, ids).float()
    old, ref = lp + 0.05 * torch.randn_like(lp), lp + 0.05 * torch.randn_like(lp)
    del lp
    shape = f"B={b},T={t},H={h},V={v}"
    for impl in ("triton", "torch", "liger"):
        run("grpo", impl, lambda impl=impl: polykernel.fused_linear_grpo_loss(hid_g, w, ids, mask, adv, ref_per_token_logps=ref,
                                                                             old_per_token_logps=old, impl=impl), (hid_g, w), shape)  # fmt: skip
    run("grpo", "trl-plain", lambda: plain_grpo(hid_g, w, ids, mask, adv, ref, old), (hid_g, w), shape)
    out.finish()


if __name__ == "__main__":
    main()
