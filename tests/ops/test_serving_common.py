"""What the serving ops share: the overlap check, first-use verification of ops that write their
arguments, torch.compile with mutation, CUDA-graph capture (GPU), the bench rows."""

import io
import random

import pytest
import torch

import polykernel
from polykernel.core import registry
from polykernel.ops import OP_MODULES
from polykernel.ops._serving import overlaps, self_overlapping
from polykernel.ops.rotary_embedding_ import rope_cache
from polykernel.testing import runnable_impls

SERVING = sorted(op for op in OP_MODULES if op.startswith("serving."))


def _elements(t: torch.Tensor, buf: torch.Tensor) -> set[int]:
    idx = torch.arange(buf.numel(), dtype=torch.float64)
    return set(torch.as_strided(idx, t.shape, t.stride(), t.storage_offset()).flatten().long().tolist())


def test_overlap_is_never_missed_and_exact_for_row_layouts():
    buf = torch.zeros(1000)
    rng = random.Random(0)

    def view():
        m, w, off = rng.randint(1, 5), rng.randint(1, 12), rng.randint(0, 100)
        s = rng.choice([w, w + rng.randint(0, 20), max(1, w - 2), 0])
        kind = rng.random()
        if kind < 0.15:
            return torch.as_strided(buf, (w,), (1,), off)
        if kind < 0.25:
            return torch.as_strided(buf, (m, 2, w), (2 * s + 2 * w, w, 1), off)
        if kind < 0.3:
            return torch.as_strided(buf, (w, m), (1, w), off)
        return torch.as_strided(buf, (m, w), (s, 1), off)

    conservative = 0
    for _ in range(3000):
        a, b = view(), view()
        truth = bool(_elements(a, buf) & _elements(b, buf))
        got = overlaps(a, b)
        assert got or not truth, (a.shape, a.stride(), a.storage_offset(), b.shape, b.stride(), b.storage_offset())
        conservative += got and not truth
        if a.dim() == b.dim() == 2 and a.stride() == b.stride() and a.stride(0) >= a.shape[1] and a.shape[1] == b.shape[1]:
            assert got == truth  # rows of one stride (q/k/v slices of one projection): exact
    assert conservative < 150
    qkv = torch.randn(8, 6 * 64)
    q, k, v = qkv[:, :256], qkv[:, 256:320], qkv[:, 320:]
    assert not overlaps(q, k) and not overlaps(k, v) and not overlaps(q, v) and overlaps(q, qkv[:, 200:300])
    assert not overlaps(torch.randn(4), torch.randn(4)) and overlaps(qkv, qkv) and not overlaps(qkv[:0], qkv)


@pytest.mark.parametrize("op_id", SERVING)
def test_serving_ops_are_inference_only_and_graph_safe(op_id):
    op = registry.get_op(op_id)
    assert op.writes, f"{op_id}: the serving ops write into given tensors (Op.writes)"
    for name, spec in registry.specs_for(op).items():
        assert spec.cuda_graph_safe and spec.deterministic, (op_id, name)  # one launch (or two), no sync, outputs given


def _verify_calls():
    x, r, w = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32)
    pos, q, k = torch.tensor([1, 4, 2]), torch.randn(3, 64), torch.randn(3, 32)
    return [
        ("fused_add_rms_norm_", (x, r, w)),
        ("rotary_embedding_", (pos, q, k, 16, rope_cache(8, 16))),
        ("silu_and_mul", (x,)),
        ("dynamic_quant_fp8", (x,)),
    ]


@pytest.mark.parametrize("call", _verify_calls(), ids=lambda c: c[0])
def test_first_use_verification_gives_each_side_its_own_copies(call, monkeypatch):
    # The check runs the torch impl first; an op that writes its arguments would otherwise hand
    # the impl what the torch impl had written (an in-place op applied twice: a false mismatch).
    name, args = call
    if "triton" not in runnable_impls(name, "cpu", torch.float32):
        pytest.skip("triton not runnable on the CPU here")
    monkeypatch.setenv("POLYKERNEL_VERIFY", "always")
    polykernel.clear_caches()
    fn = getattr(polykernel, name)
    want = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], impl="torch")
    got = fn(*args, impl="triton")  # forced: a verification mismatch would raise
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g.float(), w.float(), rtol=0.07, atol=1e-3)


