"""What the model benchmarks share: the Llama-3-style model config and its command-line sizes, the
tiny CPU sizes, a step timer for ``transformers.Trainer`` runs, the packages' versions for the
records, and the model families' training runs (families.py, vision_families.py: a family and
variant per process). Scripts in this folder import it by name."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from polykernel.tools.options import positive_int

# A Llama-3.2-1B-shaped model: the scripts' default sizes
LLAMA_1B = dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256)


def add_llama_args(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """``--layers --hidden --intermediate --heads --kv-heads --vocab``, :data:`LLAMA_1B`'s sizes
    unless ``defaults`` says otherwise."""
    sizes = LLAMA_1B | defaults
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=sizes[name])


def tiny_llama(args: argparse.Namespace, vocab: int) -> None:
    """The CPU smoke runs' model: 2 layers, hidden 64, intermediate 128, 4/2 heads, ``vocab``."""
    args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab = 2, 64, 128, 4, 2, vocab


def llama_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """``transformers.LlamaConfig`` of ``args``' sizes (``vocab``, ``heads``, ``kv_heads`` and ``seq``
    where ``args`` has them, else 128256, 32, 8 and 2048 positions): tied embeddings, RoPE theta
    500000, SDPA attention; ``overrides`` replace or add fields."""
    import transformers

    fields = dict(
        vocab_size=getattr(args, "vocab", 128256),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=getattr(args, "heads", 32),
        num_key_value_heads=getattr(args, "kv_heads", 8),
        max_position_embeddings=max(getattr(args, "seq", 0), 2048),
        tie_word_embeddings=True,
        rope_theta=500000.0,
    )
    cfg = transformers.LlamaConfig(**(fields | overrides))
    cfg._attn_implementation = "sdpa"
    return cfg


def timed_steps(step: Callable[[], Any], steps: int, sync: Callable[[], None]) -> tuple[list[float], list[float], float]:
    """Run ``step()`` (it returns the loss) ``steps`` times, each timed to ``sync()``: the step
    times, the losses, and the median of steps 4..N (the last step's time if there are fewer:
    the first steps compile, tune and warm the allocator)."""
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    steady = times[3:] if len(times) > 3 else times[-1:]
    return times, losses, statistics.median(steady)


def step_timer(cuda: bool, times: list[float], peaks: list[float] | None = None) -> Any:
    """A ``transformers.TrainerCallback`` that appends each optimizer step's wall time to ``times``
    (synchronizing the GPU at both ends when ``cuda``). With ``peaks`` (and ``cuda``), each step's
    CUDA peak in GiB too, the peak statistics reset after each: the first step's (first-call
    checks, compiles, autotuning) stands apart from the steady steps'."""
    import torch
    import transformers

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            if cuda and peaks is not None:
                peaks.append(torch.cuda.max_memory_allocated() / 2**30)
                torch.cuda.reset_peak_memory_stats()

    return Timer()


def peak_fields(peaks: list[float]) -> dict[str, Any]:
    """A record's peaks from :func:`step_timer`'s per-step list: the whole run's (``peak_gib``),
    the steps after the first (``steady_peak_gib``) and each step's; None where not measured."""
    return {
        "peak_gib": max(peaks) if peaks else None,
        "steady_peak_gib": max(peaks[1:]) if len(peaks) > 1 else None,
        "step_peaks_gib": peaks,
    }


def peak_text(record: dict[str, Any]) -> str:
    """``12.57 GiB (later 12.14)``: a record's peak and, apart, its steady steps' (``-`` if none)."""
    if record.get("peak_gib") is None:
        return "-"
    later = record.get("steady_peak_gib")
    return f"{record['peak_gib']:.2f} GiB" + ("" if later is None else f" (later {later:.2f})")


