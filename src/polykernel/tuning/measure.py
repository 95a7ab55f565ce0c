"""Measuring impls for one key, and choosing among them (the cost model and the margin rule).

:func:`measure` runs every candidate on fresh clones of the real arguments (an impl may write its
inputs): parity with the op's float64 reference first, within the op's error model (the bounds
``polykernel.testing`` holds every impl to; a wrong impl gets no time, so it never wins), then
timing (:class:`polykernel.timing.Timer`). On CUDA: CUDA events around each call with L2 flushed
before it and the GPU held busy while the host issues the call, so the events time the GPU work
alone and not the host's launch gaps; candidates interleaved round by round, the median of each,
plus the host time per call (``perf_counter`` around the launch). On the CPU: wall time,
interleaved, median. An impl that
raises (or runs out of memory) at any point costs infinity. With ``needs_grad`` the time is of
forward plus backward (``torch.autograd.grad`` of every output with a fixed cotangent).

:func:`choose` applies the cost model: under CUDA-graph capture only GPU time counts (the host
work is replayed for free); eagerly the call costs ``max(GPU time, host time)``. A winner must be
cheaper than the best static (rank-order) choice by ``margin``, else the static choice stays.

An impl that compiles once per process (``torch_compile``: :data:`PER_PROCESS_COMPILE`) has its
compile measured too (``compile_ms``: its first call's time beyond a steady call, or what the impl
itself reports having paid, the larger) and charged per call as if spread over ``calls`` calls of
the key (``POLYKERNEL_TUNE_CALLS``): a key called once never picks it; a long-running process that
calls it often may. Impls whose builds are cached on disk (Triton, ``cuda_jit``) are not charged.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import spec as spec_mod
from .. import timing
from ..core import registry

if TYPE_CHECKING:
    from ..core.errormodel import Bounds, Tol
    from ..core.protocols import OpLike

# Per key: at most this many timed rounds (each round runs every candidate once), at least
# MIN_REPS, and no more rounds than fit in BUDGET_S once the first round has been timed.
REPS = {"cuda": 25, "cpu": 7}
MIN_REPS = 3
BUDGET_S = {"cuda": 1.0, "cpu": 0.4}
# GPU cycles to spin before each timed call, so that the whole call is queued before the start
# event runs (~1 ms at H200 clocks: more than any op's host time per call in benchmarks/
# host_profile.py). Without it the events also count the GPU's idle gaps while the host
# launches, so an impl with a costlier launch looks slower on the GPU than it is: the likely
# cause of the H200 sweep's (2026-11-30) picks that lost to the graph-fastest impl by 6-20%
# (QuACK vs cute_dsl/Triton at small rows). With it, the next sweep held 54 of 54 points within
# 5% of the fastest (benchmarks/results/h200-2026-11-30-sweep-tuning.json).
HOLD_CYCLES = 2_000_000
# Backends that compile again in every process (Dynamo traces, Inductor generates): their
# measured compile time is part of their cost (see the module doc).
PER_PROCESS_COMPILE = frozenset({spec_mod.KernelBackend.TORCH_COMPILE})


@dataclass
class Timing:
    """One impl's measurement for a key (milliseconds); ``error`` set means infinitely slow.
    ``compile_ms``: what its per-process compile costs (None: it has none)."""

    gpu_ms: float | None = None
    host_ms: float | None = None
    error: str | None = None
    compile_ms: float | None = None

    def cost(self, graph: bool, calls: float = math.inf) -> float:
        """Per call: the steady time (see the module doc), plus the compile spread over ``calls``."""
        if self.error is not None or self.host_ms is None:
            return math.inf
        if self.gpu_ms is None:  # CPU: wall time is all there is
            steady = self.host_ms
        else:
            steady = self.gpu_ms if graph else max(self.gpu_ms, self.host_ms)
        return steady + (self.compile_ms / calls if self.compile_ms else 0.0)

    def as_json(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": self.error}
        out = {"gpu_ms": self.gpu_ms, "host_ms": self.host_ms}
        if self.compile_ms is not None:
            out["compile_ms"] = self.compile_ms
        return out

    @staticmethod
    def from_json(value: Any) -> Timing:
        if not isinstance(value, dict) or value.get("error") is not None:
            return Timing(error=str(value.get("error")) if isinstance(value, dict) else "malformed")

        def num(x: Any) -> float | None:
            return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None

        return Timing(num(value.get("gpu_ms")), num(value.get("host_ms")), compile_ms=num(value.get("compile_ms")))


class ReferenceFailed(Exception):
    """The op's reference or error model failed on these arguments: nothing can be checked, so
    nothing is measured or stored."""


# -- choosing ----------------------------------------------------------------------------------


def _pick(times: dict[str, Timing], names: Sequence[str], graph: bool, margin: float, calls: float) -> str | None:
    if not names:
        return None
    static = names[0]
    best = min(names, key=lambda n: (times[n].cost(graph, calls) if n in times else math.inf, names.index(n)))
    best_cost = times[best].cost(graph, calls) if best in times else math.inf
    static_cost = times[static].cost(graph, calls) if static in times else math.inf
    if math.isinf(best_cost) or best == static:
        return static
    if math.isinf(static_cost) or best_cost < static_cost * (1.0 - margin):
        return best
    return static


def choose(
    times: dict[str, Timing], order: Sequence[str], graph_safe: Sequence[str], margin: float, calls: float = math.inf
) -> dict[str, Any]:
    """The store entry for a measured key: the eager and the graph choice, with every time.

    ``order`` is the static (rank) order of the candidates: its first is the static choice.
    ``calls``: how many calls a per-process compile is spread over (see the module doc).
    """
    order = list(order)
    graph_names = [n for n in order if n in set(graph_safe)]
    entry = {
        "eager": _pick(times, order, False, margin, calls),
        "graph": _pick(times, graph_names, True, margin, calls),
        "static": order[0] if order else None,
        "margin": margin,
        "times": {n: times[n].as_json() for n in order if n in times},
    }
    if any(times[n].compile_ms for n in order if n in times):
        entry["calls"] = calls
    return entry


def slowest(measurements: Sequence[dict[str, Timing]]) -> dict[str, Timing]:
    """Per impl, the slowest of several ranks' times (an error anywhere is an error)."""
    out: dict[str, Timing] = {}
    for times in measurements:
        for name, t in times.items():
            prev = out.get(name)
            if prev is None:
                out[name] = Timing(t.gpu_ms, t.host_ms, t.error, t.compile_ms)
            elif prev.error is None:
                if t.error is not None:
                    out[name] = Timing(error=t.error)
                else:
                    gpu = None if prev.gpu_ms is None or t.gpu_ms is None else max(prev.gpu_ms, t.gpu_ms)
                    host = None if prev.host_ms is None or t.host_ms is None else max(prev.host_ms, t.host_ms)
                    compiles = [c for c in (prev.compile_ms, t.compile_ms) if c is not None]
                    out[name] = Timing(gpu, host, compile_ms=max(compiles) if compiles else None)
    return out


