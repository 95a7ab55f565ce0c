"""Decode loop of a Llama-1B-shaped model as a serving engine runs it (issue 25's client).

A ``transformers`` Llama (hidden 2048, 16 layers, 32/8 heads, intermediate 8192, vocab 128256,
tied embeddings; random weights), bf16, a ``StaticCache``; a prompt is prefilled (not timed),
then greedy decode steps of one token per sequence, at batch 1 and 32. Variants:

- ``plain``: transformers' model as it is; ``polykernel``: ``patch(model, mode="inference")``
  (residual stream through ``fused_add_rms_norm_``, merged gate/up + ``silu_and_mul``, rope);
  ``polykernel[flashinfer]`` / ``polykernel[sgl_kernel]``: the same with that provider preferred
  (``polykernel.set_impl``) wherever its gates take the call;
- each of those eager (``[eager]``: one Python-driven step, what launch overhead costs) and with the
  step captured in one CUDA graph (``[graph]``: the step, the next token fed back and the position
  advanced, all inside the graph; one replay per token);
- ``compile[reduce-overhead]``: the unpatched model's forward under
  ``torch.compile(mode="reduce-overhead")`` (Inductor + CUDA graphs);
  ``polykernel+compile[reduce-overhead]``: the patched model's (inference mode) forward, the same
  way (one graph, no break: the serving ops are custom ops; see docs/compile.md). Both record
  ``graph_breaks`` (Dynamo's count during their warm-up).

Reported per variant and batch: ms per decode step (= per token of each sequence; median of
``--repeats`` timed runs of ``--steps`` steps, CUDA events), tokens/s (batch / step time), and how
far the first step's logits are from ``plain[eager]``'s (max |diff|) and whether the greedy tokens
agree. A variant that fails records its error and the rest go on. Each record lists the impls that
actually ran per op (``impls``, from ``polykernel.decisions()``): ``set_impl`` is a preference, so a
provider variant whose provider ran nowhere (not installed, failing to import, or refused by its
gates) says so (``"provider_ran": false``, and a note in the table) instead of claiming the provider.
Each record is written to ``--json`` as measured (a cut run keeps its rows; ``complete`` false).

    PYTHONPATH=src python benchmarks/models/decode_loop.py --json OUT.json            # H200, ~3-5 min
    PYTHONPATH=src python benchmarks/models/decode_loop.py --tiny --json OUT.json     # CPU: tiny, eager only

``--variants`` picks a comma-separated subset; ``--batches`` (default 1,32), ``--prompt`` (128),
``--steps`` (64), ``--repeats`` (5); ``--layers``/``--hidden``/... shrink the model.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from _common import add_llama_args, llama_config, tiny_llama

from polykernel.tools.rows import RowFile, announce

EAGER = ("plain[eager]", "polykernel[eager]", "polykernel[flashinfer][eager]", "polykernel[sgl_kernel][eager]")
GRAPH = ("plain[graph]", "polykernel[graph]", "polykernel[flashinfer][graph]", "polykernel[sgl_kernel][graph]")
COMPILED = ("compile[reduce-overhead]", "polykernel+compile[reduce-overhead]")
ALL = EAGER + GRAPH + COMPILED


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    import transformers

    config = llama_config(args, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))  # norm weights off their init
    return model.to(dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Elapsed ms of a block: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Any) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def run_variant(
    name: str, base: Any, args: argparse.Namespace, batch: int, device: torch.device, first_token: torch.Tensor | None = None
) -> dict[str, Any]:
    """One variant's record. ``first_token``: the token every variant decodes first (plain eager's
    greedy choice after the prompt), so the first decode logits are compared on the same input:
    a variant's own prefill argmax can differ where two logits are within rounding of each other,
    and its next logits are then those of another token (a difference of the logit scale that
    says nothing about the arithmetic)."""
    import transformers

    import polykernel
    from polykernel.integrations.transformers import patch, patched

    model = copy.deepcopy(base)
    provider = next((p for p in ("flashinfer", "sgl_kernel") if f"[{p}]" in name), None)
    polykernel.set_impl(provider)  # None: the default choice
    polykernel.clear_caches()  # decisions() then lists this variant's choices only
    if name.startswith("polykernel"):
        patch(model, mode="inference")
    record: dict[str, Any] = {"variant": name, "batch": batch}
    if name.startswith("polykernel"):
        record["patched"] = {k: len(v) if isinstance(v, list) else v for k, v in patched(model).items()}
    gen = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(1, args.vocab, (batch, args.prompt), generator=gen).to(device)
    max_len = args.prompt + 8 + args.steps * (args.repeats + 1) + 8
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)
    forward = model.forward
    compiled = name in COMPILED
    if compiled:  # fullgraph=False, as transformers' generate() compiles: a break is counted, not fatal
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    tok = torch.empty(batch, 1, dtype=torch.long, device=device)
    pos = torch.empty(1, dtype=torch.long, device=device)
    first_logits: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []

    def step() -> None:
        out = forward(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
        logits = out.logits[:, -1]
        if len(first_logits) == 0:
            first_logits.append(logits.float().clone())
        tok.copy_(logits.argmax(-1, keepdim=True))
        pos.add_(1)

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(args.prompt, device=device))
        own = out.logits[:, -1:].argmax(-1)
        record["prefill_token_agrees"] = None if first_token is None else round(float((own == first_token).float().mean()), 4)
        tok.copy_(own if first_token is None else first_token)
        pos.fill_(args.prompt)
        record["_prefill_token"] = own.clone()
        run = step
        graph = None
        if name.endswith("[graph]"):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(3):  # warm-up: first calls choose impls, JIT-compile peers, fill caches
                    step()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run = graph.replay
        else:
            for i in range(6 if compiled else 3):  # (compile: the graphs are recorded on warm-up)
                step()
                if i == 2:  # every variant's token after the same three steps (compared below)
                    tokens.append(tok.clone())
            if compiled:
                record["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        _sync(device)
        record["setup_s"] = round(time.perf_counter() - t0, 2)
        if graph is not None:  # (the capture records its step without running it: three steps ran)
            tokens.append(tok.clone())
        timer = Timer(device)

        def steps() -> None:
            for _ in range(args.steps):
                run()

        times = [timer(steps) / args.steps for _ in range(args.repeats)]
    record["ms_per_step"] = round(statistics.median(times), 4)
    record["ms_per_step_all"] = [round(t, 4) for t in times]
    record["tokens_per_s"] = round(batch * 1e3 / record["ms_per_step"], 1)
    record["_first_logits"] = first_logits[0] if first_logits else None
    record["_tokens"] = tokens[0]
    record["impls"] = impls_ran(polykernel.decisions())
    if provider is not None:
        record["provider_ran"] = provider_ran(provider, record["impls"])
    polykernel.set_impl(None)
    return record


def impls_ran(decisions: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Op -> the impls that ran it (a tuned decision's size buckets each count), from decisions()."""
    out: dict[str, set[str]] = {}
    for d in decisions:
        ran = out.setdefault(d["op"], set())
        ran.add(d["impl"])
        ran.update(impl.removesuffix(" (static)") for impl in d.get("by_size", {}).values())
    return {op: sorted(impls) for op, impls in sorted(out.items())}