def peak_allocations(events: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """From a CUDA caching-allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``):
    the most bytes allocated at once during the trace, and the allocations alive at that moment
    (those made during the trace), largest first. Frees count when completed. Two passes (where
    the peak is, then what is alive there): no copy of the live set at each new high."""
    sizes: dict[int, int] = {}
    total = peak = 0
    peak_at = -1
    for i, e in enumerate(events):
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            sizes[addr] = e.get("size", 0)
            total += sizes[addr]
            if total > peak:
                peak, peak_at = total, i
        elif action == "free_completed" and addr in sizes:
            total -= sizes.pop(addr)
    live: dict[int, dict[str, Any]] = {}
    for e in events[: peak_at + 1]:
        if e.get("action") == "alloc":
            live[e.get("addr")] = e
        elif e.get("action") == "free_completed":
            live.pop(e.get("addr"), None)
    return peak, sorted(live.values(), key=lambda e: -e.get("size", 0))


# C++ frames that say nothing about who allocated: the recorder itself, the unwinder, the allocator,
# empty/new_empty and the standard library's call plumbing.
_CPP_NOISE = (
    "torch::CapturedTraceback",
    "torch::cuda::(anonymous namespace)::gather",  # the recorder's own frame too (gather_with_cpp: thirtieth run's trace)
    "torch::unwind",
    "c10::",
    "at::empty",
    "at::native::empty",
    "at::detail::empty",
    "at::_ops::empty",
    "at::TensorBase::",
    "std::",
    "??",
)


def _frame_text(f: dict[str, Any]) -> str | None:
    """A frame as ``file:line name`` (Python) or its C++ name, None for a C++ frame of no say."""
    name, fn = str(f.get("filename", "")), str(f.get("name", ""))
    if name.endswith(".py"):
        return f"{name}:{f.get('line')} {fn}"
    return fn[:160] if fn and not fn.startswith(_CPP_NOISE) else None


def allocation_site(e: dict[str, Any]) -> str:
    """Who made an allocation: its innermost Python frame outside torch's own modules (Inductor's
    generated code counts as ours); else (the autograd engine's thread has no Python frames) the
    engine's sum of two gradients of one tensor (``torch::autograd::InputBuffer::add``) or the
    autograd node whose backward allocated it (``torch::autograd::generated::MmBackward0::apply``),
    else the innermost C++ frame that is not the recorder, the allocator or an ``empty``; else '?'."""
    frames = e.get("frames") or []
    for f in frames:
        name = str(f.get("filename", ""))
        if name.endswith(".py") and ("/torch/" not in name or "torchinductor" in name):
            return _frame_text(f) or "?"
    cpp = [text for f in frames if not str(f.get("filename", "")).endswith(".py") and (text := _frame_text(f))]
    for text in cpp:  # autograd summing two gradients of one tensor (a tied weight's), out of place
        if "autograd::InputBuffer" in text:
            return text
    for text in cpp:
        if "Backward" in text or "autograd::generated" in text:
            return text
    return cpp[0] if cpp else "?"


def allocation_stack(e: dict[str, Any], depth: int = 10) -> list[str]:
    """An allocation's ``depth`` innermost frames that say something (Python ``file:line name``,
    C++ names), for reading one large block's origin after the run."""
    return [text for f in e.get("frames") or [] if (text := _frame_text(f))][:depth]


def by_site(alive: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The allocations ``alive`` summed per :func:`allocation_site`, largest total first:
    ``{"site", "bytes", "blocks"}`` each."""
    sites: dict[str, dict[str, Any]] = {}
    for e in alive:
        site = allocation_site(e)
        group = sites.setdefault(site, {"site": site, "bytes": 0, "blocks": 0})
        group["bytes"] += e.get("size", 0)
        group["blocks"] += 1
    return sorted(sites.values(), key=lambda g: -g["bytes"])


def at_peak_text(record: dict[str, Any]) -> str:
    """The largest site alive at a record's traced peak (:func:`memory_trace`), ``""`` without one."""
    sites = (record.get("at_peak") or {}).get("by_site")
    if not sites:
        return ""
    top = sites[0]
    return f"  largest at peak: {top['bytes'] / 2**20:.0f} MiB in {top['blocks']} from {top['site']}"


@contextlib.contextmanager
def allocator_events(cuda: bool = True) -> Iterator[list[dict[str, Any]]]:
    """With ``cuda``, the CUDA caching allocator's history recorded inside the block (Python and
    C++ stacks); once the block exits, the list it yields holds the current device's events, for
    :func:`peak_allocations`. Recording stops on an error too. Without, it stays empty."""
    import torch

    events: list[dict[str, Any]] = []
    if not cuda:
        yield events
        return
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    try:
        yield events
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events += snapshot["device_traces"][torch.cuda.current_device()]


@contextlib.contextmanager
def memory_trace(cuda: bool, top: int = 12) -> Iterator[dict[str, Any]]:
    """With ``cuda``, the CUDA allocator's history recorded inside the block (:func:`allocator_events`),
    and once it exits the dict it yields holds what its peak held: ``peak_bytes`` (allocated within
    the block), ``allocations`` alive then, and the ``top`` sites of :func:`by_site`. Without,
    nothing is recorded and the dict stays empty. ``largest``: the ``top`` largest allocations alive
    then, each with its :func:`allocation_stack`."""
    out: dict[str, Any] = {}
    with allocator_events(cuda) as events:
        yield out
    if cuda:
        peak, alive = peak_allocations(events)
        largest = [{"bytes": e.get("size", 0), "stack": allocation_stack(e)} for e in alive[:top]]
        out.update(peak_bytes=peak, allocations=len(alive), by_site=by_site(alive)[:top], largest=largest)


def add_memory_trace_arg(parser: argparse.ArgumentParser) -> None:
    """``--memory-trace``: :func:`memory_trace` around the run (the TRL scripts)."""
    parser.add_argument(
        "--memory-trace",
        action="store_true",
        help="record the CUDA allocator's history (slower steps): what is live at the peak, by origin",
    )


def versions(*names: str) -> dict[str, str | None]:
    """Each installed distribution's version, None where it is missing (a record, not a crash)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


# -- the tensor-parallel scripts (tp_block.py, tp_vocab_loss.py) ---------------------------------------
def add_tp_args(parser: argparse.ArgumentParser) -> None:
    """``--batch --seq --steps --warmup`` (defaults by :func:`tp_defaults`) and ``--smoke``."""
    for name in ("batch", "seq", "steps", "warmup"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny model, Triton through its interpreter")


def tp_defaults(args: argparse.Namespace) -> None:
    """The sizes not given: tiny for ``--smoke`` (which also runs Triton through its interpreter)."""
    defaults = dict(batch=2, seq=32, steps=2, warmup=1) if args.smoke else dict(batch=8, seq=2048, steps=10, warmup=3)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"


def tp_model(config: dict[str, Any], max_positions: int, args: argparse.Namespace, device: str) -> tuple[Any, Any, Any]:
    """A seeded ``LlamaForCausalLM`` of ``config``'s fields (pad id 0; fp32 for ``--smoke``, else
    bf16), a seeded ``[batch, seq]`` batch of token ids for it, and the dtype."""
    import torch
    import transformers

    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = transformers.LlamaConfig(max_position_embeddings=max_positions, pad_token_id=0, **config)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
    return model, ids, dtype


def tp_steps(
    model: Any,
    ids: Any,
    steps: int,
    warmup: int,
    device: str,
    barrier: Callable[[], None] | None = None,
    seen: Callable[[Any], None] | None = None,
) -> tuple[list[float], list[float]]:
    """``warmup + steps`` AdamW steps of the causal-LM loss on ``ids``: the times of the steps
    after the warmup (each from a synchronized start, after ``barrier()`` if given) and every
    step's loss; ``seen(output)`` sees each step's model output."""
    import torch

    # foreach=False: the parallelized model mixes DTensor and plain parameters, which torch's
    # foreach kernels refuse ("got mixed torch.Tensor and DTensor"; seen on 2xH200, torch 2.11).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    model.train()
    times, losses = [], []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        sync()
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(out.loss.detach()))
        if seen is not None:
            seen(out)
        del out
    return times, losses


def tp_header(device: str, world: int, config: dict[str, Any], dtype: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The record's first fields: the machine, the world size, the model, the run's sizes."""
    import torch

    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "world": world,
        "config": config,
        "dtype": str(dtype),
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch": torch.__version__,
    }