def test_first_use_verification_catches_a_wrong_in_place_impl(monkeypatch):
    # The torch impl's outputs are its (written) argument copies: the impl must write into other
    # copies, or the comparison would hold the impl's own results against themselves.
    from polykernel.errors import ImplVerificationError

    def wrong(x, residual, weight, eps, offset):  # adds twice
        residual.add_(x).add_(x)
        x.copy_(polykernel.rms_norm(residual, weight, eps, offset=offset, impl="torch"))
        return x, residual

    polykernel.register_impl(op="fused_add_rms_norm_", backend="cuda_jit", rank=1000)(wrong)
    monkeypatch.setenv("POLYKERNEL_VERIFY", "always")
    polykernel.clear_caches()
    x, r = torch.randn(3, 32), torch.randn(3, 32)
    with pytest.raises(ImplVerificationError):
        polykernel.fused_add_rms_norm_(x, r, torch.ones(32), impl="cuda_jit")


def test_first_use_verification_catches_an_impl_that_returns_new_tensors(monkeypatch):
    # Right values, returned in tensors of its own: the caller's out (or in-place arguments)
    # would keep their old values, whatever the returned tensors hold.
    from polykernel.errors import ImplVerificationError

    def fresh(x, out):
        return torch.nn.functional.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2 :]

    polykernel.register_impl(op="silu_and_mul", backend="cuda_jit", rank=1000)(fresh)
    monkeypatch.setenv("POLYKERNEL_VERIFY", "always")
    polykernel.clear_caches()
    with pytest.raises(ImplVerificationError, match="'out' as written"):
        polykernel.silu_and_mul(torch.randn(3, 32), impl="cuda_jit")


def test_compiled_calls_write_the_callers_tensors():
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    pos, q, k = torch.tensor([0, 3, 1, 2]), torch.randn(4, 32), torch.randn(4, 16)
    cache = rope_cache(8, 16)

    def step(x, r, w, pos, q, k, out):
        polykernel.fused_add_rms_norm_(x, r, w)
        polykernel.rotary_embedding_(pos, q, k, 16, cache, is_neox=False)
        polykernel.silu_and_mul(x, out=out)
        return polykernel.dynamic_quant_fp8(out)

    eager = [t.clone() for t in (x, r, q, k)] + [torch.empty(4, 16)]
    want = step(eager[0], eager[1], w, pos, eager[2], eager[3], eager[4])
    mine = [t.clone() for t in (x, r, q, k)] + [torch.empty(4, 16)]
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(mine[0], mine[1], w, pos, mine[2], mine[3], mine[4])
    for a, b in zip(mine, eager):  # the mutations reach the caller's tensors
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got[0].float(), want[0].float())
    torch.testing.assert_close(got[1], want[1])


def _bad_compiled_calls():
    cache = rope_cache(8, 16)
    buf = torch.randn(4, 32)

    def fused(x, r):
        return lambda: polykernel.fused_add_rms_norm_(x, r, torch.ones(16))

    def rope(positions):
        return lambda: polykernel.rotary_embedding_(positions, torch.randn(2, 32), None, 16, cache)

    return [  # (label, bad call, a valid call of the same argument class or None, the argument named)
        ("odd last dim", lambda: polykernel.silu_and_mul(torch.randn(4, 15)), None, "x"),
        ("bad approximate", lambda: polykernel.gelu_and_mul(torch.randn(4, 16), approximate="erf"), None, "approximate"),
        ("fp16 scale", lambda: polykernel.static_quant_fp8(torch.randn(2, 8), torch.ones(1, dtype=torch.float16)), None, "scale"),
        # memory and data, which the trace's fake tensors lack: the custom op's real impl checks
        # them on every call, also for a class already decided
        ("residual inside x", fused(buf[:, :16], buf[:, 8:24]), fused(torch.randn(4, 16), torch.randn(4, 16)), "residual"),
        ("position past the cache", rope(torch.tensor([0, 9])), rope(torch.tensor([0, 7])), "positions"),
    ]