def provider_ran(provider: str, impls: dict[str, list[str]]) -> bool:
    """Whether ``provider`` ran any op: set_impl only prefers it, so our impls may have run instead."""
    return any(provider in ran for ran in impls.values())


def note(record: dict[str, Any]) -> str:
    """The table's note: the error, else a provider that did not run, else the logits' distance."""
    if record.get("error"):
        return record["error"][:60]
    parts = []
    if record.get("provider_ran") is False:
        provider = next(p for p in ("flashinfer", "sgl_kernel") if f"[{p}]" in record["variant"])
        parts.append(f"{provider} ran nowhere (our impls ran)")
    if "first_logits_max_abs_diff" in record:
        parts.append(f"max|dlogit| {record['first_logits_max_abs_diff']:.3g}")
    return "; ".join(parts)


def env(device: torch.device) -> dict[str, Any]:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
    for mod in ("triton", "flashinfer", "sgl_kernel"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # absent or failing: say which
            out[mod] = f"unavailable: {type(exc).__name__}: {str(exc)[:120]}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on the CPU, eager variants only")
    parser.add_argument("--variants", default="", help=f"comma-separated subset of {', '.join(ALL)}")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    add_llama_args(parser)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        tiny_llama(args, vocab=256)
        args.prompt, args.steps, args.repeats = min(args.prompt, 8), min(args.steps, 4), min(args.repeats, 2)
    dtype = torch.bfloat16 if cuda else torch.float32
    variants = [v for v in (args.variants.split(",") if args.variants else ALL) if v]
    unknown = sorted(set(variants) - set(ALL))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(ALL)}")
    if not cuda:  # no CUDA graphs, no reduce-overhead on the CPU
        variants = [v for v in variants if v in EAGER]
    base = build(args, device, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    out = RowFile(args.json, {"env": env(device), "config": {k: v for k, v in vars(args).items() if k != "json"}})
    announce(len(batches) * len(variants), per_case_s=2 if args.tiny else 15, what="variant x batch runs", path=args.json)
    print(f"\n{'variant':34} {'batch':>5} {'ms/step':>9} {'tok/s':>9}  note", flush=True)
    for batch in batches:
        ref: dict[str, Any] | None = None
        for name in variants:
            try:
                rec = run_variant(name, base, args, batch, device, None if ref is None else ref["first_token"])
            except Exception as exc:  # one failing variant never stops the others
                rec = {"variant": name, "batch": batch, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                traceback.print_exc(file=sys.stderr)
            first, toks, own = rec.pop("_first_logits", None), rec.pop("_tokens", None), rec.pop("_prefill_token", None)
            if name == "plain[eager]" and first is not None:
                ref = {"logits": first, "tokens": toks, "first_token": own}
            elif ref is not None and first is not None:
                rec["first_logits_max_abs_diff"] = float((first - ref["logits"]).abs().max())
                rec["token_after_three_steps_agrees"] = float((toks == ref["tokens"]).float().mean())
            line = f"{name:34} {batch:>5} {rec.get('ms_per_step', float('nan')):>9.4f} {rec.get('tokens_per_s', float('nan')):>9.1f}  {note(rec)}"
            out.add(rec, line)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out.finish()


if __name__ == "__main__":
    main()