# -- measuring ---------------------------------------------------------------------------------


def _clone(a: Any, grad: bool) -> Any:
    """A fresh leaf with the same shape, strides (where possible), dtype and device."""
    if not isinstance(a, torch.Tensor):
        return a
    with torch.no_grad():
        try:
            c = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
            c.copy_(a.detach())
        except RuntimeError:  # overlapping strides (expand): a dense copy
            c = a.detach().clone(memory_format=torch.contiguous_format)
    return c.requires_grad_(grad and a.requires_grad and (a.is_floating_point() or a.is_complex()))


def _outputs(out: Any) -> tuple[Any, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class _Bounds:
    """The op's error model for one call (``op.error_model``, the bounds ``polykernel.testing``
    checks against a float64 reference), with each candidate's rounding rule."""

    def __init__(self, op: OpLike, args: tuple[Any, ...], device: torch.device) -> None:
        try:
            self.model: Bounds = op.error_model(*args)
        except Exception as exc:  # nothing to check against: the caller does not tune this key
            raise ReferenceFailed(f"the op's error model failed: {_error(exc)}") from exc
        specs = registry.specs_for(op)
        # Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest: one ulp,
        # not half, for the impls that run through it (as polykernel.testing counts it).
        interpret = spec_mod.triton_interpret_allows(spec_mod.PlatformInfo.detect(device))
        truncating = (spec_mod.KernelBackend.TRITON, spec_mod.KernelBackend.LIGER)
        self.rounding = {name: 2.0 if interpret and s.backend in truncating else 1.0 for name, s in specs.items()}

    def fwd(self, name: str, k: int, dtype: torch.dtype, scale: float) -> Tol:
        return self.model.output(k).tol(dtype, scale, self.rounding.get(name, 1.0))

    def bwd(self, name: str, i: int, dtype: torch.dtype, scale: float) -> Tol:
        return self.model.grads[i].tol(dtype, scale, self.rounding.get(name, 1.0))


def _exact(a: Any) -> Any:
    """A float64 copy of a floating leaf (the reference then stands for the exact result)."""
    if not isinstance(a, torch.Tensor) or not a.is_floating_point():
        return a
    return a.detach().to(torch.float64).requires_grad_(a.requires_grad)


def _mismatch(out: Any, want: Any, ref: Any, tol: Callable[[float], Tol]) -> str | None:
    """Why ``out`` fails: shape/dtype of ``want`` (the contract), values within ``tol`` of the
    float64 ``ref``; NaN/inf must match ``ref`` rounded to the output dtype (as in testing)."""
    if not isinstance(want, torch.Tensor):
        return None
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    if out.shape != want.shape or out.dtype != want.dtype:
        return f"returned {out.dtype} {tuple(out.shape)}, reference {want.dtype} {tuple(want.shape)}"
    if out.numel() == 0:
        return None
    o, r = out.detach().double(), ref.detach().double()
    rounded = r.to(out.dtype).double()
    o_bad, r_bad = ~torch.isfinite(o), ~torch.isfinite(rounded)
    if not torch.equal(o_bad, r_bad) or not torch.equal(o[o_bad].nan_to_num(), rounded[r_bad].nan_to_num()):
        return "non-finite values differ from the reference"
    ok = ~r_bad
    if not ok.any():
        return None
    r_ok = r[ok]
    t = tol(r_ok.abs().max().item())
    worst = ((o[ok] - r_ok).abs() / (t.atol + t.rtol * r_ok.abs())).max().item()
    return None if worst <= 1.0 else f"differs from the reference ({worst:.3g}x tolerance)"


class _Runner:
    """One forward (or forward + backward) of a callable on fresh clones of the arguments."""

    def __init__(self, args: tuple[Any, ...], needs_grad: bool) -> None:
        self.args = args
        self.needs_grad = needs_grad
        self.cotangents: list[Any] = []

    def prepare(self) -> tuple[Any, ...]:
        return tuple(_clone(a, self.needs_grad) for a in self.args)

    def __call__(
        self, fn: Callable[..., Any], a: tuple[Any, ...], cotangents: list[Any] | None = None
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        if not self.needs_grad:
            with torch.no_grad():
                return _outputs(fn(*a)), ()
        cots = self.cotangents if cotangents is None else cotangents
        with torch.enable_grad():
            outs = _outputs(fn(*a))
            pairs = [(o, c) for o, c in zip(outs, cots) if c is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            leaves = [x for x in a if isinstance(x, torch.Tensor) and x.requires_grad]
            if not pairs or not leaves:
                return outs, ()
            grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)
        return outs, grads


def _error(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "out of memory"
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"raised {type(exc).__name__}: {first}"[:300]


def _written(op: OpLike) -> list[int]:
    """The positions of the arguments an op writes (``Op.writes``), in the order of its outputs."""
    params = list(inspect.signature(op.reference).parameters)
    return [params.index(w) for w in getattr(op, "writes", ())]


def _parity(
    runner: _Runner, name: str, fn: Callable[..., Any], ref: tuple[Any, ...], bounds: _Bounds, written: Sequence[int] = ()
) -> str | None:
    """None when ``fn`` matches the reference (forward, and gradients when timed with backward).
    ``written``: the positions an op writes (its outputs, in order): those clones must hold them."""
    want, ref_out, ref_grads, leaf_pos = ref
    a = runner.prepare()
    outs, grads = runner(fn, a)
    if len(outs) != len(want):
        return f"returned {len(outs)} outputs, reference {len(want)}"
    for k, (o, w, r) in enumerate(zip(outs, want, ref_out)):
        why = _mismatch(o, w, r, functools.partial(bounds.fwd, name, k, getattr(w, "dtype", None)))
        if why:
            return why
    # An in-place or out= op's caller reads its results from the destinations, not only the
    # returned tensors: an impl that returns right values but leaves them unwritten is wrong.
    for k, pos in enumerate(written):
        why = _mismatch(a[pos], want[k], ref_out[k], functools.partial(bounds.fwd, name, k, getattr(want[k], "dtype", None)))
        if why:
            return f"argument {pos} not written as the reference writes it ({why})"
    if len(grads) != len(ref_grads):
        return "gradients missing"
    for pos, g, r in zip(leaf_pos, grads, ref_grads):
        if r is None:
            continue
        if g is None:
            return f"no gradient for argument {pos}"
        why = _mismatch(g, a[pos], r, functools.partial(bounds.bwd, name, pos, a[pos].dtype))
        if why:
            return f"grad {pos}: {why}"
    return None


def measure(
    op: OpLike, candidates: dict[str, Callable[..., Any]], args: tuple[Any, ...], dtype: Any, needs_grad: bool
) -> dict[str, Timing]:
    """Parity, then timing, of every candidate on clones of ``args`` (see the module doc)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)  # the caller's RNG stream is left alone

    # The reference in float64 (the exact result, held to the op's error model), and a fixed
    # cotangent in [-1, 1) per differentiable output (error models count on |dy| <= 1).
    runner = _Runner(args, needs_grad)
    bounds = _Bounds(op, args, device)
    try:
        ref_args = tuple(_exact(a) for a in runner.prepare())
        with torch.no_grad():
            want = _outputs(op.reference(*runner.prepare()))  # the contract's shapes and dtypes
        with torch.enable_grad() if needs_grad else torch.no_grad():
            ref_out = _outputs(op.reference(*ref_args))
        runner.cotangents = [
            (2 * torch.rand(w.shape, generator=gen, device=w.device, dtype=torch.float32) - 1).to(w.dtype)
            if needs_grad and isinstance(w, torch.Tensor) and w.is_floating_point() and isinstance(r, torch.Tensor) and r.requires_grad
            else None
            for w, r in zip(want, ref_out)
        ]
        ref_grads: tuple[Any, ...] = ()
        leaf_pos = [i for i, a in enumerate(ref_args) if isinstance(a, torch.Tensor) and a.requires_grad]
        pairs = [(r, c) for r, c in zip(ref_out, runner.cotangents) if c is not None]
        if needs_grad and pairs and leaf_pos:
            ref_cots = [c.to(r.dtype) for r, c in pairs]
            ref_grads = torch.autograd.grad([r for r, _ in pairs], [ref_args[i] for i in leaf_pos], ref_cots, allow_unused=True)
        ref = (want, tuple(r.detach() if isinstance(r, torch.Tensor) else r for r in ref_out), ref_grads, leaf_pos)
    except Exception as exc:
        raise ReferenceFailed(_error(exc)) from exc
    missing = [i for i, g in zip(leaf_pos, ref_grads) if g is not None and i not in bounds.model.grads]
    if missing:  # an op whose error model lacks a gradient's bound: nothing to hold impls to
        raise ReferenceFailed(f"the op's error model has no bound for the gradient of argument {missing[0]}")

    times: dict[str, Timing] = {}
    live: list[str] = []
    specs = registry.specs_for(op)
    first_ms: dict[str, float] = {}  # per-process compilers: their first call, which compiles
    written = _written(op)
    for name, fn in candidates.items():  # parity first (this also warms each candidate up)
        t0 = timing.now()
        try:
            why = _parity(runner, name, fn, ref, bounds, written)
        except Exception as exc:
            why = _error(exc)
        if name in specs and specs[name].backend in PER_PROCESS_COMPILE:
            first_ms[name] = (timing.now() - t0) * 1e3
        if why is not None:
            times[name] = Timing(error=why if why.startswith(("raised", "out of")) else f"parity: {why}")
        else:
            live.append(name)
    del ref, ref_args, ref_out, want
    if cuda:
        torch.cuda.synchronize(device)

    samples: dict[str, list[timing.Sample]] = {n: [] for n in live}
    timer = timing.Timer(device, hold_cycles=HOLD_CYCLES)
    kind = "cuda" if cuda else "cpu"
    rounds, started = REPS[kind] + 1, timing.now()
    r = 0
    while r < rounds and live:
        order = live[r % len(live) :] + live[: r % len(live)]  # interleaved, rotating who goes first
        for name in order:
            a = runner.prepare()
            try:
                samples[name].append(timer.time(runner, candidates[name], a))
            except Exception as exc:
                times[name] = Timing(error=_error(exc))
                live.remove(name)
                samples.pop(name, None)
                if cuda:
                    torch.cuda.empty_cache()
            del a
        if cuda:
            torch.cuda.synchronize(device)
        if r == 0:  # round 0 is a warm-up; it sizes the number of timed rounds
            per_round = max(timing.now() - started, 1e-9)
            rounds = 1 + max(MIN_REPS, min(REPS[kind], int(BUDGET_S[kind] / per_round)))
            for name in live:
                samples[name].clear()
        r += 1
    del timer  # the L2 flush buffer
    for name in live:
        host = timing.median(s.host_ms for s in samples[name])
        gpu = timing.median(s.gpu_ms() for s in samples[name]) if cuda else None
        times[name] = Timing(gpu_ms=gpu, host_ms=host, compile_ms=_compile_ms(candidates[name], args, first_ms.get(name), host))
    return times


def _compile_ms(fn: Callable[..., Any], args: tuple[Any, ...], first: float | None, steady: float) -> float | None:
    """A per-process compiler's cost: its first call beyond a steady one, or what the impl
    reports having paid (``fn.compile_ms(*args)``: it may have compiled before this measurement,
    for another key), the larger. None for every other impl."""
    if first is None:
        return None
    reported = getattr(fn, "compile_ms", None)
    try:
        paid = reported(*args) if callable(reported) else None
    except Exception:  # a report is a hint; the first call's time stands
        paid = None
    return max(first - steady, paid or 0.0, 0.0)