@pytest.mark.parametrize("case", _bad_compiled_calls(), ids=lambda c: c[0])
def test_bad_calls_under_fullgraph_compile_raise_the_eager_error(case):
    from polykernel.errors import OpArgumentError

    _, call, valid, arg = case
    with pytest.raises(OpArgumentError) as eager:
        call()
    torch._dynamo.reset()
    if valid is not None:  # the class decided (memoized) first, by a valid compiled call
        torch.compile(valid, fullgraph=True, backend="eager")()
    with pytest.raises(OpArgumentError) as compiled:
        torch.compile(call, fullgraph=True, backend="eager")()
    assert (compiled.value.op, compiled.value.arg) == (eager.value.op, arg)


def _graph_step(dev: str, dtype: torch.dtype):
    """Every serving op in one decode step of 8 tokens (hidden 4096, 32 q / 8 kv heads of 128):
    the step's written tensors and the step."""
    x, r = (torch.randn(8, 4096, device=dev, dtype=dtype) for _ in range(2))
    w = torch.randn(4096, device=dev, dtype=dtype)  # the norm's weight: one per channel
    pos = torch.randint(0, 4096, (8,), device=dev)
    q, k = torch.randn(8, 32 * 128, device=dev, dtype=dtype), torch.randn(8, 8 * 128, device=dev, dtype=dtype)
    cache = rope_cache(4096, 128, device=dev)
    gu = torch.randn(8, 2 * 4096, device=dev, dtype=dtype)
    out = torch.empty(8, 4096, device=dev, dtype=dtype)
    scale = torch.tensor([0.02], device=dev)

    def step():
        polykernel.fused_add_rms_norm_(x, r, w)
        polykernel.rotary_embedding_(pos, q, k, 128, cache)
        polykernel.silu_and_mul(gu, out=out)
        polykernel.gelu_and_mul(gu, out=out)
        polykernel.static_quant_fp8(x, scale)
        polykernel.rms_norm_quant_fp8(x, w, scale)
        return polykernel.dynamic_quant_fp8(x)

    return (x, r, q, k), step


def test_the_graph_steps_arguments_are_valid():
    # The GPU test below runs only on the H200: its arguments are checked here (eagerly, torch impls).
    _, step = _graph_step("cpu", torch.float32)
    with polykernel.use_impl("torch"):
        step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_serving_op_replays_in_a_cuda_graph():
    (x, r, q, k), step = _graph_step("cuda", torch.bfloat16)

    keep = [t.clone() for t in (x, r, q, k)]
    step()  # compile and verify outside the capture
    for t, v in zip((x, r, q, k), keep):
        t.copy_(v)
    want = [t.clone() for t in step()]
    for t, v in zip((x, r, q, k), keep):
        t.copy_(v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    for t, v in zip((x, r, q, k), keep):
        t.copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    for g, v in zip(got, want):
        torch.testing.assert_close(g.float(), v.float())


def test_bench_times_the_serving_ops_forward_only(monkeypatch):
    from polykernel.tools import bench, bench_shapes
    from polykernel.tools.console import make_console

    def fake_measure(fn, grad_inputs, backward, graph=False, warmup=25, rep=100):
        with torch.no_grad():
            fn()
        return 0.5, 1.0

    assert set(bench.SHAPES) >= {op.partition(".")[2] for op in SERVING}  # README rows for every serving op
    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4000.0)
    monkeypatch.setattr(
        bench_shapes, "SHAPES", {"fused_add_rms_norm_": [("4x64", (4, 64))], "rotary_embedding_": [("T3,q2x128,k1", (3, 256))]}
    )
    rows, _ = bench.run(
        ["fused_add_rms_norm_", "rotary_embedding_"],
        False,
        torch.float32,
        device="cpu",
        console=make_console(io.StringIO(), force_terminal=False),
    )
    assert rows and {r["mode"] for r in rows} == {"fwd"} and all(r["error"] == "" for r in rows), rows
    assert {r["op"] for r in rows} == {"fused_add_rms_norm_", "rotary_embedding_"} and all(r["GB/s"] > 0 for r in rows)
    assert bench._label("rotary_embedding_", (64, 4096)) == "T64,q32x128,k8"


def test_self_overlap_is_never_missed():
    """self_overlapping is conservative: every layout whose elements share memory is caught."""
    buf = torch.zeros(1000)
    rng = random.Random(1)
    for _ in range(500):
        dims = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 5) for _ in range(dims))
        stride = tuple(rng.randint(0, 12) for _ in range(dims))
        t = torch.as_strided(buf, shape, stride)
        shared = len(_elements(t, buf)) < t.numel()
        assert not shared or self_overlapping(t), (shape, stride)
    assert not self_overlapping(torch.zeros(6, 32)[:, ::2]) and not self_overlapping(torch.zeros(8, 6).t())


