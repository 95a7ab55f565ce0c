"""What a Llama training step's autograd graph saves for backward, per decoder layer, eager vs compiled.

Issue 14: the patched model under ``torch.compile`` peaks higher than the patched model eager.
This counts the activation bytes each variant keeps between forward and backward (the part of
peak memory that grows with tokens x layers), and which tensors make the difference.

How: a ``saved_tensors_hooks`` pack hook records every tensor an autograd node saves (eager
nodes, our custom ops' ``ctx``, and AOTAutograd's ``CompiledFunction``, which saves what the
Inductor partition chose). Tensors are counted once per storage; parameters are left out. In
eager, module forward hooks tell which layer and submodule saved each tensor. Under compile,
Inductor's partition function is wrapped: the forward graph's saved outputs give each runtime
tensor its graph name, op and module (``nn_module_stack``). Each variant runs in its own process
(``POLYKERNEL_COMPILE_*`` is read at import), with Inductor's caches off so that the partition
runs.

    PYTHONPATH=src python benchmarks/models/compile_saved.py --out DIR                  # CPU, small shape, ~1.5 min
    PYTHONPATH=src python benchmarks/models/compile_saved.py --out DIR --device cuda \\
        --hidden 2048 --intermediate 8192 --heads 32 --kv-heads 8 --layers 16 --vocab 128256 \\
        --batch 4 --seq 2048 --only polykernel,compile,polykernel+compile,polykernel+compile[ours]

Variants (``--only``, or ``all``): plain/compile without polykernel; polykernel eager (on CPU it
runs the Triton impls in the interpreter, ``--eager-impl``, so that it saves what the GPU's
impls save); polykernel+compile with the ops' default ``compile_mode``; ``[ours]`` with
``POLYKERNEL_COMPILE_{SWIGLU,GEGLU,ROPE,FUSED_ADD_RMS_NORM}=ours`` (``[ours-rope]``,
``[ours-swiglu]``: one op); ``[mask]`` makes transformers materialize the causal mask while
compiling, as it does with torch < 2.14 (see ``MASK_ENV``); ``[op-scale]`` drops the fused linear
cross-entropy's ``saved_grads`` (its op's fact), so that its backward custom op scales the saved
gradients into fresh tensors (the behaviour before issue 14's fix; compare its peak on CUDA).

Writes ``DIR/compile_saved.json`` (``args``, ``complete``, ``rows``: each variant's record, written
as the variant ends, ``results`` by name before issue 35; then ``summary`` and ``diffs``); prints saved bytes per layer and per token by variant, scaled to
issue 14's run (``--target-tokens`` x ``--target-layers``, bf16, hidden 2048), and the tensors
that one variant saves per layer and the other does not (matched by size and dtype), and per
compiled variant what its backward graphs run of ours: the polykernel custom ops, and the saved
tensors of our training ops that the graph multiplies itself (the ops' ``saved_grads``). It also
records the bytes live after the forward and the step's peak, over the step's start (CUDA: the
allocator's counters; CPU: the profiler's allocation events), at the run's own shape.
Bytes scale to the target shape by hidden size (all per-token activations here are multiples of
it, heads = hidden / head_dim); per-row scalars (rstd, LSE) are scaled too, a small overcount.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _child import last_error_line, parse, run_child
from _common import llama_config

from polykernel.tools.rows import RowFile, announce

OURS_ENV = {f"POLYKERNEL_COMPILE_{op}": "ours" for op in ("SWIGLU", "GEGLU", "ROPE", "FUSED_ADD_RMS_NORM")}
# transformers skips the causal mask under torch.compile only with torch >= 2.14 (its
# masking_utils._ignore_causal_mask_sdpa: older dynamo folds torch.compiler.is_exporting() to True);
# on older torch (the H200's 2.11) compiled Llamas get a materialized [B, 1, S, S] mask, hence
# no enable_gqa (repeat_kv) and SDPA with a mask. "[mask]" variants reproduce that on a newer torch.
MASK_ENV = {"COMPILE_SAVED_MASK": "1"}
OP_SCALE_ENV = {"COMPILE_SAVED_OP_SCALE": "1"}  # the loss's saved gradients scaled in its backward op
VARIANTS: dict[str, tuple[bool, bool, dict[str, str]]] = {  # name -> (patch, compile, env)
    "plain": (False, False, {}),
    "compile": (False, True, {}),
    "compile[mask]": (False, True, MASK_ENV),
    "polykernel": (True, False, {}),
    "polykernel+compile": (True, True, {}),
    "polykernel+compile[mask]": (True, True, MASK_ENV),
    "polykernel+compile[ours]": (True, True, OURS_ENV),
    "polykernel+compile[ours+mask]": (True, True, OURS_ENV | MASK_ENV),
    "polykernel+compile[ours-rope]": (True, True, {"POLYKERNEL_COMPILE_ROPE": "ours"}),
    "polykernel+compile[ours-swiglu]": (True, True, {"POLYKERNEL_COMPILE_SWIGLU": "ours"}),
    "polykernel+compile[op-scale]": (True, True, OP_SCALE_ENV),
}
DEFAULT = "polykernel,polykernel+compile,polykernel+compile[mask],polykernel+compile[ours]"
PAIRS = (  # (a, b): what b saves per layer that a does not, and the other way
    ("polykernel", "polykernel+compile"),
    ("polykernel", "polykernel+compile[mask]"),
    ("polykernel", "polykernel+compile[ours]"),
    ("compile", "polykernel+compile"),
)
_LAYER = re.compile(r"layers(?:\.|\[')?\[?(\d+)")


def _layer_of(where: str) -> str:
    m = _LAYER.search(where)
    return f"layer{m.group(1)}" if m else ("head" if where else "?")


def _role(where: str) -> str:
    """The submodule inside a layer (``self_attn.q_proj``, ``mlp``...), for the tables."""
    m = _LAYER.search(where)
    tail = where[m.end() :] if m else where
    return re.sub(r"['\]\[]+", ".", tail).strip(".") or where


# -- child: one variant ---------------------------------------------------------------------------
def _build(args: argparse.Namespace, patch: bool) -> Any:
    import torch
    import transformers

    cfg = llama_config(args)
    if os.environ.get("COMPILE_SAVED_MASK") == "1":
        _materialize_mask_while_compiling()
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, args.dtype))
    if patch:
        from polykernel.integrations.transformers import patch as pk_patch

        pk_patch(model)
        if os.environ.get("COMPILE_SAVED_OP_SCALE") == "1":
            from polykernel.core import registry

            registry.get_op("loss.fused_linear_cross_entropy").saved_grads = None  # read when the graph is traced
    model.train()
    return model


def _materialize_mask_while_compiling() -> None:
    """transformers' causal-mask skip, off while Dynamo traces (what torch < 2.14 gets)."""
    import torch.compiler
    import transformers.masking_utils as mu

    skip = mu._ignore_causal_mask_sdpa

    def never_while_compiling(*a: Any, **k: Any) -> bool:
        return False if torch.compiler.is_compiling() else skip(*a, **k)

    mu._ignore_causal_mask_sdpa = never_while_compiling


