"""One data-parallel training step of the demo model, with and without polykernel, compared.

For each mode (``ddp``: ``DistributedDataParallel``; ``fsdp2``: ``torch.distributed.fsdp.fully_shard``
on every decoder layer and the root) and dtype, every rank builds the model twice from the same
seed (polykernel path and plain-torch path), wraps both the same way, runs forward, backward, an
optimizer step and a second forward on its own shard of one global batch, and reports:

- the global (rank-averaged) loss of both paths, before and after the optimizer step;
- the worst relative gradient difference between the paths (full, unsharded gradients);
- how far the plain-torch distributed gradients are from a single-process full-batch step (so
  the gradients really were averaged across ranks), and whether every rank holds the same ones.

Run it on two GPUs (NCCL) or on the CPU (gloo)::

    python -m polykernel.tools.models.distributed --nproc 2                 # nccl if 2 GPUs, else gloo
    python -m polykernel.tools.models.distributed --nproc 2 --backend gloo --dtype float32

NVLink SHARP / multicast paths are turned off in the workers (``SAFE_ENV``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from ... import _compat
from .llama import LlamaConfig, LlamaForCausalLM

__all__ = ["MODES", "SAFE_ENV", "TOLERANCES", "StepReport", "problems", "run_worker", "spawn"]

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MODES = ("ddp", "fsdp2")  # and "local": unwrapped, each rank alone (a control that must fail)

# The model the checks train: small enough for two CPU processes in seconds.
CHECK_CONFIG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64)

# (loss, gradient) tolerances, relative. fp32: both paths compute in fp32 and differ only in
# reduction order (1e-6-ish; 1e-4 leaves room for Triton vs cuBLAS-free eager chains on a GPU).
# bf16: activations round to 8 bits at every op, differently per path.
TOLERANCES = {"float32": (1e-5, 1e-4), "bfloat16": (2e-2, 6e-2), "float16": (5e-3, 2e-2)}


@dataclass
class StepReport:
    mode: str
    dtype: str
    backend: str
    world_size: int
    loss_polykernel: float
    loss_torch: float
    loss_full_batch: float  # single process, whole global batch, plain torch
    loss_after_step_polykernel: float
    loss_after_step_torch: float
    grad_diff: float  # worst over parameters of max|g_pk - g_torch| / max|g_torch|
    grad_diff_param: str
    full_batch_grad_diff: float  # same, distributed plain torch vs the single-process step
    ranks_agree: bool  # every rank holds the same full gradients
    impls: dict[str, str]  # op id -> impl the polykernel path used (rank 0)


def problems(r: StepReport | dict[str, Any]) -> list[str]:
    """What is out of tolerance in a report (empty when all is well)."""
    d = dataclasses.asdict(r) if isinstance(r, StepReport) else r
    loss_tol, grad_tol = TOLERANCES[d["dtype"]]
    out = []

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-12)

    if not rel(d["loss_polykernel"], d["loss_torch"]) <= loss_tol:
        out.append(f"loss {d['loss_polykernel']:.7g} (polykernel) vs {d['loss_torch']:.7g} (torch)")
    if not rel(d["loss_after_step_polykernel"], d["loss_after_step_torch"]) <= 2 * loss_tol:
        out.append(f"loss after the step {d['loss_after_step_polykernel']:.7g} vs {d['loss_after_step_torch']:.7g}")
    if not d["grad_diff"] <= grad_tol:
        out.append(f"gradients differ by {d['grad_diff']:.3g} (relative) at {d['grad_diff_param']}")
    if not rel(d["loss_torch"], d["loss_full_batch"]) <= loss_tol:
        out.append(f"distributed loss {d['loss_torch']:.7g} vs single-process full batch {d['loss_full_batch']:.7g}")
    if not d["full_batch_grad_diff"] <= grad_tol:
        out.append(f"distributed gradients differ from the full-batch step by {d['full_batch_grad_diff']:.3g}: not averaged across ranks?")
    if not d["ranks_agree"]:
        out.append("ranks hold different gradients")
    return out


# ------------------------------------------------------------------------------------------------
# In each worker process


def _fully_shard() -> Any:
    return _compat.fully_shard()


def _wrap(model: torch.nn.Module, mode: str, device: torch.device) -> torch.nn.Module:
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard = _fully_shard()
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if mode == "local":  # the control: no data parallelism, so the full-batch check must fail
        return model
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            raise RuntimeError(f"no gradient for {name}")
        if hasattr(g, "full_tensor"):  # FSDP2: a sharded DTensor
            g = g.full_tensor()
        out[name.removeprefix("module.")] = g.detach().float().clone()
    return out


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, gb in b.items():
        err = ((a[name] - gb).abs().max() / gb.abs().max().clamp_min(1e-12)).item()
        if not err <= worst:  # NaN wins
            worst, where = err, name
    return worst, where


def _mean_over_ranks(x: torch.Tensor) -> float:
    t = x.detach().float().reshape(1).clone()
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()


def _step(mode: str, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device, seed: int, batch: int, seq: int) -> StepReport:
    import polykernel

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (world * batch, seq + 1), generator=g).to(device)
    mine = tokens[rank * batch : (rank + 1) * batch]

    results: dict[bool, tuple[float, dict[str, torch.Tensor], float]] = {}
    polykernel.clear_caches()
    for use_pk in (True, False):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg, use_polykernel=use_pk, device=device).to(dtype)
        wrapped = _wrap(model, mode, device)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
        loss = wrapped(mine[:, :-1], targets=mine[:, 1:])
        loss.backward()
        grads = _full_grads(wrapped)
        loss_global = _mean_over_ranks(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss2 = _mean_over_ranks(wrapped(mine[:, :-1], targets=mine[:, 1:]))
        results[use_pk] = (loss_global, grads, loss2)
        if use_pk:
            impls = {op: d for op, d in _used_impls().items()}
        del wrapped, model, opt

    # single process, whole global batch, plain torch: what data parallelism must reproduce
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(cfg, use_polykernel=False, device=device).to(dtype)
    ref_loss = ref(tokens[:, :-1], targets=tokens[:, 1:])
    ref_loss.backward()
    ref_grads = _full_grads(ref)

    grad_diff, where = _worst(results[True][1], results[False][1])
    full_diff, _ = _worst(results[False][1], ref_grads)
    # every rank must hold the same full gradients: compare a fingerprint across ranks
    fp = torch.stack(
        [results[True][1][n].double().sum() for n in sorted(ref_grads)] + [results[False][1][n].double().sum() for n in sorted(ref_grads)]
    )
    gathered = [torch.empty_like(fp) for _ in range(world)]
    torch.distributed.all_gather(gathered, fp)
    agree = all(torch.equal(gathered[0], x) for x in gathered)
    return StepReport(
        mode=mode,
        dtype=str(dtype).removeprefix("torch."),
        backend=torch.distributed.get_backend(),
        world_size=world,
        loss_polykernel=results[True][0],
        loss_torch=results[False][0],
        loss_full_batch=ref_loss.item(),
        loss_after_step_polykernel=results[True][2],
        loss_after_step_torch=results[False][2],
        grad_diff=grad_diff,
        grad_diff_param=where,
        full_batch_grad_diff=full_diff,
        ranks_agree=agree,
        impls=impls,
    )


def _used_impls() -> dict[str, str]:
    from ..demo import used_impls

    return {r["op"]: r["impl"] for r in used_impls()}


def run_worker(
    rank: int,
    world: int,
    backend: str,
    init_file: str,
    modes: list[str],
    dtypes: list[str],
    result_file: str,
    interpret: bool = False,
    config: dict[str, Any] | None = None,
    batch: int = 2,
    seq: int = 32,
    seed: int = 0,
) -> None:
    """The body of one rank (the target of ``torch.multiprocessing`` spawn)."""
    os.environ.update(SAFE_ENV)
    if not interpret:
        os.environ.pop("TRITON_INTERPRET", None)  # the CPU runs the torch impls, as users get
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    torch.distributed.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    try:
        cfg = dataclasses.replace(CHECK_CONFIG, **(config or {}))
        if seq > cfg.max_seq_len:
            cfg = dataclasses.replace(cfg, max_seq_len=seq)
        reports = []
        for dtype_name in dtypes:
            for mode in modes:
                reports.append(dataclasses.asdict(_step(mode, cfg, getattr(torch, dtype_name), device, seed, batch, seq)))
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump(reports, f)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def spawn(
    nproc: int = 2,
    backend: str | None = None,
    modes: tuple[str, ...] = MODES,
    dtypes: tuple[str, ...] = ("float32",),
    *,
    interpret: bool = False,
    config: dict[str, Any] | None = None,
    batch: int = 2,
    seq: int = 32,
) -> list[dict[str, Any]]:
    """Start ``nproc`` processes (``torch.multiprocessing``, spawn), run the checks, return rank 0's
    reports (one dict per dtype and mode, the fields of :class:`StepReport`)."""
    import torch.multiprocessing as mp

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"
    for k, v in SAFE_ENV.items():  # also in the parent: children inherit it before any import
        os.environ.setdefault(k, v)
    with tempfile.TemporaryDirectory(prefix="polykernel-dist-") as tmp:
        init_file, result_file = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        mp.start_processes(
            run_worker,
            args=(nproc, backend, init_file, list(modes), list(dtypes), result_file, interpret, config, batch, seq),
            nprocs=nproc,
            join=True,
            start_method="spawn",
        )
        with open(result_file) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polykernel.tools.models.distributed", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl with enough GPUs, else gloo")
    p.add_argument("--mode", default=",".join(MODES), help="comma-separated: ddp, fsdp2, local (control)")
    p.add_argument("--dtype", default=None, help="comma-separated (default: float32,bfloat16 on GPUs, float32 on the CPU)")
    args = p.parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc else "gloo")
    dtypes = tuple(args.dtype.split(",")) if args.dtype else (("float32", "bfloat16") if backend == "nccl" else ("float32",))
    reports = spawn(args.nproc, backend, tuple(args.mode.split(",")), dtypes)
    bad = 0
    for r in reports:
        issues = problems(r)
        bad += bool(issues)
        status = "ok" if not issues else "FAIL: " + "; ".join(issues)
        print(
            f"{r['mode']:<6} {r['dtype']:<9} {r['backend']} x{r['world_size']}: loss {r['loss_polykernel']:.6f} (polykernel) "
            f"{r['loss_torch']:.6f} (torch) {r['loss_full_batch']:.6f} (1 process); grad diff {r['grad_diff']:.2e}; {status}"
        )
        print(f"       impls: {', '.join(f'{k}={v}' for k, v in sorted(r['impls'].items()))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