def _self_overlapping_calls():
    x, w, cache, pos = torch.randn(6, 16), torch.randn(16), rope_cache(10, 8), torch.arange(6)
    shared = torch.zeros(1, 8).expand(6, 8)  # every row the same memory
    return [
        ("silu_and_mul-out", "out", lambda impl: polykernel.silu_and_mul(x, out=shared, impl=impl)),
        ("gelu_and_mul-out", "out", lambda impl: polykernel.gelu_and_mul(x, out=shared, impl=impl)),
        (
            "rope-query",
            "query",
            lambda impl: polykernel.rotary_embedding_(pos, torch.randn(1, 16).expand(6, 16), None, 8, cache, impl=impl),
        ),
        (
            "rope-key",
            "key",
            lambda impl: polykernel.rotary_embedding_(pos, torch.randn(6, 16), torch.randn(1, 8).expand(6, 8), 8, cache, impl=impl),
        ),
        ("farn-x", "x", lambda impl: polykernel.fused_add_rms_norm_(torch.randn(1, 16).expand(6, 16), torch.randn(6, 16), w, impl=impl)),
        (
            "farn-residual",
            "residual",
            lambda impl: polykernel.fused_add_rms_norm_(torch.randn(6, 16), torch.randn(1, 16).expand(6, 16), w, impl=impl),
        ),
    ]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("call", _self_overlapping_calls(), ids=lambda c: c[0])
def test_a_written_tensor_whose_elements_share_memory_is_an_error(call, impl):
    """A stride-0 destination or in-place argument: the Triton impls wrote every row over the
    same memory (a silently wrong result), torch raised only after writing the other tensor."""
    _, arg, fn = call
    with torch.no_grad(), pytest.raises(polykernel.errors.OpArgumentError, match=arg):
        fn(impl)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("call", _self_overlapping_calls(), ids=lambda c: c[0])
def test_a_self_overlapping_written_tensor_under_compile_is_the_named_error(call, dynamic):
    # strides are metadata the trace has (symbolic under dynamic shapes): functionalization
    # (aot_eager, inductor) refused the mutated input with its own BackendCompilerFailed before
    # the custom op's run-time check could run
    _, arg, fn = call
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(polykernel.errors.OpArgumentError, match=arg):
        torch.compile(lambda: fn(None), fullgraph=True, backend="aot_eager", dynamic=dynamic)()


def _read_inside_written_calls():
    pos, w = torch.arange(6).flip(0), torch.randn(16)
    q = torch.randn(6, 16)
    x = torch.randn(6, 16)
    return [
        ("rope-cache-in-query", "cos_sin_cache", lambda impl: polykernel.rotary_embedding_(pos, q, None, 16, q[:, :8], impl=impl)),
        (
            "rope-cache-in-key",
            "cos_sin_cache",
            lambda impl: polykernel.rotary_embedding_(pos, torch.randn(6, 16), q, 16, q[:, :8], impl=impl),
        ),
        ("farn-weight-in-x", "weight", lambda impl: polykernel.fused_add_rms_norm_(x, torch.randn(6, 16), x[2], impl=impl)),
        ("farn-weight-in-residual", "weight", lambda impl: polykernel.fused_add_rms_norm_(torch.randn(6, 16), x, x[2], impl=impl)),
        ("farn-weight-apart", None, lambda impl: polykernel.fused_add_rms_norm_(torch.randn(6, 16), torch.randn(6, 16), w, impl=impl)),
    ]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("call", _read_inside_written_calls(), ids=lambda c: c[0])
def test_a_read_argument_inside_a_written_one_is_an_error(call, impl):
    """The cache or weight inside a tensor the op writes: the Triton rope read rows that other
    tokens had already rotated (a silently wrong result); the norm's weight raced the same way."""
    _, arg, fn = call
    with torch.no_grad():
        if arg is None:
            fn(impl)
            return
        with pytest.raises(polykernel.errors.OpArgumentError, match=arg):
            fn(impl)
