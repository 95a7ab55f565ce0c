"""``polykernel demo``'s command line (also ``python -m polykernel.tools.demo``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import IO, TYPE_CHECKING

import torch

from polykernel.tools import options
from polykernel.tools.console import make_console, progress
from polykernel.tools.rows import load

from .data import SETUPS
from .models import VARIANTS, model_kind, parse_compare
from .plots import check_result
from .report import ok_line, op_table, print_op_table, print_platform, print_result
from .runs import model_shape, run_demo, run_worker

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["build_parser", "main"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(options.device(name))
    except ValueError as exc:  # a name torch does not know, a device this machine does not have
        raise SystemExit(f"polykernel demo: {exc}") from None
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise SystemExit(f"polykernel demo: unknown --dtype {name!r}; use auto, float32, bfloat16 or float16") from None


def resolve_size(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= 60 * 2**30:
        return "medium"
    return "small" if device.type == "cuda" else "tiny"


def build_parser(prog: str = "polykernel demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Show which kernels run here, then train the same Llama with plain PyTorch, polykernel, "
        "Liger-Kernel and torch.compile, side by side, and compare.",
    )
    p.add_argument("--steps", type=options.positive_int, default=None, help="training steps per run (default 20 at --size medium, else 30)")
    p.add_argument("--size", choices=["auto", *SETUPS], default="auto",
                   help="model size (default: tiny on CPU, medium on a GPU with >= 60 GiB, else small)")  # fmt: skip
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16 or float16")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initial weights (default 0)")
    p.add_argument("--batch", type=options.positive_int, default=None, help="override the size's batch")
    p.add_argument("--seq-len", type=options.positive_int, default=None, help="override the size's sequence length")
    p.add_argument("--lr", type=options.positive_float, default=None, help="override the size's learning rate")
    p.add_argument("--compare", default=None, metavar="RUNS",
                   help=f"comma-separated runs from {','.join(VARIANTS)} (default: torch,polykernel; on CUDA also liger "
                   "when installed and compile; torch.compile is left out on the CPU, where compiling the model takes "
                   "longer than the whole tiny demo)")  # fmt: skip
    p.add_argument("--model", choices=["auto", "hf", "builtin"], default="auto",
                   help="hf: a transformers Llama built from a config (default when transformers is installed); "
                   "builtin: polykernel.tools.models.llama")  # fmt: skip
    p.add_argument("--isolate", action="store_true", help="run each contender in its own process (clean peak memory; for GPU figures)")
    p.add_argument("--loss", choices=["fused", "logits"], default="fused",
                   help="polykernel loss: fused linear CE (default) or CE on materialized logits")  # fmt: skip
    p.add_argument("--threads", type=options.positive_int, default=None,
                   help="CPU threads (default: 1 for --size tiny on the CPU, whose ops are too small to gain from more "
                   "and which OpenMP spin-waits slow down badly when other processes share the cores; else torch's default)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    p.add_argument(
        "--plot", metavar="FILE.png", default=None, help="draw loss per step and tokens/s per run (the 'plot' extra: matplotlib)"
    )
    p.add_argument("--load", metavar="DEMO.json", default=None, help="no training: read a --json result (e.g. to --plot it elsewhere)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--worker", metavar="PATH", default=None, help=argparse.SUPPRESS)  # --isolate's child: one run -> PATH
    return p


def main(argv: list[str] | None = None, *, out: IO[str] | None = None, console: Console | None = None) -> int:
    """Run the demo; 0 when every run's losses agree with plain PyTorch's and the loss fell, 1 otherwise.

    >>> main(["--device", "cpu", "--steps", "12"])  # doctest: +SKIP
    0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    con = console or make_console(out)
    if args.plot:
        from polykernel.tools.plotting import require_matplotlib

        try:
            require_matplotlib("polykernel demo --plot")  # before training, not after it
        except ImportError as exc:
            raise SystemExit(str(exc)) from None
    if args.load:
        if not args.plot:  # nothing else reads a saved result: say so rather than do nothing
            raise SystemExit("polykernel demo: --load reads a saved result to plot it: add --plot FILE.png")
        trained = [a.dest for a in parser._actions if a.dest not in ("help", "load", "plot", "no_progress")]
        try:
            if options.given(args, parser, trained):
                raise ValueError(f"--load reads a saved result; {options.given(args, parser, trained)} applies to training only")
            options.writable_file(args.plot, "--plot")
            result = check_result(load(args.load), args.load)
        except ValueError as exc:
            raise SystemExit(f"polykernel demo: {exc}") from None
        _plot(result, args.plot, con)
        return 0
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    size = resolve_size(args.size, device)
    steps = args.steps if args.steps is not None else (20 if size == "medium" else 30)
    for option in ("--json", "--plot"):  # checked now: they are written after the training
        path = getattr(args, option[2:])
        try:
            if path:
                options.writable_file(path, option)
        except ValueError as exc:
            raise SystemExit(f"polykernel demo: {exc}") from None
    threads_before = torch.get_num_threads()
    threads = args.threads or (1 if device.type == "cpu" and size == "tiny" else None)
    if threads:
        torch.set_num_threads(threads)
    try:
        kind = model_kind(args.model)
        if args.worker:
            return run_worker(args.compare, args.worker, steps=steps, size=size, device=device, dtype=dtype, seed=args.seed,
                              batch=args.batch, seq_len=args.seq_len, lr=args.lr, fused_loss=args.loss == "fused", model=kind)  # fmt: skip
        names = parse_compare(args.compare, device, kind)
        return _main(args, con, device, dtype, size, steps, kind, names)
    except ValueError as exc:  # bad option combinations: one line, before anything trains
        raise SystemExit(str(exc)) from None
    finally:
        torch.set_num_threads(threads_before)