class _Where:
    """Forward hooks on every module: the innermost module running (eager attribution)."""

    def __init__(self, model: Any) -> None:
        self.stack: list[str] = []
        for name, mod in model.named_modules():
            if not name.startswith("model"):  # a hooked lm_head would turn the fused loss off
                continue
            mod.register_forward_pre_hook(lambda m, a, n=name: self.stack.append(n))
            mod.register_forward_hook(self._pop)

    def _pop(self, module: Any, args: Any, output: Any) -> None:  # returns None: keeps the output
        self.stack.pop()

    def now(self) -> str:
        return self.stack[-1] if self.stack else ""


class _Partitions:
    """Wraps Inductor's partition function: per compiled graph, its saved values' names."""

    def __init__(self) -> None:
        self.graphs: list[list[dict[str, Any]]] = []
        self.backward: list[dict[str, Any]] = []  # per graph: what its backward runs of ours

    def install(self) -> None:
        import torch._inductor.compile_fx as cfx

        # compile_fx's module-level partition_fn (joint passes + min-cut); older torch: the min-cut
        name = "partition_fn" if hasattr(cfx, "partition_fn") else "min_cut_rematerialization_partition"
        original = getattr(cfx, name)

        def partition(gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
            fw, bw = original(gm, joint_inputs, **kwargs)
            self.graphs.append(self._saved(fw, bw))
            self.backward.append(self._ours(fw, bw))
            return fw, bw

        setattr(cfx, name, partition)

    @staticmethod
    def _ours(fw: Any, bw: Any) -> dict[str, Any]:
        """The backward's polykernel custom ops, and the multiplies of a saved output of one of our
        training ops (the ops' ``saved_grads``: Inductor does them in the saved buffer)."""
        import torch

        by_name = {n.name: n for n in fw.graph.nodes}
        ops, scaled = [], []
        for n in bw.graph.nodes:
            if n.op != "call_function":
                continue
            if str(n.target).startswith("polykernel."):
                ops.append(str(n.target))
            elif "mul" in str(n.target) and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder":
                src = by_name.get(n.args[0].name)
                if src is not None and src.op == "call_function" and "getitem" in str(src.target):
                    src = src.args[0]
                if src is not None and str(getattr(src, "target", "")).startswith("polykernel."):
                    scaled.append(f"{src.target} {list(n.args[0].meta['val'].shape)}")
        return {"ops": ops, "scaled_saved": scaled}

    @staticmethod
    def _saved(fw: Any, bw: Any) -> list[dict[str, Any]]:
        import torch

        # The backward's placeholders, past the tangents, are the saved values in order; the
        # forward returns them last. Tensors only (SymInts are saved apart).
        names = [n.name for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
        by_name = {n.name: n for n in fw.graph.nodes}
        out = []
        for name in names:
            node = by_name.get(name)
            val = node.meta.get("val") if node is not None else None
            if not isinstance(val, torch.Tensor):
                continue
            stack = node.meta.get("nn_module_stack") or {}
            where = list(stack.values())[-1][0] if stack else ""
            target = node.target if node.op != "placeholder" else "input"
            if node.op == "call_function" and "getitem" in str(target) and isinstance(node.args[0], torch.fx.Node):
                target = f"{node.args[0].target}[{node.args[1]}]"  # which output of which op (SDPA's, ours)
            out.append({"name": name, "op": str(target), "where": str(where), "shape": list(val.shape), "dtype": str(val.dtype)})
        return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _cpu_memory(prof: Any) -> tuple[int, int]:
    """Bytes live at the backward's start and the peak, from the profiler's allocation events."""
    events = list(prof.profiler.kineto_results.events())
    start = next((e.start_ns() for e in events if e.name() == "compile_saved.backward"), None)
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = held = 0
    for t, delta in mem:
        if start is not None and t >= start and held == 0:
            held = live
        live += delta
        peak = max(peak, live)
    return held, peak


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig

    patch, compiled, _ = VARIANTS[args.child]
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    iconfig.fx_graph_cache = False  # the partition must run, not come from a cache
    if hasattr(fconfig, "enable_autograd_cache"):
        fconfig.enable_autograd_cache = False
    model = _build(args, patch)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where = _Where(model)
    parts = _Partitions()
    run = model
    if compiled:
        parts.install()
        run = torch.compile(model)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    cuda = args.device.startswith("cuda")

    def step() -> None:
        run(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()  # compiles; the second step is the measured one
    first_s = time.perf_counter() - t0
    saved: list[dict[str, Any]] = []
    seen: set[int] = set()

    def pack(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            rec = {"shape": list(t.shape), "dtype": str(t.dtype), "where": where.now(), "param": ptr in params}
            rec["bytes"] = 0 if ptr in seen or rec["param"] or ptr == 0 else st.nbytes()
            rec["view"] = t.numel() * t.element_size() != st.nbytes()
            seen.add(ptr)
            saved.append(rec)
        return t

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    from torch.profiler import ProfilerActivity, profile, record_function

    # CPU: the profiler's allocation events give the step's live bytes over time (Inductor's
    # buffers too); CUDA: the allocator's counters
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) if not cuda else _null() as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = run(input_ids=ids, labels=ids).loss
        held = torch.cuda.memory_allocated() - before if cuda else None
        # tensors an autograd.Function keeps as ctx attributes (not save_for_backward: the hooks
        # miss them; e.g. the fused linear cross-entropy's gradients computed in the forward)
        todo, nodes = [loss.grad_fn], set()
        while todo:
            node = todo.pop()
            if node is None or node in nodes:
                continue
            nodes.add(node)
            todo += [f for f, _ in node.next_functions]
            for attr, val in getattr(node, "__dict__", {}).items():
                for t in val if isinstance(val, (tuple, list)) else (val,):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen | params:
                        seen.add(t.untyped_storage().data_ptr())
                        saved.append({"shape": list(t.shape), "dtype": str(t.dtype), "where": f"ctx.{attr} of {node.name()}",
                                      "param": False, "bytes": t.untyped_storage().nbytes(), "view": False})  # fmt: skip
        with record_function("compile_saved.backward"):
            loss.backward()
    peak = torch.cuda.max_memory_allocated() - before if cuda else None
    if not cuda:
        held, peak = _cpu_memory(prof)
    # name the compiled graphs' saved tensors: the runtime order is the partition's order
    graph_saved = [r for g in parts.graphs for r in g]
    named = False
    if compiled:
        runtime = [
            r for r in saved if r["where"] in ("", "model") and not r["where"].startswith("ctx.")
        ]  # saved by CompiledFunction (outside every module's hooks)
        left = iter(graph_saved)  # same order; a value the graph lists but autograd did not get is skipped
        for r in runtime:
            for g in left:
                if r["shape"] == g["shape"] and r["dtype"] == g["dtype"]:
                    r.update(name=g["name"], op=g["op"], where=g["where"])
                    break
        named = all("name" in r for r in runtime)
    record: dict[str, Any] = {
        "variant": args.child,
        "patch": patch,
        "compiled": compiled,
        "env": VARIANTS[args.child][2],
        "tokens": args.batch * args.seq,
        "first_step_s": first_s,
        "saved": saved,
        "graphs": len(parts.graphs),
        "graph_saved": len(graph_saved),
        "backward_ours": parts.backward,
        "named": named,
        "held_after_forward": held,  # bytes allocated by the forward and alive at its end
        "peak_over_start": peak,  # the step's peak over what was allocated before it
    }
    if patch:
        import polykernel

        record["impls"] = sorted({f"{d['op']}={d['impl']}" for d in polykernel.decisions()})
    return record


# -- parent: run the variants, tabulate ------------------------------------------------------------
def _per_layer(rec: dict[str, Any], layers: int) -> dict[str, Any]:
    by: dict[str, int] = defaultdict(int)
    for r in rec["saved"]:
        by[_layer_of(r["where"])] += r["bytes"]
    layer_bytes = [by.get(f"layer{i}", 0) for i in range(layers)]
    # the first and last layers see the embedding/head; the middle ones are the steady state
    mid = layer_bytes[1:-1] or layer_bytes
    return {
        "by_part": dict(by),
        "layer_bytes": layer_bytes,
        "steady_layer_bytes": sum(mid) / len(mid),
        "total_bytes": sum(by.values()),
    }


def _layer_tensors(rec: dict[str, Any], layer: int) -> list[dict[str, Any]]:
    return [r for r in rec["saved"] if _layer_of(r["where"]) == f"layer{layer}" and r["bytes"]]


def _key(r: dict[str, Any]) -> tuple[int, str]:
    n = 1
    for d in r["shape"]:
        n *= d
    return n, r["dtype"]  # a view's shape may differ ([B, S, F] vs [B*S, F]): match by size


def _unmatched(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tensors of ``ours`` without a counterpart in ``theirs``: same size, dtype and last dim first
    (a view's leading dims may differ: [B, S, H] vs [B*S, H]), then same size and dtype. Bytes are
    exact; which of several equal-size tensors is named is not."""
    left = list(theirs)
    for key in (lambda r: (*_key(r), r["shape"][-1:]), _key):
        rest = []
        for r in ours:
            hit = next((i for i, o in enumerate(left) if key(o) == key(r)), None)
            if hit is None:
                rest.append(r)
            else:
                del left[hit]
        ours = rest
    return ours


def _diff(a: dict[str, Any], b: dict[str, Any], layer: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Tensors of one layer saved by a and not by b, and the reverse."""
    ta, tb = _layer_tensors(a, layer), _layer_tensors(b, layer)
    return _unmatched(ta, tb), _unmatched(tb, ta)


def _label(r: dict[str, Any]) -> str:
    what = (r.get("name") and f"{r['name']} ({r['op']})") or "saved"
    return f"{what:<46} {_role(r['where'])[:34]:<34} {r['shape']!s:<22} {r['dtype'].replace('torch.', ''):<9} {r['bytes'] / 2**10:9.1f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=3, help="at least 3: the middle layers are the steady state")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--target-tokens", type=int, default=4 * 2048, help="issue 14's run: batch 4 x 2048")
    parser.add_argument("--target-layers", type=int, default=16)
    parser.add_argument("--target-hidden", type=int, default=2048)
    parser.add_argument("--only", default=DEFAULT, help=f"'all' or comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--eager-impl", default="triton", help="CPU only: POLYKERNEL_IMPL for polykernel eager ('' = torch)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per child (0: torch's default)")
    parser.add_argument("--timeout", type=int, default=600)
    args = parse(parser, child)
    if args is None:  # a child process: its record is printed
        return
    names = list(VARIANTS) if args.only == "all" else [n for n in args.only.split(",") if n]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        parser.error(f"unknown variants {bad}; known: {list(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    passthrough = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k in ("device", "dtype", "hidden", "intermediate", "heads", "kv_heads", "layers", "vocab", "batch", "seq", "threads")
    ]
    sink = RowFile(args.out / "compile_saved.json", {"args": vars(args) | {"out": str(args.out)}})
    announce(len(names), per_case_s=25 if args.device == "cpu" else 90, what="variants (each its own process)", path=str(sink.path))
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        env = os.environ.copy() | VARIANTS[name][2]
        patch, compiled, _ = VARIANTS[name]
        if patch and not compiled and args.device == "cpu" and args.eager_impl:
            # eager picks the torch impls on CPU, whose autograd saves differ from the GPU's
            # Triton impls (fp32 copies in rms_norm's and rope's references): run the Triton
            # impls in the interpreter, so that eager saves what it saves on the H200
            env |= {"TRITON_INTERPRET": "1", "POLYKERNEL_IMPL": args.eager_impl}
        rec = results[name] = run_child(__file__, name, passthrough, args.timeout, env)
        mib = {k: (rec.get(k) or 0) / 2**20 for k in ("held_after_forward", "peak_over_start")}
        sink.add(
            rec,
            f"{name}: error: {last_error_line(rec)}"
            if "error" in rec
            else f"{name}: held {mib['held_after_forward']:.1f} MiB, peak {mib['peak_over_start']:.1f} MiB over the step's start",
        )
    # bytes per token per layer, scaled to the target run (dtype to bf16, hidden to the target's)
    scale_dtype = 0.5 if args.dtype == "float32" else 1.0
    scale_hidden = args.target_hidden / args.hidden
    lines = [
        f"saved for backward, {args.device} {args.dtype}, hidden {args.hidden}, {args.layers} layers, "
        f"{args.batch}x{args.seq} tokens; scaled to {args.target_tokens} tokens x {args.target_layers} layers, "
        f"hidden {args.target_hidden}, bf16",
        f"{'variant':<34} {'B/token/layer':>13} {'scaled':>9} {'MiB/layer':>10} {'layers GiB':>10} {'head+rest':>10} {'vs pk eager':>12}"
        f" {'held MiB':>9} {'peak MiB':>9} {'peak-held':>9}",
    ]
    summary: dict[str, Any] = {}
    for name, rec in results.items():
        if "error" in rec:
            lines.append(f"{name:<34} error: {last_error_line(rec)}")
            continue
        pl = _per_layer(rec, args.layers)
        per_tok = pl["steady_layer_bytes"] / rec["tokens"]
        scaled = per_tok * scale_dtype * scale_hidden
        rest = (pl["total_bytes"] - sum(pl["layer_bytes"])) / rec["tokens"] * scale_dtype * scale_hidden
        summary[name] = {
            **pl,
            "bytes_per_token_per_layer": per_tok,
            "scaled_bytes_per_token_per_layer": scaled,
            "scaled_mib_per_layer": scaled * args.target_tokens / 2**20,
            "scaled_layers_gib": scaled * args.target_tokens * args.target_layers / 2**30,
            "scaled_rest_gib": rest * args.target_tokens / 2**30,
            "held": rec["held_after_forward"] or 0,
            "peak": rec["peak_over_start"] or 0,
        }
    base = summary.get("polykernel")
    for name, s in summary.items():
        delta = f"{s['scaled_layers_gib'] - base['scaled_layers_gib']:+.2f} GiB" if base else ""
        lines.append(
            f"{name:<34} {s['bytes_per_token_per_layer']:>13.0f} {s['scaled_bytes_per_token_per_layer']:>9.0f} "
            f"{s['scaled_mib_per_layer']:>10.1f} {s['scaled_layers_gib']:>10.2f} {s['scaled_rest_gib']:>9.2f}G {delta:>12}"
            f" {s['held'] / 2**20:>9.2f} {s['peak'] / 2**20:>9.2f} {(s['peak'] - s['held']) / 2**20:>9.2f}"
        )
    layer = 1 if args.layers >= 3 else 0
    diffs: dict[str, Any] = {}
    for a, b in PAIRS:
        if a not in summary or b not in summary:
            continue
        only_a, only_b = _diff(results[a], results[b], layer)
        diffs[f"{a} vs {b}"] = {"only_" + a: only_a, "only_" + b: only_b}
        tok = results[b]["tokens"]
        for side, rows in ((b, only_b), (a, only_a)):
            total = sum(r["bytes"] for r in rows)
            lines.append(
                f"\nlayer {layer}: saved by {side} and not by {a if side == b else b}: {len(rows)} tensors, "
                f"{total / tok:.0f} B/token ({total / tok * scale_dtype * scale_hidden * args.target_tokens / 2**20:.1f} MiB/layer scaled)"
            )
            lines += [f"  {_label(r)}" for r in sorted(rows, key=lambda r: -r["bytes"])[:12]]
    for name, rec in results.items():
        if "error" in rec or not rec["compiled"]:
            continue
        for i, ours in enumerate(rec.get("backward_ours", ())):
            counts: dict[str, int] = defaultdict(int)
            for o in ours["ops"]:
                counts[o.removeprefix("polykernel.")] += 1
            lines.append(
                f"\n{name}: backward graph {i} runs {dict(counts)}; multiplies saved {ours['scaled_saved'] or 'nothing'} in the graph"
            )
        lines.append(f"\n{name}: {rec['graphs']} graph(s), {rec['graph_saved']} saved values named: {rec['named']}; layer {layer} saves:")
        lines += [f"  {_label(r)}" for r in sorted(_layer_tensors(rec, layer), key=lambda r: -r["bytes"])]
    for name in ("polykernel",):
        if name in results and "error" not in results[name]:
            lines.append(f"\n{name}: layer {layer} saves:")
            lines += [f"  {_label(r)}" for r in sorted(_layer_tensors(results[name], layer), key=lambda r: -r["bytes"])]
    lines.append(
        "\nheld/peak: measured bytes at this run's shape (not scaled; the peak includes the parameters' "
        "gradients): live after the forward, and the step's peak, over the step's start. On CPU they show the CPU "
        "impls' temporaries (fp32 logits in the loss; the Triton interpreter keeps launch arguments alive), "
        "so compare them on CUDA only"
    )
    text = "\n".join(lines)
    print(text)
    (args.out / "compile_saved.txt").write_text(text + "\n")
    sink.finish(summary=summary, diffs=diffs)


if __name__ == "__main__":
    main()
