"""Where a decode step's GPU time goes: plain in a CUDA graph, patched in a CUDA graph, and
``torch.compile(mode="reduce-overhead")`` (issue 34).

The decode loop's Llama-1B-shaped model (bf16, ``StaticCache``, a 128-token prompt prefilled):
one decode step is captured (or compiled), replayed a few times, then one replay is profiled with
``torch.profiler``. Per variant and batch: the step's time (CUDA events, median of 20 replays),
the number of kernels, and the GPU time by kernel name (top 12), summed over the step. Rows are
printed and appended to ``--jsonl`` as measured.

    PYTHONPATH=src python benchmarks/models/decode_profile.py --jsonl prof.jsonl    # H200, ~2 min
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from _common import add_llama_args
from decode_drift import build

from polykernel.tools.rows import announce


def profile_variant(name: str, base: Any, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from polykernel.integrations.transformers import patch

    model = copy.deepcopy(base)
    if name.startswith("polykernel"):
        patch(model, mode="inference")
    device = torch.device("cuda")
    prompt = torch.randint(1, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    cache = transformers.StaticCache(config=model.config, max_cache_len=args.prompt + 64)
    forward = torch.compile(model.forward, mode="reduce-overhead") if name.startswith("compile") else model.forward
    tok = torch.empty(batch, 1, dtype=torch.long, device=device)
    pos = torch.empty(1, dtype=torch.long, device=device)

    def step() -> None:
        out = forward(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
        tok.copy_(out.logits[:, -1].argmax(-1, keepdim=True))

    with torch.inference_mode():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(args.prompt, device=device))
        tok.copy_(out.logits[:, -1:].argmax(-1))
        pos.fill_(args.prompt)
        run = step
        if name.endswith("[graph]"):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run = graph.replay
        else:
            for _ in range(6):
                step()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(evt.name[:90], []).append(evt.device_time)
    total = sum(sum(v) for v in by_name.values()) / 1e3
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "variant": name,
        "batch": batch,
        "ms_per_step": round(statistics.median(times), 4),
        "kernels": sum(len(v) for v in by_name.values()),
        "kernel_ms": round(total, 4),
        "top": [{"kernel": k, "n": len(v), "ms": round(sum(v) / 1e3, 4)} for k, v in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jsonl", type=Path)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--variants", default="plain[graph],polykernel[graph],compile[reduce-overhead]")
    add_llama_args(parser)
    args = parser.parse_args()
    batches, variants = [int(b) for b in args.batches.split(",")], args.variants.split(",")
    announce(len(batches) * len(variants), per_case_s=20, what="rows", path=str(args.jsonl) if args.jsonl else None)
    base = build(args, torch.device("cuda")).to(torch.bfloat16)
    for batch in batches:
        for name in variants:
            try:
                row = profile_variant(name, base, args, batch)
            except Exception as exc:
                row = {"variant": name, "batch": batch, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(json.dumps(row), flush=True)
            if args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