def _main(
    args: argparse.Namespace, con: Console, device: torch.device, dtype: torch.dtype, size: str, steps: int, kind: str, names: list[str]
) -> int:
    print_platform(con, device)
    print_op_table(con, op_table(device, dtype), device, dtype)
    shape = model_shape(size)
    setup = SETUPS[size]
    b, t = args.batch or setup.batch, args.seq_len or setup.seq_len
    params = _parameters(shape)
    con.print(
        f"\ntraining: size {size}, {'a transformers' if kind == 'hf' else 'the built-in'} Llama ({params / 1e6:,.1f}M parameters: "
        f"{shape['num_layers']} layers, hidden {shape['hidden_size']}, {shape['num_heads']}/{shape['num_kv_heads']} heads, "
        f"vocab {shape['vocab_size']}{', tied embeddings' if shape['tie_embeddings'] else ''}), batch {b} x {t} tokens, {steps} steps, "
        f"{str(dtype).removeprefix('torch.')}, seed {args.seed}; runs: {', '.join(names)}"
    )
    con.print("  data: a fixed random Markov chain (synthetic, learnable); same batches, seed and initial weights for every run")
    with progress(con) as bar:
        tasks = {}
        show = not args.no_progress

        def on_step(name: str, step: int, loss: float) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=steps, visible=show)
            bar.update(tasks[name], completed=step, description=f"{name:<10} loss {loss:7.4f}")

        res = run_demo(
            steps=steps, size=size, device=device, dtype=dtype, seed=args.seed, batch=args.batch, seq_len=args.seq_len,
            lr=args.lr, fused_loss=args.loss == "fused", compare=names, model=kind, isolate=args.isolate, on_step=on_step,
        )  # fmt: skip
    print_result(con, res)
    data = res.as_dict()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        con.print(f"wrote {args.json}")
    if args.plot:
        _plot(data, args.plot, con)
    problems = [f"the {name} run failed" for name in res.failed]
    differ = [r.label for r in res.runs if not res.agrees(r)]
    if differ:
        problems.append(f"the losses of {', '.join(differ)} differ from plain PyTorch's beyond {res.tolerance_text}")
    if not res.learned and steps >= 10:
        problems.append("the loss did not fall by 10%")
    if problems:
        con.print("\nPROBLEM: " + "; ".join(problems))
        return 1
    con.print("\n" + ok_line(res))
    return 0


def _parameters(shape: dict) -> int:
    from polykernel.tools.models import LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in shape.items() if k != "preset"})
    return cfg.num_parameters()


def _plot(result: dict, path: str, con: Console) -> None:
    from .plots import plot_demo

    plot_demo(result, path)
    con.print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
