"""The post-training losses, forward+backward (issue 35, table 2): polykernel (its own choice,
``impl="triton"``, ``impl="torch"``) vs Liger called as its users call it (its own modules with
their defaults, not through polykernel: ``_liger_losses.py``) vs the plain loss (the whole [N, V]
logits in torch, TRL-style: ``_plain_losses.py``).

Losses: dpo, orpo, cpo, simpo, kto, grpo (N = 8×1024 tokens, H = 2048, V = 128256), then kl_div,
jsd, tvd ([8192, 128256]) and fused_linear_jsd (N = 8192, H = 2048, V = 128256): the ten main rows,
first. Then the cross-entropy options, one a loss: ce_softcap, ce_z_loss, ce_weight,
ce_label_smoothing (cross_entropy over [8192, 128256] logits) and the same four flce_* losses
(fused_linear_cross_entropy, N = 8192, H = 2048, V = 128256); bf16 on CUDA (``_loss_cases.py`` has
the shapes and the option values). Per row: the median fwd+bwd time (gradients of the inputs
that take one), the peak memory above what was allocated before the call (CUDA only), the loss
value, and ``agrees``: within 2% of polykernel's torch impl (``rel_diff``). Each row is printed
and written as it is measured (a run cut at its limit keeps its rows; ``--only`` runs the rest).
On a CPU without ``--tiny`` the triton rows are skipped; Liger's rows say why they did not run (no
CUDA: its defaults compile with torch.compile and launch Triton GPU kernels; or Liger is not
installed). Liger's cross_entropy writes its gradient over its logits: its ce_* rows get a seeded
copy of their own (made before the timing, so its peak counts no [N, V] gradient: Liger's own
saving), and its timed calls after the first read the previous call's gradient (the same work).

    PYTHONPATH=src python benchmarks/kernels/post_training_losses.py --json out.json           # H200
    PYTHONPATH=src python benchmarks/kernels/post_training_losses.py --tiny --json out.json    # CPU smoke
    ... --only dpo,kl_div --impls torch,liger     # some losses, some candidates
    ... --only ce_softcap,flce_weight             # some CE options (e.g. what a cut run missed)
    ... --tiny --liger-on-cpu    # CPU: Liger too (chunked losses uncompiled; its kernels in Triton's interpreter)
    ... --chunk-mib 512          # polykernel's chunk budget (default: _linear_logps.CHUNK_BYTES, 1 GiB)
    ... --only flce_z_loss --flce-chunk-mib 128   # fused_linear_cross_entropy's (default: 256 MiB of logits)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

# polykernel's first-use verification (a float64 reference of the op at these shapes) would weigh
# on the first calls; the loss values are compared across the candidates below instead
os.environ.setdefault("POLYKERNEL_VERIFY", "off")
if "--tiny" in sys.argv and not torch.cuda.is_available():  # CPU smoke: the triton impls in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before Triton's first import: it fixes the mode)

from _liger_losses import liger_call, overwrites_input
from _loss_cases import CE_OPTION_LOSSES, FULL, LOSSES, OPTION_VALUES, PREFERENCE, TINY, inputs, plain_call, polykernel_call

import polykernel
from polykernel.tools.bench import peak_extra_mib
from polykernel.tools.options import positive_int
from polykernel.tools.rows import RowFile, announce

IMPLS = ("auto", "triton", "torch", "liger", "plain")  # auto: polykernel's public function, impl=None
# (five steps a row, auto's first: a difference of ~0.3 ms between auto and the impl it ran is this
# order, not the dispatch; auto_vs_forced.py alternates the two: h100-2026-12-06-twentysecond/losses/)
RTOL = 2e-2  # loose: bf16 logits (Liger's, the plain loss's) against polykernel's fp32 GEMM outputs
# H200 seconds a row (inputs, first calls and their Triton compiles, 8 fwd+bwd steps): the ten
# losses' 50 rows took 64 s on 2026-12-04 (sixth run, after the part's GPU tests), Liger's six
# torch.compiles included (LIGER_COMPILE_S; on a cold cache, through our adapter on the fourth run,
# ORPO's took 19.9 s). The CE options: a Triton compile for each option, polykernel's and Liger's
# (their flags are constexpr), and the plain loss's passes over the fp32 [N, V] logits
ROW_S = {loss: 2.0 if loss in CE_OPTION_LOSSES else 1.0 for loss in LOSSES}
LIGER_COMPILE_S = 3.0


def measure(fn, params, device, reps):
    """(median ms of fwd+bwd, peak extra MiB or None, loss value)."""

    def step():
        loss = fn()
        loss = loss[0] if isinstance(loss, tuple) else loss  # polykernel's NamedTuples, Liger's (loss, aux)
        torch.autograd.grad(loss, params)
        return loss

    cuda = device.type == "cuda"
    loss = step()  # warm-up (compiles, autotunes)
    if cuda:  # a second for what the first left (the CPU's smoke run: one, its calls interpreted)
        step()
    times = []
    peak = None
    if cuda:
        torch.cuda.empty_cache()
        peak = peak_extra_mib(step)
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


def candidate(
    loss: str, impl: str, x: SimpleNamespace, args: argparse.Namespace, device: torch.device, own_inputs: Callable[[], SimpleNamespace]
) -> str | tuple[Callable[[], object], tuple[torch.Tensor, ...]]:
    """(the call to time, the tensors it differentiates), or the reason it does not run here (a
    string). ``own_inputs()``: a seeded copy of ``x``, for a candidate that writes over its inputs."""
    if impl == "liger":
        if device.type != "cuda" and not args.liger_on_cpu:
            return "skipped on CPU: Liger's defaults need CUDA (torch.compile'd chunked losses, Triton GPU kernels); --liger-on-cpu"
        if overwrites_input(loss):  # the candidates after it must see the logits, not its gradient
            x = own_inputs()
        return liger_call(loss, x, compiled=device.type == "cuda"), x.grads
    if impl == "plain":
        return plain_call(loss, x), x.grads
    if impl == "triton" and device.type != "cuda" and not args.tiny:
        return "skipped on CPU: --tiny runs the triton impls in Triton's interpreter"
    return polykernel_call(loss, x, None if impl == "auto" else impl), x.grads


def estimate(losses: list[str], impls: list[str], on_cuda: bool, tiny: bool, path: str | None) -> None:
    """Print the run's time before it starts: ``ROW_S`` summed over its rows (a smoke run: ~1 s a
    row), and Liger's compiles."""
    per_row = 1.0 if tiny else sum(ROW_S[loss] for loss in losses) / max(len(losses), 1)
    compiles = sum(1 for loss in losses if loss in PREFERENCE) if "liger" in impls and on_cuda else 0
    announce(len(losses) * len(impls), per_row, "rows", path, extra_s=LIGER_COMPILE_S * compiles)


