"""Helpers shared by the MoE experts ops' tests (moe_experts, moe_experts_gpt_oss): skips, cases in
float64, deterministic mode, the error-model comparison against a per-token formula, and the
GPU checks that run the same way for both ops (a bad index in a subprocess, CUDA-graph replay)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.testing import runnable_impls

# 4 tokens, k = 2, E = 3: expert 3 is out of range (the bad-input tests' index)
INDEX_3 = [[0, 3], [1, 2], [0, 1], [2, 0]]


def need(op_name: str, impl: str, dtype: torch.dtype = torch.float32) -> None:
    if impl not in runnable_impls(op_name, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


def case(op, label: str):
    """The op's CPU parity case of that label (fp32)."""
    return next(c for c in op.cases("cpu", torch.float32) if c.label == label)


def f64(args):
    """The case's arguments in float64, floating ones as fresh leaves."""
    return [a.detach().double().requires_grad_() if a.is_floating_point() else a for a in args]


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)


def reference_is_the_per_token_formula(op, per_token: Callable, grad_args: tuple[int, ...]) -> None:
    """In float64, the op's reference against the literal per-token formula: forward and every
    gradient in ``grad_args``, on every CPU parity case (the awkward routings)."""
    for c in op.cases("cpu", torch.float32):
        args, loop_args = f64(c.args), f64(c.args)
        ref = op.reference(*args, **c.kwargs)
        want = per_token(*loop_args, **c.kwargs)
        torch.testing.assert_close(ref, want, rtol=1e-12, atol=1e-12, msg=c.label)
        if ref.numel():
            dy = torch.randn_like(ref)
            got_grads = torch.autograd.grad(ref, [args[i] for i in grad_args], dy)
            want_grads = torch.autograd.grad(want, [loop_args[i] for i in grad_args], dy)
            for a, b in zip(got_grads, want_grads):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=c.label)


def bad_routing_and_hidden(with_: Callable[[int, object], list]) -> list[tuple]:
    """The bad-input rows both ops share, for arguments ``(hidden, index, weights, ...)`` of 4
    tokens, H = 8, k = 2, E = 3: ``with_(i, value)`` the good arguments with argument i replaced."""
    return [
        (with_(1, torch.tensor(INDEX_3)), {}, OpArgumentError, "'top_k_index': expert index 3 is out of range [0, 3)"),
        (with_(1, torch.tensor([[0, -1], [1, 2], [0, 1], [2, 0]])), {}, OpArgumentError, "'top_k_index': expert index -1"),
        (with_(2, torch.rand(4, 3)), {}, OpArgumentError, "'top_k_weights'"),  # k mismatch
        (with_(1, torch.zeros(4, 2)), {}, OpTypeError, "'top_k_index'"),  # float index
        (with_(0, torch.randint(0, 5, (4, 8))), {}, OpTypeError, "'hidden'"),  # int hidden states
        (with_(0, torch.randn(2, 2, 8)), {}, OpArgumentError, "'hidden'"),
    ]


def every_gradient_within_the_error_model(fn: Callable, op, c, per_token: Callable, grad_args: tuple[int, ...]) -> None:
    """``fn`` (the op with one impl) in fp32 against the literal per-token formula in fp64: the
    output and the gradient of every argument in ``grad_args``, within the op's error model."""
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in c.args]
    out = fn(*args, **c.kwargs)
    exact = f64(c.args)
    want = per_token(*exact, **c.kwargs)
    dy = 2 * torch.rand_like(out) - 1
    bounds = op.error_model(*c.args, **c.kwargs)

    def close(got, ref, model):
        tol = model.tol(got.dtype, ref.abs().max().item())
        torch.testing.assert_close(got.double(), ref.detach(), atol=tol.atol, rtol=tol.rtol)

    close(out, want, bounds.output(0))
    got_grads = torch.autograd.grad(out, [args[i] for i in grad_args], dy)
    want_grads = torch.autograd.grad(want, [exact[i] for i in grad_args], dy.double())
    for i, g, r in zip(grad_args, got_grads, want_grads):
        close(g, r, bounds.grads[i])


