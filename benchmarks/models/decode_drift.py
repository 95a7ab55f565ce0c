"""Where do patched decode logits drift from the model's? (issue 34's silent-wrong suspect)

The decode loop's Llama-1B-shaped model (random weights, bf16, a ``StaticCache``): a prompt is
prefilled, then one decode step. Each variant's prefill logits (last position) and first decode
logits are compared with plain bf16 eager's (max |Δ|, greedy agreement) and with the same model in
fp32 (the truth both bf16 runs approximate: relative error ‖Δ‖/‖ref‖). The decode step reads the
same token in every variant (plain's greedy choice; ``--own-token``: each variant's own, which is
how issue 34's 5.33 arose: where two logits tie within rounding, variants pick other tokens and
their next logits differ by the logit scale). Variants: plain; patched
(``mode="inference"``); patched with every op on its torch impl; patched with one op at a time on
its torch impl (each op the patched run used, from ``decisions()``); patched without rope; the
default ``patch`` mode. Rows are printed and appended to ``--jsonl`` as measured.

    PYTHONPATH=src python benchmarks/models/decode_drift.py --jsonl drift.jsonl     # H200, ~1-2 min
    PYTHONPATH=src python benchmarks/models/decode_drift.py --tiny                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
from pathlib import Path
from typing import Any

import decode_loop
import torch
from _common import add_llama_args, tiny_llama

from polykernel.tools.rows import announce


def build(args: argparse.Namespace, device: torch.device) -> Any:
    """The decode loop's model, in fp32 (the truth; the bf16 runs are copies of it)."""
    return decode_loop.build(args, device, torch.float32)


def run(model: Any, prompt: torch.Tensor, ctx: Any, token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits at the last position, first decode step's logits), fp32. The decode step
    reads ``token`` (the same for every variant), else the model's own greedy choice."""
    import transformers

    cache = transformers.StaticCache(config=model.config, max_cache_len=prompt.shape[1] + 8)
    device = prompt.device
    with torch.inference_mode(), ctx:
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(prompt.shape[1], device=device))
        pre = out.logits[:, -1].float()
        tok = pre.argmax(-1, keepdim=True) if token is None else token
        pos = torch.tensor([prompt.shape[1]], device=device)
        dec = model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos).logits[:, -1].float()
    return pre, dec


def compare(name: str, batch: int, got: tuple[torch.Tensor, torch.Tensor], plain: tuple, truth: tuple, extra: dict) -> dict[str, Any]:
    row: dict[str, Any] = {"variant": name, "batch": batch, **extra}
    for i, stage in enumerate(("prefill", "decode")):
        g, p, t = got[i], plain[i], truth[i]
        row[f"{stage}_max_abs_vs_plain"] = round(float((g - p).abs().max()), 4)
        row[f"{stage}_argmax_agree_vs_plain"] = round(float((g.argmax(-1) == p.argmax(-1)).float().mean()), 3)
        row[f"{stage}_rel_err_vs_fp32"] = round(float((g - t).norm() / t.norm()), 5)
        row[f"{stage}_max_abs_vs_fp32"] = round(float((g - t).abs().max()), 4)
    return row


def main() -> None:
    import polykernel
    from polykernel.integrations.transformers import patch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jsonl", type=Path)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument(
        "--own-token",
        dest="same_token",
        action="store_false",
        help="decode each variant's own greedy token (default: plain's, the same input for every variant)",
    )
    add_llama_args(parser)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        tiny_llama(args, vocab=256)
        args.prompt = 8
    dtype = torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    # about 10 rows a batch: plain twice, 4 patched variants and one per op the patch ran (~4)
    announce(10 * len(batches), per_case_s=5 if cuda else 2, what="rows (about)", path=str(args.jsonl) if args.jsonl else None)

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
        if args.jsonl:
            with args.jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")

    base32 = build(args, device)
    truth_model = base32  # fp32
    base = copy.deepcopy(base32).to(dtype)
    for batch in batches:
        gen = torch.Generator(device="cpu").manual_seed(1)
        prompt = torch.randint(1, args.vocab, (batch, args.prompt), generator=gen).to(device)
        plain = run(base, prompt, contextlib.nullcontext())
        token = plain[0].argmax(-1, keepdim=True) if args.same_token else None
        if token is not None:
            plain = run(base, prompt, contextlib.nullcontext(), token)
        truth = run(truth_model, prompt, contextlib.nullcontext(), token)
        emit(compare("plain", batch, plain, plain, truth, {}))
        again = run(base, prompt, contextlib.nullcontext(), token)
        emit(compare("plain (again)", batch, again, plain, truth, {}))

        def patched(name: str, ctx_fn: Any = contextlib.nullcontext, **kw: Any) -> list[str]:
            t0 = time.perf_counter()
            model = copy.deepcopy(base)
            patch(model, **kw)
            polykernel.clear_caches()
            n0 = len(polykernel.decisions())
            try:
                got = run(model, prompt, ctx_fn(), token)
            except Exception as exc:
                emit({"variant": name, "batch": batch, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                return []
            ran = sorted({f"{d['op']}:{d['impl']}" for d in polykernel.decisions()[n0:]})
            emit(compare(name, batch, got, plain, truth, {"ran": ran, "s": round(time.perf_counter() - t0, 1)}))
            del model
            if cuda:
                torch.cuda.empty_cache()
            return ran

        ran = patched("patched[inference]", mode="inference")
        patched("patched[inference] all torch", lambda: polykernel.use_impl("torch"), mode="inference")
        for entry in ran:
            opname, impl = entry.rsplit(":", 1)
            if impl != "torch":
                patched(
                    f"patched[inference] {opname}:torch", lambda opname=opname: polykernel.use_impl("torch", op=opname), mode="inference"
                )
        patched("patched[inference] rope=False", mode="inference", rope=False)
        patched("patched[default]")


if __name__ == "__main__":
    main()