def pick(value, allowed, flag):
    chosen = [v for v in value.split(",") if v] if value else list(allowed)
    unknown = sorted(set(chosen) - set(allowed))
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; known: {', '.join(allowed)}")
    return [v for v in allowed if v in chosen]  # in the run's order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes (a smoke test; the triton impls interpreted on a CPU)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps a row (--tiny: one)")
    ap.add_argument(
        "--only", default="", help=f"comma-separated losses, e.g. those a cut run missed (default: all, in this order: {','.join(LOSSES)})"
    )
    ap.add_argument("--impls", default="", help=f"comma-separated candidates (default: {','.join(IMPLS)})")
    ap.add_argument("--liger-on-cpu", action="store_true", help="run Liger on a CPU too: a check of the arguments, not a timing")
    ap.add_argument("--chunk-mib", type=positive_int, help="polykernel's chunk budget (default: _linear_logps.CHUNK_BYTES, 1 GiB)")
    ap.add_argument(
        "--flce-chunk-mib",
        type=positive_int,
        help="fused_linear_cross_entropy's logits per chunk (default: _fused_linear_cross_entropy.CHUNK_BYTES, 256 MiB)",
    )
    args = ap.parse_args()
    losses, impls = pick(args.only, LOSSES, "--only"), pick(args.impls, IMPLS, "--impls")
    from polykernel.backends import _fused_linear_cross_entropy, _linear_logps

    if args.chunk_mib is not None:
        _linear_logps.CHUNK_BYTES = args.chunk_mib << 20
    if args.flce_chunk_mib is not None:
        _fused_linear_cross_entropy.CHUNK_BYTES = args.flce_chunk_mib << 20
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes, reps = (TINY, 1) if args.tiny else (FULL, args.reps)  # a smoke run: one timed step
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    header = {"device": where, "dtype": str(dtype), "torch": torch.__version__, "rtol": RTOL}
    header["chunk_mib"] = {
        "linear_logps": _linear_logps.CHUNK_BYTES >> 20,
        "fused_linear_cross_entropy": _fused_linear_cross_entropy.CHUNK_BYTES >> 20,
    }
    header["ce_options"] = {**OPTION_VALUES, "weight": "seeded, in [0.5, 1.5), fp32"}
    out = RowFile(args.json, header)
    estimate(losses, impls, device.type == "cuda", args.tiny, args.json)

    for loss in losses:
        x = inputs(loss, shapes, device, dtype)
        with torch.no_grad():  # the value every candidate is compared with
            ref = polykernel_call(loss, x, "torch")()
            ref = float((ref[0] if isinstance(ref, tuple) else ref).detach())
        for impl in impls:
            row = {"loss": loss, "impl": impl, "shape": x.shape, "dtype": str(dtype)}
            try:
                call = candidate(loss, impl, x, args, device, lambda: inputs(loss, shapes, device, dtype))
                if isinstance(call, str):
                    row["error"] = call
                else:
                    if impl == "auto":  # the decisions of this row alone: what auto actually ran
                        polykernel.clear_caches()
                    ms, peak, value = measure(*call, device, reps)
                    rel = abs(value - ref) / max(abs(ref), 1e-6)
                    row.update(ms=ms, peak_extra_mib=peak, loss_value=value, rel_diff=rel, agrees=rel <= RTOL)
                    if impl == "auto":
                        row["ran"] = sorted({f"{d['op']}={d['impl']}" for d in polykernel.decisions()})
            except Exception as exc:  # one failing candidate must not hide the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            row["device"] = where
            out.add(row, json.dumps(row))
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out.finish()


if __name__ == "__main__":
    main()