class BadIndexRuns:
    """The bad-index scripts (each calls the op with an index outside [0, E) on the GPU and prints
    "raised ..." or "passed silently ...") of one test module, all started at once. A device-side
    assert poisons the CUDA context, so each run needs its own process; one after the other, their
    start-ups (torch, CUDA, the kernels' first calls) took most of the MoE GPU tests' time."""

    def __init__(self, runs: dict[tuple[str, int], str], folder: str) -> None:
        self.procs: dict[tuple[str, int], tuple[subprocess.Popen, str]] = {}
        # No first-use check: it runs the torch impl first, on a copy of the call, whose own range
        # check (a device-side assert) would answer for the impl under test: a triton or liger
        # impl that let the index through would still have "raised" here.
        env = {**os.environ, "POLYKERNEL_VERIFY": "off"}
        for (impl, bad), script in runs.items():
            log = f"{folder}/{impl}_{bad}.log"  # a file, not a pipe: a device assert prints a lot
            with open(log, "w") as f:
                proc = subprocess.Popen([sys.executable, "-c", script, impl], stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
            self.procs[(impl, bad)] = (proc, log)

    def check(self, impl: str, bad: int) -> None:
        proc, log = self.procs[(impl, bad)]
        rc = proc.wait(timeout=300)
        with open(log) as f:
            out = f.read()
        assert "calling" in out, out[-2000:]  # the script got to the call: a failed set-up is no answer
        assert "raised" in out or rc != 0, out[-2000:]
        assert "passed silently" not in out

    def close(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def bad_index_runs(script: str, impls: list[str], folder: str) -> Iterator[BadIndexRuns]:
    """``script`` (formatted with ``bad``) for each impl and bad index (E = 4 and -1), started together."""
    runs = BadIndexRuns({(impl, bad): script.format(bad=bad) for impl in impls for bad in (4, -1)}, folder)
    try:
        yield runs
    finally:
        runs.close()


# GPU parity at model-like sizes whose float64 reference stays small and quick. The op's reference
# runs every expert on every token (E/k times the routed work), and its weight gradients cost one
# full-size tensor per expert: at the op's own large cases (2048x2048x768-E128-k8,
# 1024x4096x14336-E8-k2, gpt-oss's 2048x2880x2880-E32-k4) that was up to tens of GB of float64
# per impl and dtype. These keep what the large shapes test: many experts with few tokens each,
# long reductions over H (4096) and I (4096, 2880), one hot expert over many row tiles, odd sizes.
# Each reference is under ~1 TFLOP of float64 and ~4 GB of weights and gradients (an H200 runs
# float64 GEMMs at ~60 TFLOP/s).
GPU_SIZES = {
    "moe.moe_experts": [("384x1024x512-E128-k8", (384, 1024, 512, 128, 8)), ("512x4096x4096-E4-k2", (512, 4096, 4096, 4, 2))],
    "moe.moe_experts_gpt_oss": [("512x2880x2880-E16-k4", (512, 2880, 2880, 16, 4))],
}


# In float32 the Triton impls run our own grouped GEMMs (the grouped_mm path is 16-bit only), and
# each new shape class compiles their six kernels again: all 17 cases took 58 s (44 s for gpt-oss)
# on the H200 on 2026-12-03 (benchmarks/results/h200-2026-12-03-moe/gpu_tests.log), nearly all
# of it compiling. The CPU suite runs every case in float32 through Triton's interpreter; the GPU
# keeps one awkward small case, the long reductions and the odd sizes at scale.
FP32_GPU_LABELS = (
    "9x17x23-E3-k2-odd",
    "9x17x23-E3-k2-odd-clamped",
    "512x4096x4096-E4-k2",
    "512x2880x2880-E16-k4",
    "1031x1000x700-E9-k3-odd",
)


# Compiles, counted on the CPU (benchmarks/results/cpu-2026-12-03-moe-compiles/): every distinct
# specialization of a kernel (constexprs, dtypes, ints == 1 or divisible by 16, 16-byte alignment)
# compiles once per process, ~0.1-0.3 s for the grouped_mm path's elementwise kernels, ~1-3 s for
# our grouped GEMMs. Which cases take which path on the GPU in MODE "auto": 16-bit cases whose H
# and I are multiples of 16 bytes and whose projections are contiguous take grouped_mm; the odd
# sizes (9x17x23, 1031x1000x700) and the strided case run our GEMMs there too
# (test_moe_paths.py::test_which_cases_run_our_kernels_in_auto_mode).

# The awkward routings that only MODE "kernels" puts on our grouped GEMMs on the GPU (in "auto"
# they take grouped_mm); the odd sizes need no forcing (see above).
KERNELS_GPU_LABELS = ("12x24x40-E8-k2-empty-experts", "20x24x40-E5-k1-skew90")

# In float16 the triton impl runs the cases the grouped_mm path takes there (its elementwise
# kernels compile in ~0.1-0.3 s) and, of those on our grouped GEMMs (~5-15 s of compiling each),
# the small odd one: the others are a second 16-bit copy of what bfloat16 runs (the strided
# layout, the odd sizes at scale) or float32 runs (at scale). Empty experts and k = 1 run on our
# GEMMs in float16 in test_moe_paths.py; every other impl runs every case; the CPU runs them all.
# Where torch._grouped_mm fails its probe for float16 (the H200's timings of 2026-12-03 suggest it
# did, benchmarks/results/cpu-2026-12-03-moe-compiles/), that leaves the small odd case only.
FP16_TRITON_OURS = ("9x17x23-E3-k2-odd", "9x17x23-E3-k2-odd-clamped")


def grouped_mm_refusal(op, args: tuple) -> str | None:
    """Why the Triton impl's grouped_mm path refuses these arguments of ``op`` (moe_experts' or
    gpt-oss's order and layout) where it would otherwise take them (MODE "auto", on their device),
    or None."""
    from polykernel.backends import _moe_experts

    oss = op.OP_ID == "moe.moe_experts_gpt_oss"
    hidden, gate_up, down = args[0], args[3], args[5 if oss else 4]
    return _moe_experts.refusal(hidden, down.shape[1] if oss else down.shape[2], gate_up, down)


def triton_gpu_cases(op, cases: list, dtype: torch.dtype) -> list:
    """The triton impl's share of ``gpu_cases``: all of them, but in float16 only those on the
    grouped_mm path and ``FP16_TRITON_OURS``."""
    if dtype != torch.float16:
        return cases
    return [c for c in cases if c.label in FP16_TRITON_OURS or grouped_mm_refusal(op, c.args) is None]


def kernels_gpu_cases(op, dtype: torch.dtype, device: str = "cuda") -> list:
    """The op's awkward routings that our own grouped GEMMs (``_grouped_mm.MODE = "kernels"``) run
    only when forced on the GPU: empty experts, a skewed routing with k = 1 (``KERNELS_GPU_LABELS``).
    The odd sizes run them unforced in ``gpu_cases``; the CPU runs every case."""
    return [c for c in op.cases(device, dtype) if c.label in KERNELS_GPU_LABELS]


def gpu_cases(op, dtype: torch.dtype, device: str = "cuda") -> list:
    """The op's own (small, awkward) cases on the GPU, ``GPU_SIZES`` and the shared large routings
    (in float32, the ones of ``FP32_GPU_LABELS``)."""
    from polykernel.core.op import Case
    from polykernel.ops import _moe

    out = list(op.cases(device, dtype))
    for label, shape in GPU_SIZES[op.OP_ID]:
        out.append(Case(label, op.example(shape, dtype, device, requires_grad=True).args))
    for spec in _moe.large_routings():  # 4096x1024x512-E16-k1-skew90, 1031x1000x700-E9-k3-odd
        args = list(op.example(spec[1:6], dtype, device, requires_grad=True).args)
        if spec.index is not None:
            _, index, weights = _moe.routed(spec.t, spec.h, spec.n_experts, spec.k, spec.index, device, dtype)
            args[1], args[2] = index, weights.requires_grad_()
        out.append(Case(spec.label, tuple(args)))
    if dtype == torch.float32:
        out = [c for c in out if c.label in FP32_GPU_LABELS]
    return out


def assert_gpu_parity(op_name: str, op, dtype: torch.dtype, device: str = "cuda") -> None:
    """``assert_parity(op_name, device=device, dtypes=[dtype], cases=gpu_cases(op, dtype))``: every
    runnable impl on the cases it takes, the triton impl on ``triton_gpu_cases``."""
    from polykernel.testing import check_parity, refusal, runnable_impls

    cases = gpu_cases(op, dtype, device)
    results = []
    for impl in runnable_impls(op_name, device, dtype):
        mine = [c for c in (triton_gpu_cases(op, cases, dtype) if impl == "triton" else cases) if refusal(op_name, impl, c) is None]
        if mine:
            results += check_parity(op_name, [impl], device=device, dtypes=[dtype], cases=mine)
    failed = [r for r in results if not r.ok]
    assert results, f"no parity check ran for {op_name}"
    assert not failed, f"{len(failed)} of {len(results)} parity checks failed:\n" + "\n".join(map(str, failed))


def graph_replay_matches_eager(fn: Callable, op, impl: str) -> None:
    """``fn(*args, impl=impl)`` captured in a CUDA graph and replayed gives the eager result."""
    from polykernel.tools.bench import capture_graph

    c = op.example((64, 128, 96, 8, 2), torch.bfloat16, "cuda")
    args = [a.detach() for a in c.args]
    want = fn(*args, impl=impl)
    out = torch.empty_like(want)
    graph = capture_graph(lambda: out.copy_(fn(*args, impl=impl)))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    if impl == "triton":  # the same kernels, no host decision depends on the data
        assert torch.equal(out, want)
    else:  # the torch impl captures grouped_mm, or the reference where grouped_mm cannot run
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