# -- the model families' training runs (families.py, vision_families.py) -------------------------------
FAMILY_VARIANTS = ("plain", "polykernel", "liger", "compile")


def add_family_args(parser: argparse.ArgumentParser, families: list[str], batch: str, seq: str) -> None:
    """The family scripts' options: ``--json --families --variants --batch --seq --steps --warmup
    --tiny --device --timeout`` (``batch``/``seq``: their help, which says the defaults)."""
    parser.add_argument("--json", type=Path, help="write the records and the summary here")
    parser.add_argument("--families", default=",".join(families), help="comma-separated model types (default: all)")
    parser.add_argument("--variants", default=",".join(FAMILY_VARIANTS), help=f"comma-separated, of {', '.join(FAMILY_VARIANTS)}")
    parser.add_argument("--batch", type=int, default=None, help=batch)
    parser.add_argument("--seq", type=int, default=None, help=seq)
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles, autotunes)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (a CPU check of the script)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="one more step under the torch profiler: its N kernels of most time in the record and printed",
    )  # fmt: skip
    parser.add_argument(
        "--flce-chunk-mib", type=positive_int, default=None, metavar="M",
        help="fused_linear_cross_entropy's logits per row chunk, in MiB (default: the library's); "
        "its time and peak in a training step against the budget",
    )  # fmt: skip


