"""Helpers shared by the MoE experts ops' tests (moe_experts, moe_experts_gpt_oss): skips, cases in
float64, deterministic mode, the error-model comparison against a per-token formula, and the
GPU checks that run the same way for both ops (a bad index in a subprocess, CUDA-graph replay)."""

from __future__ import annotations

import contextlib
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


def bad_index_never_passes_silently(script: str, impl: str) -> None:
    """Runs ``script`` (it calls the op with an index outside [0, E) on the GPU and prints
    "raised ..." or "passed silently ...") with ``impl``. A device-side assert poisons the CUDA
    context: each run gets its own process."""
    out = subprocess.run([sys.executable, "-c", script, impl], capture_output=True, text=True, timeout=300)
    assert "raised" in out.stdout or out.returncode != 0, out.stdout + out.stderr[-2000:]
    assert "passed silently" not in out.stdout


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