def family_selection(parser: argparse.ArgumentParser, args: argparse.Namespace, families: Any) -> tuple[list[str], list[str]]:
    """``--families`` and ``--variants`` as lists (a parser error names any unknown one)."""
    chosen = [f.strip() for f in args.families.split(",") if f.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [f for f in chosen if f not in families] + [v for v in variants if v not in FAMILY_VARIANTS]
    if bad:
        parser.error(f"unknown families or variants: {', '.join(bad)}")
    return chosen, variants


def family_argv(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """What each child process is passed (the sizes, ``--tiny``, ``--device``) and the setup record."""
    argv = [f"--batch={args.batch}", f"--seq={args.seq}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    argv += ["--tiny"] if args.tiny else []
    argv += [f"--device={args.device}"] if args.device else []
    argv += [f"--profile={args.profile}"] if args.profile else []
    argv += [f"--flce-chunk-mib={args.flce_chunk_mib}"] if args.flce_chunk_mib is not None else []
    setup = {k: getattr(args, k) for k in ("batch", "seq", "steps", "warmup", "tiny", "device", "profile")}
    return argv, {**setup, "flce_chunk_mib": flce_chunk_mib(args)}


def flce_chunk_mib(args: argparse.Namespace) -> float:
    """The fused linear cross-entropy's logits budget per row chunk that the runs use, in MiB
    (``--flce-chunk-mib``, set here, or the library's ``CHUNK_BYTES``)."""
    from polykernel.backends import _fused_linear_cross_entropy as flce

    if args.flce_chunk_mib is not None:
        flce.CHUNK_BYTES = args.flce_chunk_mib << 20
    return flce.CHUNK_BYTES / 2**20


def with_variant(model: Any, model_type: str, variant: str) -> Any:
    """The model as ``variant`` runs it: as built (plain), ``polykernel``'s patch, Liger-Kernel's
    patch for ``model_type`` (a RuntimeError where Liger has none) or ``torch.compile``."""
    import torch

    if variant == "polykernel":
        from polykernel.integrations.transformers import patch

        patch(model)
    elif variant == "liger":
        # Liger >= 0.8.5 autotunes its fused MoE kernels on their first call (~170 configs): the MoE
        # families' Liger runs went past 120 s without a step (h100-2026-12-06-nineteenth/families-4);
        # its default configs instead, as moe_train.py's liger[fixed] (read at import; a value set
        # by whoever runs the script wins)
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

        if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            raise RuntimeError(f"Liger-Kernel has no patch for {model_type}")
        _apply_liger_kernel_to_instance(model=model)
    elif variant == "compile":
        model = torch.compile(model)
    return model


def family_child(args: argparse.Namespace, build: Callable[[str, Any, Any], tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
    """One ``--child=FAMILY:VARIANT`` run in this process: ``build(family, device, dtype)`` gives the
    plain model (built after ``torch.manual_seed(0)``: every variant starts from the same weights)
    and the batch (the model's keyword arguments, labels among them: a step is ``model(**batch).loss``,
    its backward and an AdamW step); then ``args.warmup`` untimed and ``args.steps`` timed steps.
    The record: the median step time, tokens/s (``args.batch * args.seq`` tokens a step), peak CUDA
    memory after the warm-up, the first step's loss, what polykernel patched and ran; or the error."""
    import torch

    family, variant = args.child.split(":")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    record: dict[str, Any] = {"family": family, "variant": variant, "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    if variant == "polykernel":  # (the only variant that runs the op)
        record["flce_chunk_mib"] = flce_chunk_mib(args)  # before the model's first step
    try:
        torch.manual_seed(0)  # (CUDA's generator too)
        model, batch = build(family, device, dtype)
        model.train()
        model = with_variant(model, family, variant)
        params = list(model.parameters())
        record["parameters"] = sum(p.numel() for p in params)
        opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")

        def step() -> Any:
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        times, first = [], None
        for i in range(args.warmup + args.steps):
            if i == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync()
            t0 = time.perf_counter()
            loss = step()
            sync()
            if first is None:
                first = float(loss)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        record.update(
            first_loss=first,
            step_seconds=times,
            median_step_seconds=median,
            tokens_per_second=args.batch * args.seq / median,
            peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        )
        if args.profile:  # after the timed steps and the peak: the profiler's own memory and time stay out of both
            record["kernels"] = top_kernels(step, sync, device, args.profile)
        if variant == "polykernel":
            import polykernel
            from polykernel.integrations.transformers import patched

            record["patched"] = {k: (v if isinstance(v, str) else len(v)) for k, v in patched(model).items()}
            record["ops"] = sorted({(d["op"], d["impl"]) for d in polykernel.decisions()})
        elif variant == "liger":
            record["liger_fused_moe_autotune"] = os.environ.get("LIGER_FUSED_MOE_AUTOTUNE")
    except Exception as exc:  # one family failing must not lose the others' rows
        import traceback

        record["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
    return record


def top_kernels(step: Callable[[], Any], sync: Callable[[], None], device: Any, n: int) -> list[dict[str, Any]]:
    """One ``step()`` under the torch profiler: the ``n`` kernels (on a CPU: ops) of most self time,
    each ``{"name", "us", "calls", "share"}`` (its share of all the step's kernel time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        sync()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [(e.key, getattr(e, attr), e.count) for e in prof.key_averages() if getattr(e, attr) > 0]
    total = sum(us for _, us, _ in events) or 1.0
    events.sort(key=lambda e: -e[1])
    return [{"name": k, "us": round(us, 1), "calls": c, "share": round(us / total, 4)} for k, us, c in events[:n]]


def run_families(script: str, families: list[str], variants: list[str], argv: list[str], timeout: float, out: Any) -> list[dict[str, Any]]:
    """Each (family, variant) in a process of its own (``_child.run_child``), its record written to
    ``out`` (a ``RowFile``) with a line as it ends; the summary (:func:`summarize_families`), printed."""
    import json

    import _child

    for family in families:
        for variant in variants:
            rec = _child.run_child(script, f"{family}:{variant}", argv, timeout)
            rec.setdefault("family", family), rec.setdefault("variant", variant)
            if "error" in rec:
                line = f"{family:12s} {variant:10s} error: {_child.last_error_line(rec)}"
            else:
                mem = rec["peak_memory_bytes"]
                mem_text = f"{mem / 2**30:6.2f} GiB" if mem is not None else "      -"
                line = f"{family:12s} {variant:10s} {rec['tokens_per_second']:10.0f} tok/s {mem_text}  loss {rec['first_loss']:.4f}  ({rec['wall_s']:.0f} s)"
            for k in rec.get("kernels", []):  # --profile
                line += f"\n    {k['share']:6.1%} {k['us'] / 1e3:9.2f} ms {k['calls']:5d}x  {k['name'][:100]}"
            out.add(rec, line)
    summary = summarize_families(out.rows)
    for row in summary:
        print(json.dumps(row), flush=True)
    return summary


def summarize_families(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per family: each variant's speed-up over plain, its first loss against plain's, and
    polykernel's peak memory over Liger's."""
    import _child

    out = []
    by_family: dict[str, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_family.setdefault(r["family"], {})[r["variant"]] = r
    for family, runs in by_family.items():
        ok = {v: r for v, r in runs.items() if "error" not in r}
        row: dict[str, Any] = {"family": family}
        plain = ok.get("plain")
        for v, r in ok.items():
            row[f"{v}_tokens_per_second"] = r["tokens_per_second"]
            if plain is not None:
                row[f"{v}_speedup"] = r["tokens_per_second"] / plain["tokens_per_second"]
                row[f"{v}_loss_minus_plain"] = r["first_loss"] - plain["first_loss"]
        pk, lg = ok.get("polykernel"), ok.get("liger")
        if pk and lg and pk.get("peak_memory_bytes") and lg.get("peak_memory_bytes"):
            row["polykernel_memory_over_liger"] = pk["peak_memory_bytes"] / lg["peak_memory_bytes"]
        row["errors"] = {v: _child.last_error_line(r) for v, r in runs.items() if "error" in r}
        out.append(row)
    return out
