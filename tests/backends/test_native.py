"""The native (C++) launch path of the norms, GLUs, rope and the serving ops: backends/triton/_native.py and csrc/.

On the CPU: the extension builds from the repository (the README's commands build it in
``make setup``), and its specialization keys, parameter packing and layout reading are checked
against what Triton does. On the GPU (``-m gpu``): the native path gives bit-for-bit the results
of the Python path (the same kernels), forward and backward, across dtypes, shapes, optional
parameters, misaligned inputs, side streams and CUDA-graph capture, and it really ran natively.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from polykernel.backends.triton import _native


@pytest.fixture(scope="module")
def C():
    return _native.build()


# ---------------------------------------------------------------------------------------------
# CPU


def test_builds_and_reports_the_driver(C):
    assert hasattr(C, "Slot") and hasattr(C, "rms_norm")
    assert isinstance(C.driver_error(), str)  # "" where libcuda loads; the reason elsewhere


def test_keys_follow_triton_specialization(C):
    buf = torch.zeros(64, dtype=torch.float32)
    aligned, misaligned = buf[:32], buf[1:33]
    key = lambda *a: C.key_for(0, *a)
    assert key(aligned) == key(buf[4:36])  # 16-byte aligned both
    assert key(aligned) != key(misaligned)
    assert key(aligned) != key(aligned.to(torch.bfloat16))
    assert key(aligned) != C.key_for(1, aligned)  # the device
    # ints: == 1, divisible by 16, width
    assert key(1) != key(3) and key(16) != key(17) and key(3) == key(5) and key(32) == key(48)
    assert key(2**31) != key(2**31 - 16)
    # floats specialize on nothing; bools on their value
    assert key(1e-6) == key(0.5) and key(True) != key(False)


def test_packing_matches_the_kernel_signature(C):
    x = torch.arange(8, dtype=torch.float32)
    # kinds: pointer, constexpr-specialized (skipped), i32, i64, fp32, fp64; then 2 scratch pointers
    packed = C.pack_for("p\0ilfd", 2, x, 1, -7, 2**40, 0.25, 1e-300)
    expected = struct.pack("<QiqfdQQ", x.data_ptr(), -7, 2**40, 0.25, 1e-300, 0, 0)
    assert packed == expected
    with pytest.raises(RuntimeError, match="argument count"):
        C.pack_for("pp", 0, x)
    with pytest.raises(RuntimeError, match="non-tensor"):
        C.pack_for("p", 0, 3)


def _compiled(signature, **md):
    meta = dict(num_ctas=1, launch_pdl=False, launch_cooperative_grid=False, global_scratch_size=0, profile_scratch_size=0, shared=0)
    meta.update(md)
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=SimpleNamespace(**meta))


def test_layout_reads_triton_signature():
    kernel = SimpleNamespace(arg_names=["X", "M", "N", "eps", "BLOCK"])
    sig = {"X": "*bf16", "M": "constexpr", "N": "i32", "eps": "fp32", "BLOCK": "constexpr"}
    assert _native._layout(_compiled(sig), kernel, 4) == "p\0if"
    assert _native._layout(_compiled({**sig, "N": "i64"}), kernel, 4) == "p\0lf"
    # a keyword argument that is not a constexpr, an unknown type, scratch, clusters: not natively
    assert _native._layout(_compiled({**sig, "BLOCK": "i32"}), kernel, 4) is None
    assert _native._layout(_compiled({**sig, "N": "nvTmaDesc"}), kernel, 4) is None
    assert _native._layout(_compiled(sig, global_scratch_size=128), kernel, 4) is None
    assert _native._layout(_compiled(sig, num_ctas=2), kernel, 4) is None


def test_no_native_path_without_cuda_tensors(C):
    x, w = torch.randn(4, 8), torch.randn(8)
    assert C.rms_norm(x, w, 1e-6, 0.0, False) is None
    assert C.layer_norm(x, w, None, 1e-5) is None


# ---------------------------------------------------------------------------------------------
# GPU

gpu = pytest.mark.gpu


def _both_paths(fn, *inputs):
    """fn's outputs and input grads with the native path on, then off (same seed, same kernels)."""
    results = []
    for on in (True, False):
        old = _native.set_enabled(on)
        try:
            ins = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]
            y = fn(*ins)
            grads = []
            if y.requires_grad:
                g = torch.randn(y.shape, generator=torch.Generator(y.device).manual_seed(7), device=y.device, dtype=y.dtype)
                y.backward(g)
                grads = [t.grad for t in ins if isinstance(t, torch.Tensor) and t.requires_grad]
            torch.cuda.synchronize()
            results.append((y.detach(), grads))
        finally:
            _native.set_enabled(old)
    return results


def _assert_identical(results):
    (y1, g1), (y2, g2) = results
    assert torch.equal(y1, y2)
    assert len(g1) == len(g2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.fixture
def native():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    C = _native.module(wait=True)
    if C is None:
        pytest.fail("the native path did not build on this CUDA machine")
    return C


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4096), (3, 5, 4096), (257, 1000), (64, 8192), (2048, 16384)])
@pytest.mark.parametrize("casting", ["llama", "fp32"])
def test_rms_norm_native_equals_python(native, dtype, shape, casting):
    from polykernel.backends.triton.rms_norm import rms_norm

    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(shape[-1], device="cuda", dtype=dtype, requires_grad=True)
    offset = 1.0 if casting == "fp32" else 0.0  # Gemma's (1 + w)
    before = native.rms_norm_plan_state(x, w, casting == "llama")
    _assert_identical(_both_paths(lambda a, b: rms_norm(a, b, 1e-6, offset, casting), x, w))
    assert native.rms_norm_plan_state(x, w, casting == "llama") == 1, before  # a plan exists: it ran natively
    with torch.inference_mode():
        xi, wi = x.detach(), w.detach()
        _assert_identical(_both_paths(lambda a, b: rms_norm(a, b, 1e-6, offset, casting), xi, wi))


@gpu
def test_rms_norm_native_counts_launches_and_partial_grads(native):
    from polykernel.backends.triton.rms_norm import rms_norm

    torch.manual_seed(0)
    x = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)  # no grad for w
    _assert_identical(_both_paths(lambda a, b: rms_norm(a, b, 1e-6, 0.0, "llama"), x, w))
    x2 = x.detach()
    w2 = w.clone().requires_grad_()  # grad for w only
    _assert_identical(_both_paths(lambda a, b: rms_norm(a, b, 1e-6, 0.0, "llama"), x2, w2))
    slot = _native.colsum_slot()
    n0 = slot.launches()
    y = rms_norm(x2, w2, 1e-6, 0.0, "llama")
    y.sum().backward()
    torch.cuda.synchronize()
    assert slot.launches() == n0 + 1  # the backward's column sum went through C++


@gpu
def test_rms_norm_native_misaligned_and_side_stream(native):
    from polykernel.backends.triton.rms_norm import rms_norm

    torch.manual_seed(0)
    buf = torch.randn(1 + 33 * 4096, device="cuda", dtype=torch.bfloat16)
    x = buf[1:].view(33, 4096)  # contiguous, not 16-byte aligned: another specialization
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    _assert_identical(_both_paths(lambda a, b: rms_norm(a, b, 1e-6, 0.0, "llama"), x, w))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert native.current_stream(torch.cuda.current_device()) == s.cuda_stream
        xs = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
        ys = rms_norm(xs, w, 1e-6, 0.0, "llama")
    s.synchronize()
    old = _native.set_enabled(False)
    try:
        assert torch.equal(ys, rms_norm(xs, w, 1e-6, 0.0, "llama"))
    finally:
        _native.set_enabled(old)


@gpu
def test_rms_norm_native_in_a_cuda_graph(native):
    from polykernel.backends.triton.rms_norm import rms_norm

    torch.manual_seed(0)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = rms_norm(x, w, 1e-6, 0.0, "llama")  # warm: compiled and planned outside capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = rms_norm(x, w, 1e-6, 0.0, "llama")
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        old = _native.set_enabled(False)
        try:
            assert torch.equal(out, rms_norm(x, w, 1e-6, 0.0, "llama"))
        finally:
            _native.set_enabled(old)
        assert not torch.equal(out, ref)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("params", ["wb", "w", "b", "none"])
@pytest.mark.parametrize("shape", [(1, 4096), (4, 7, 1000), (1024, 4096)])
def test_layer_norm_native_equals_python(native, dtype, params, shape):
    from polykernel.backends.triton.layer_norm import layer_norm

    torch.manual_seed(0)
    n = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True) if "w" in params else None
    b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True) if "b" in params else None
    _assert_identical(_both_paths(lambda a, ww, bb: layer_norm(a, ww, bb, 1e-5), x, w, b))
    assert native.layer_norm_plan_state(x, w, b) == 1
    with torch.inference_mode():
        _assert_identical(
            _both_paths(
                lambda a, ww, bb: layer_norm(a, ww, bb, 1e-5),
                x.detach(),
                None if w is None else w.detach(),
                None if b is None else b.detach(),
            )
        )


@gpu
def test_layer_norm_native_bias_grad_only(native):
    from polykernel.backends.triton.layer_norm import layer_norm

    torch.manual_seed(0)
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _assert_identical(_both_paths(lambda a, ww, bb: layer_norm(a, ww, bb, 1e-5), x, w, b))


@gpu
def test_public_ops_take_the_native_path(native):
    import polykernel

    torch.manual_seed(0)
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = polykernel.rms_norm(x, w, impl="triton")
    assert "RmsNormFn" in y.grad_fn.name()
    y.float().pow(2).mean().backward()
    old = _native.set_enabled(False)
    try:
        x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y2 = polykernel.rms_norm(x2, w2, impl="triton")
        assert "RmsNormFn" not in y2.grad_fn.name()
        y2.float().pow(2).mean().backward()
    finally:
        _native.set_enabled(old)
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def _both_paths_two(fn, use, *inputs):
    """fused_add_rms_norm's two outputs; ``use`` picks which feed the loss ('y', 's' or 'ys')."""
    results = []
    for on in (True, False):
        old = _native.set_enabled(on)
        try:
            ins = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
            y, s = fn(*ins)
            gen = torch.Generator(y.device).manual_seed(7)
            loss = sum(
                (o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum() for o, k in ((y, "y"), (s, "s")) if k in use
            )
            loss.backward()
            torch.cuda.synchronize()
            results.append(((y.detach(), s.detach()), [t.grad for t in ins if t.requires_grad]))
        finally:
            _native.set_enabled(old)
    return results


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(8, 4096), (3, 5, 1000), (2048, 4096)])
@pytest.mark.parametrize("use", ["ys", "y", "s"])
def test_fused_add_rms_norm_native_equals_python(native, dtype, shape, use):
    from polykernel.backends.triton.fused_add_rms_norm import fused_add_rms_norm

    torch.manual_seed(0)
    n = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    (o1, g1), (o2, g2) = _both_paths_two(lambda a, b, c: fused_add_rms_norm(a, b, c, 1e-6, 0.0), use, x, r, w)
    assert all(torch.equal(a, b) for a, b in zip(o1, o2))
    assert len(g1) == len(g2) == 3
    for a, b in zip(g1, g2):
        assert (a is None and b is None) or torch.equal(a, b)
    assert native.fused_add_rms_norm_plan_state(x, r, w) == 1
    with torch.inference_mode():
        outs = []
        for on in (True, False):
            old = _native.set_enabled(on)
            try:
                outs.append(fused_add_rms_norm(x.detach(), r.detach(), w.detach(), 1e-6, 1.0))
            finally:
                _native.set_enabled(old)
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@gpu
@pytest.mark.parametrize("act", [0, 1, 2])  # silu (swiglu), gelu-tanh and gelu-erf (geglu)
@pytest.mark.parametrize("shape", [(1, 14336), (3, 5, 1000), (4096, 14336)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_glu_native_equals_python(native, act, shape, dtype):
    from polykernel.backends.triton.glu import glu

    torch.manual_seed(0)
    g = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    u = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    _assert_identical(_both_paths(lambda a, b: glu(a, b, act), g, u))
    assert native.glu_plan_state(g, u, act) == 1
    _assert_identical(_both_paths(lambda a, b: glu(a, b, act), g.detach(), u))  # up's gradient only
    with torch.inference_mode():
        _assert_identical(_both_paths(lambda a, b: glu(a, b, act), g.detach(), u.detach()))
    gt = torch.randn(shape[-1], *shape[:-1], device="cuda", dtype=dtype).transpose(0, -1)  # not contiguous: Python path
    _assert_identical(_both_paths(lambda a, b: glu(a, b, act), gt, u.detach()))


def _rope_both_paths(q, k, cos, sin, use):
    """rope's outputs and input grads with the native path on, then off; ``use`` picks which
    outputs feed the loss ('q', 'k' or 'qk')."""
    from polykernel.backends.triton.rope import rope

    results = []
    for on in (True, False):
        old = _native.set_enabled(on)
        try:
            ins = [t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k)]
            qo, ko = rope(*ins, cos, sin)
            if qo.requires_grad:
                assert ("RopeFn" in qo.grad_fn.name()) == on
                gen = torch.Generator(q.device).manual_seed(7)
                picked = [o for o, name in ((qo, "q"), (ko, "k")) if name in use]
                sum((o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum() for o in picked).backward()
            torch.cuda.synchronize()
            results.append(((qo.detach(), ko.detach()), [t.grad for t in ins]))
        finally:
            _native.set_enabled(old)
    return results


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "b,hq,hk,t,d,layout,shared",
    [
        (2, 32, 8, 512, 128, "bhtd", True),  # GQA, contiguous, one cos/sin for the batch
        (2, 8, 8, 100, 64, "bthd", False),  # HF's transposed view [B, T, H, D].transpose(1, 2), per-batch cos/sin
        (8, 32, 8, 1, 128, "bhtd", True),  # decode
        (1, 4, 2, 37, 320, "bhtd", True),  # half dim over one chunk (walked)
    ],
)
@pytest.mark.parametrize("use", ["qk", "q", "k"])
def test_rope_native_equals_python(native, dtype, b, hq, hk, t, d, layout, shared, use):
    torch.manual_seed(0)

    def make(h):
        if layout == "bthd":
            return torch.randn(b, t, h, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
        return torch.randn(b, h, t, d, device="cuda", dtype=dtype, requires_grad=True)

    q, k = make(hq), make(hk)
    cos = torch.randn(1 if shared else b, t, d, device="cuda", dtype=dtype)
    sin = torch.randn(1 if shared else b, t, d, device="cuda", dtype=dtype)
    (o1, g1), (o2, g2) = _rope_both_paths(q, k, cos, sin, use)
    assert all(torch.equal(x, y) and x.stride() == y.stride() for x, y in zip(o1, o2))
    for x, y in zip(g1, g2):
        assert (x is None and y is None) or (torch.equal(x, y) and x.stride() == y.stride())
    assert native.rope_plan_state(q, k) == 1
    (o1, g1), (o2, g2) = _rope_both_paths(q.detach(), k, cos, sin, "qk")  # k's gradient only
    assert all(torch.equal(x, y) for x, y in zip(o1, o2)) and torch.equal(g1[1], g2[1]) and g1[0] is None
    with torch.inference_mode():
        (o1, _), (o2, _) = _rope_both_paths(q.detach(), k.detach(), cos, sin, "qk")
        assert all(torch.equal(x, y) for x, y in zip(o1, o2))


@gpu
def test_public_rope_takes_the_native_path(native):
    import polykernel
    from polykernel.backends.triton import rope as triton_rope

    torch.manual_seed(0)
    q = torch.randn(2, 8, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = torch.randn(1, 64, 128, device="cuda", dtype=torch.bfloat16), torch.randn(1, 64, 128, device="cuda", dtype=torch.bfloat16)
    plan = triton_rope._NativePlan(q, k)
    qo, ko = polykernel.rope(q, k, cos, sin, impl="triton")  # a key's first launch goes through Triton's (not counted)
    (qo.float().sum() + ko.float().sum()).backward()
    before = plan.fwd.launches(), plan.bwd.launches()
    qo, ko = polykernel.rope(q, k, cos, sin, impl="triton")
    assert "RopeFn" in qo.grad_fn.name()
    (qo.float().sum() + ko.float().sum()).backward()
    assert plan.fwd.launches() == before[0] + 1 and plan.bwd.launches() == before[1] + 1
    with pytest.raises(NotImplementedError, match="cos/sin"):  # cos/sin gradients: refused by name, as before
        triton_rope.rope(q, k, cos.requires_grad_(), sin)


# ---------------------------------------------------------------------------------------------
# GPU: the serving ops (inference only, outputs given or written in place)


def _serving_ab(run, make):
    """run(*make()) with the native path on (after one warm-up call: a key's first launch goes
    through Triton's launcher), then off; fresh inputs each time (in-place ops write them)."""
    results = []
    for on in (True, False):
        old = _native.set_enabled(on)
        try:
            with torch.inference_mode():
                if on:
                    run(*make())
                out = run(*make())
            torch.cuda.synchronize()
            results.append([t.clone() for t in out])
        finally:
            _native.set_enabled(old)
    return results


def _assert_same_bits(results):
    (a, b) = results
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        # bits (fp8 and NaN too); contiguous first: a strided output (a transposed out=) keeps its strides in clone()
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


@contextlib.contextmanager
def _python_path():
    """The Python launch path inside the block (the native path's setting restored after)."""
    old = _native.set_enabled(False)
    try:
        yield
    finally:
        _native.set_enabled(old)


def _capture(run, *slots):
    """``(graph, run()'s result)``: a CUDA graph of ``run()``, whose capture launched once from C++
    through each of ``slots``."""
    before = [s.launches() for s in slots]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    assert [s.launches() for s in slots] == [b + 1 for b in before]  # captured from C++
    return g, out


def _launched(slot, run):
    """How many launches ``run()`` made through ``slot`` in C++."""
    before = slot.launches()
    with torch.inference_mode():
        run()
    torch.cuda.synchronize()
    return slot.launches() - before


def _allocations(run):
    """CUDA allocations ``run()`` made (the caching allocator's count)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    with torch.inference_mode():
        run()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before


# The serving tests loop over shapes inside one test (the compiles are shared): rows 1, 7, 64 and
# 4096 (decode to prefill; M == 1 and M % 16 == 0 are Triton specializations), row lengths of a
# small head, Llama's hidden size and its MLP width; every dtype, the activations in bf16.
SERVING_ROWS = (1, 7, 64, 4096)
SERVING_N = (128, 4096, 14336)
SERVING_CASES = [(torch.bfloat16, 0), (torch.bfloat16, 1), (torch.bfloat16, 2), (torch.float16, 0), (torch.float32, 2)]


def _check_and_mul(native, x, act, given):
    """glu_and_mul on x: the native path's bits are the Python path's, it launched from C++, and
    with out given it allocated nothing."""
    from polykernel.backends.triton import glu

    rows, d = x.shape[0], x.shape[-1] // 2

    def make():
        return x, torch.full((rows, d), float("nan"), device="cuda", dtype=x.dtype) if given else None

    def run(xx, out):
        y = glu.glu_and_mul(xx, out, act)
        assert out is None or y is out
        return (y,)

    _assert_same_bits(_serving_ab(run, make))
    assert native.glu_and_mul_plan_state(x, act) == 1
    plan = glu._AndMulPlan(d, act)
    tile = plan.tiles[min((rows - 1).bit_length(), len(plan.tiles) - 1)]
    assert _launched(tile.slot, lambda: run(*make())) == 1  # through C++
    if given:
        out = make()[1]
        assert _allocations(lambda: run(x, out)) == 0


@gpu
@pytest.mark.parametrize(("dtype", "act"), SERVING_CASES)  # act: silu_and_mul, gelu_and_mul (tanh, none)
def test_glu_and_mul_native_equals_python(native, dtype, act):
    torch.manual_seed(0)
    for rows in SERVING_ROWS:
        for d in SERVING_N:
            x = torch.randn(rows, 2 * d, device="cuda", dtype=dtype)
            for given in (False, True):
                _check_and_mul(native, x, act, given)


@gpu
@pytest.mark.parametrize("act", [0, 2])
def test_glu_and_mul_native_layouts(native, act):
    """Misaligned halves (odd d), a misaligned x, leading dims: native; strided x or out: Python."""
    from polykernel.backends.triton import glu

    torch.manual_seed(0)
    buf = torch.randn(1 + 3 * 5 * 2002, device="cuda", dtype=torch.bfloat16)
    for x in (torch.randn(3, 5, 2002, device="cuda", dtype=torch.bfloat16), buf[1:].view(3, 5, 2002)):
        _assert_same_bits(_serving_ab(lambda xx, out: (glu.glu_and_mul(xx, out, act),), lambda x=x: (x, None)))
        assert native.glu_and_mul(x, None, act) is not None
    wide = torch.randn(7, 3000, device="cuda", dtype=torch.bfloat16)[:, :2002]  # row-strided: the Python path
    assert native.glu_and_mul(wide, None, act) is None
    _assert_same_bits(_serving_ab(lambda xx, out: (glu.glu_and_mul(xx, out, act),), lambda: (wide, None)))
    x = torch.randn(7, 2002, device="cuda", dtype=torch.bfloat16)
    out_t = torch.empty(1001, 7, device="cuda", dtype=torch.bfloat16).t()  # no row view: the Python path
    assert native.glu_and_mul(x, out_t, act) is None
    _assert_same_bits(_serving_ab(lambda xx, out: (glu.glu_and_mul(xx, out, act),), lambda: (x, out_t)))


@gpu
def test_public_and_mul_ops_take_the_native_path(native):
    import polykernel
    from polykernel.backends.triton import glu

    torch.manual_seed(0)
    x = torch.randn(64, 2 * 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16)
    for act, call in [
        (0, lambda: polykernel.silu_and_mul(x, out=out, impl="triton")),
        (2, lambda: polykernel.gelu_and_mul(x, out=out, impl="triton")),
        (1, lambda: polykernel.gelu_and_mul(x, approximate="tanh", out=out, impl="triton")),
    ]:
        with torch.inference_mode():
            call()  # planned and compiled
        plan = glu._AndMulPlan(4096, act)
        assert _launched(plan.tiles[-1].slot, call) == 1


@gpu
@pytest.mark.parametrize("act", [0, 1])
def test_glu_and_mul_native_in_a_cuda_graph(native, act):
    from polykernel.backends.triton import glu

    torch.manual_seed(0)
    x = torch.randn(64, 2 * 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16)
    slot = glu._AndMulPlan(4096, act).tiles[-1].slot
    with torch.inference_mode():
        glu.glu_and_mul(x, out, act)  # warm: compiled and planned outside capture
        glu.glu_and_mul(x, out, act)
        ref = out.clone()
        g, y = _capture(lambda: glu.glu_and_mul(x, out, act), slot)
        assert y is out
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        with _python_path():
            assert torch.equal(out, glu.glu_and_mul(x, None, act))
        assert not torch.equal(out, ref)


def _check_add_rms_norm_inplace(native, x, r, w):
    """fused_add_rms_norm_ on (x, r, w): bits as the Python path's, launched from C++, no allocation."""
    from polykernel.backends.triton import fused_add_rms_norm as far
    from polykernel.backends.triton.fused_add_rms_norm_ import fused_add_rms_norm_

    def run(xx, rr):
        out = fused_add_rms_norm_(xx, rr, w, 1e-6, 1.0)
        assert out[0] is xx and out[1] is rr
        return out

    _assert_same_bits(_serving_ab(run, lambda: (x.clone(), r.clone())))
    assert native.fused_add_rms_norm_inplace_plan_state(x, r, w) == 1
    xs, rs = x.clone(), r.clone()
    assert _launched(far._NativePlan(x).fwd_infer, lambda: run(xs, rs)) == 1
    assert _allocations(lambda: run(xs, rs)) == 0


@gpu
@pytest.mark.parametrize(
    ("dtype", "w_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float32)],
)
def test_fused_add_rms_norm_inplace_native_equals_python(native, dtype, w_dtype):
    torch.manual_seed(0)
    for rows in SERVING_ROWS:
        for n in SERVING_N:
            x = torch.randn(rows, n, device="cuda", dtype=dtype)
            r = torch.randn(rows, n, device="cuda", dtype=dtype)
            _check_add_rms_norm_inplace(native, x, r, torch.randn(n, device="cuda", dtype=w_dtype))


@gpu
def test_fused_add_rms_norm_inplace_python_path_where_native_does_not_take(native):
    from polykernel.backends.triton.fused_add_rms_norm_ import fused_add_rms_norm_

    torch.manual_seed(0)
    w = torch.randn(20000, device="cuda", dtype=torch.bfloat16)
    x, r = torch.randn(3, 20000, device="cuda", dtype=torch.bfloat16), torch.randn(3, 20000, device="cuda", dtype=torch.bfloat16)
    run = lambda xx, rr, ww: fused_add_rms_norm_(xx, rr, ww, 1e-6, 0.0)
    _assert_same_bits(_serving_ab(run, lambda: (x.clone(), r.clone(), w)))  # long rows: the chunked kernel
    assert native.fused_add_rms_norm_inplace_plan_state(x, r, w) == 2
    wide = torch.randn(5, 6000, device="cuda", dtype=torch.bfloat16)
    w = w[:4096].clone()
    r = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
    assert native.fused_add_rms_norm_inplace(wide[:, :4096], r, w, 1e-6, 0.0) is None  # row-strided x
    _assert_same_bits(_serving_ab(run, lambda: (wide.clone()[:, :4096], r.clone(), w)))


@gpu
def test_fused_add_rms_norm_inplace_native_in_a_cuda_graph(native):
    from polykernel.backends.triton import fused_add_rms_norm as far
    from polykernel.backends.triton.fused_add_rms_norm_ import fused_add_rms_norm_

    torch.manual_seed(0)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    slot = far._NativePlan(x).fwd_infer
    with torch.inference_mode():
        fused_add_rms_norm_(x.clone(), r.clone(), w, 1e-6, 0.0)  # warm
        fused_add_rms_norm_(x.clone(), r.clone(), w, 1e-6, 0.0)
        gx, gr = x.clone(), r.clone()
        g, _ = _capture(lambda: fused_add_rms_norm_(gx, gr, w, 1e-6, 0.0), slot)
        gx.copy_(x)
        gr.copy_(r)
        g.replay()
        torch.cuda.synchronize()
        with _python_path():
            ex, er = fused_add_rms_norm_(x.clone(), r.clone(), w, 1e-6, 0.0)
        assert torch.equal(gx, ex) and torch.equal(gr, er)


def _rotary_inputs(tokens, hq, hk, head_size, rd, dtype, layout, pos_dtype, max_pos=8192):
    torch.manual_seed(0)
    positions = torch.randint(0, max_pos, (tokens,), device="cuda", dtype=pos_dtype)
    cache = torch.randn(max_pos, rd, device="cuda", dtype=dtype if layout != "fp32-cache" else torch.float32)
    if layout == "qkv":  # slices of one fused projection: row-strided q and k, no copy
        qkv = torch.randn(tokens, (hq + 2 * hk) * head_size, device="cuda", dtype=dtype)
        return positions, qkv, cache

    q = torch.randn(tokens, hq * head_size, device="cuda", dtype=dtype)
    k = torch.randn(tokens, hk * head_size, device="cuda", dtype=dtype) if hk else None
    if layout == "3d":
        q = q.view(tokens, hq, head_size)
        k = k.view(tokens, hk, head_size) if k is not None else None
    return positions, q, k, cache


def _check_rotary(native, positions, make, head_size, cache, is_neox, heads):
    """rotary_embedding_ on make()'s (query, key): bits as the Python path's, launched from C++,
    no allocation."""
    from polykernel.backends.triton import rotary_embedding_ as rot

    def run(qq, kk):
        out = rot.rotary_embedding_(positions, qq, kk, head_size, cache, is_neox)
        assert out[0] is qq and out[1] is kk
        return [qq] + ([kk] if kk is not None else [])

    _assert_same_bits(_serving_ab(run, make))
    qq, kk = make()
    assert native.rotary_embedding_plan_state(qq, kk, head_size, cache, is_neox) == 1
    slot = rot._NativePlan(heads, cache.shape[1] // 2, is_neox).fwd
    assert _launched(slot, lambda: run(qq, kk)) == 1
    assert _allocations(lambda: run(qq, kk)) == 0


@gpu
@pytest.mark.parametrize(
    "hq,hk,head_size,rd,layout",
    [
        (32, 8, 128, 128, "2d"),  # Llama GQA
        (8, 0, 64, 32, "2d"),  # no key, partial rotary
        (16, 16, 128, 128, "3d"),
        (32, 8, 128, 64, "qkv"),  # q and k sliced out of a fused QKV projection
        (4, 4, 256, 256, "fp32-cache"),
    ],
)
def test_rotary_embedding_native_equals_python(native, hq, hk, head_size, rd, layout):
    for tokens in SERVING_ROWS:
        for dtype, is_neox in [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True), (torch.float32, False)]:
            pos_dtype = torch.int32 if tokens == 7 else torch.int64
            made = _rotary_inputs(tokens, hq, hk, head_size, rd, dtype, layout, pos_dtype)
            if layout == "qkv":
                positions, qkv, cache = made
                make = functools.partial(_qkv_slices, qkv, hq * head_size, hk * head_size)
            else:
                positions, q, k, cache = made
                make = functools.partial(_clones, q, k)
            _check_rotary(native, positions, make, head_size, cache, is_neox, max(hq, hk))


def _qkv_slices(qkv, q_width, k_width):
    buf = qkv.clone()
    return buf[:, :q_width], buf[:, q_width : q_width + k_width]


def _clones(q, k):
    return q.clone(), None if k is None else k.clone()


@gpu
def test_rotary_embedding_native_bad_positions_and_graph(native):
    """A position outside the cache writes NaN on both paths; a CUDA graph replays the C++ launch."""
    from polykernel.backends.triton import rotary_embedding_ as rot

    positions, q, k, cache = _rotary_inputs(64, 32, 8, 128, 128, torch.bfloat16, "2d", torch.int64, max_pos=512)
    positions[3] = 512
    positions[5] = -1
    run = lambda qq, kk: (rot.rotary_embedding_(positions, qq, kk, 128, cache, True), [qq, kk])[1]
    _assert_same_bits(_serving_ab(run, lambda: (q.clone(), k.clone())))
    positions[3], positions[5] = 0, 1
    slot = rot._NativePlan(32, 64, True).fwd
    with torch.inference_mode():
        gq, gk = q.clone(), k.clone()
        run(gq, gk)  # warm
        gq.copy_(q)
        gk.copy_(k)
        g, _ = _capture(lambda: run(gq, gk), slot)
        positions.copy_(torch.randint(0, 512, positions.shape, device="cuda"))
        gq.copy_(q)
        gk.copy_(k)
        g.replay()
        torch.cuda.synchronize()
        with _python_path():
            eq, ek = run(q.clone(), k.clone())
        assert torch.equal(gq, eq) and torch.equal(gk, ek)


def _fp8(shape):
    return torch.empty(shape, device="cuda", dtype=torch.float8_e4m3fn)


def _check_quant(native, op, x, w, scale):
    """One quantiser on x: bits (q and scale) as the Python path's, launched from C++ (every
    kernel of the op), no allocation."""
    from polykernel.backends.triton import quant_fp8 as qf

    rows, n = x.shape
    per_token = op == "dynamic_token"
    plan = qf._NativePlan(n)
    tile = min((rows - 1).bit_length(), len(plan.quant) - 1)

    def make():
        return _fp8((rows, n)), torch.empty((rows, 1) if per_token else (1,), device="cuda", dtype=torch.float32)

    if op.startswith("static"):
        name, slots = "static_quant_fp8", [plan.quant[tile].slot]
        run = lambda q, s: (qf.static_quant(x, scale, q),)
    elif op.startswith("dynamic"):
        name, slots = "dynamic_quant_fp8", [plan.token] if per_token else [plan.amax[tile].slot, plan.quant[tile].slot]
        run = lambda q, s: qf.dynamic_quant(x, per_token, q, s)
    else:
        name, slots = "rms_norm_quant_fp8", [plan.rms]
        run = lambda q, s: (qf.rms_norm_quant(x, w, scale, 1e-6, q),)
    _assert_same_bits(_serving_ab(run, make))
    assert getattr(native, f"{name}_plan_state")(x) == 1
    q, s = make()
    before = [sl.launches() for sl in slots]
    with torch.inference_mode():
        run(q, s)
    torch.cuda.synchronize()
    assert [sl.launches() - b for sl, b in zip(slots, before)] == [1] * len(slots)
    assert _allocations(lambda: run(q, s)) == 0


@gpu
@pytest.mark.parametrize("op", ["static", "static_per_row", "dynamic_token", "dynamic_tensor", "rms_norm", "rms_norm_per_row"])
def test_quant_fp8_native_equals_python(native, op):
    """Every row count and length (20000: the row kernels' chunked walk), the dtypes in turn."""
    torch.manual_seed(0)
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    for i, (rows, n) in enumerate((rows, n) for rows in SERVING_ROWS for n in (*SERVING_N, 20000)):
        dtype = dtypes[i % 3]
        x = 4 * torch.randn(rows, n, device="cuda", dtype=dtype)
        x[0, 0] = 1e4  # saturates at ±448
        w = torch.randn(n, device="cuda", dtype=dtype)
        scale = torch.rand(rows if op.endswith("per_row") else 1, device="cuda", dtype=torch.float32) + 0.01
        _check_quant(native, op, x, w, scale.view(rows, 1) if op.endswith("per_row") else scale)


@gpu
def test_public_quant_ops_take_the_native_path(native):
    import polykernel
    from polykernel.backends.triton import quant_fp8 as qf

    torch.manual_seed(0)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([0.05], device="cuda")
    plan = qf._NativePlan(4096)
    for slot, call in [
        (plan.token, lambda: polykernel.dynamic_quant_fp8(x, impl="triton")),
        (plan.quant[-1].slot, lambda: polykernel.static_quant_fp8(x, scale, impl="triton")),
        (plan.rms, lambda: polykernel.rms_norm_quant_fp8(x, w, scale, impl="triton")),
    ]:
        with torch.inference_mode():
            call()  # planned and compiled
        assert _launched(slot, call) == 1


@gpu
def test_quant_fp8_native_in_a_cuda_graph(native):
    from polykernel.backends.triton import quant_fp8 as qf

    torch.manual_seed(0)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    q, s = _fp8((64, 4096)), torch.empty(1, device="cuda")
    plan = qf._NativePlan(4096)
    with torch.inference_mode():
        qf.dynamic_quant(x, False, q, s)  # warm (per tensor: zero_, amax, quantise)
        qf.dynamic_quant(x, False, q, s)
        g, _ = _capture(lambda: qf.dynamic_quant(x, False, q, s), plan.amax[-1].slot, plan.quant[-1].slot)
        x.mul_(3.0)
        g.replay()
        torch.cuda.synchronize()
        with _python_path():
            eq, es = qf.dynamic_quant(x, False, _fp8((64, 4096)), torch.empty(1, device="cuda"))
        assert torch.equal(q.view(torch.uint8), eq.view(torch.uint8)) and torch.equal(s, es)


# ---------------------------------------------------------------------------------------------
# Loading: a failed build falls back to Python (logged once), or is an error when required


@pytest.fixture
def fresh_loader(monkeypatch):
    """_native's load state reset for one test (restored after)."""
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_state", "new")
    monkeypatch.setattr(_native, "_logged", set())
    monkeypatch.setattr(_native, "ENABLED", True)
    return monkeypatch


def _failing_build(verbose: bool = False):
    raise RuntimeError("no compiler here\nninja: build stopped")


def test_failed_build_falls_back_and_logs_once(fresh_loader, caplog):
    fresh_loader.setattr(_native, "build", _failing_build)
    fresh_loader.setattr(_native, "REQUIRED", False)
    with caplog.at_level("WARNING", logger="polykernel"):
        assert _native.module(wait=True) is None
        assert _native.module(wait=True) is None
    msgs = [r.getMessage() for r in caplog.records if "native launch path unavailable" in r.getMessage()]
    assert len(msgs) == 1 and "ninja: build stopped" in msgs[0]


def test_failed_build_is_an_error_when_required(fresh_loader):
    fresh_loader.setattr(_native, "build", _failing_build)
    fresh_loader.setattr(_native, "REQUIRED", True)
    with pytest.raises(RuntimeError, match="POLYKERNEL_NATIVE=1"):
        _native.module()
    with pytest.raises(RuntimeError, match="POLYKERNEL_NATIVE=1"):
        _native.module()  # and stays one


def test_unbuilt_extension_builds_in_the_background(fresh_loader, tmp_path, caplog):
    import threading

    started, release = threading.Event(), threading.Event()

    def slow_build(verbose: bool = False):
        started.set()
        release.wait(10)
        return SimpleNamespace(driver_error=lambda: "", accept_triton=lambda major, minor: "")

    fresh_loader.setattr(_native, "build", slow_build)
    fresh_loader.setattr(_native, "REQUIRED", False)
    fresh_loader.setattr(_native, "_built", lambda: False)
    with caplog.at_level("WARNING", logger="polykernel"):
        assert _native.module() is None  # the Python path meanwhile
        assert started.wait(10)
        assert _native.module() is None
        release.set()
        for _ in range(100):
            if _native._state == "ready":
                break
            threading.Event().wait(0.05)
    assert _native.module() is not None
    assert any("in the background" in r.getMessage() for r in caplog.records)


def test_disabled_path_builds_nothing(fresh_loader):
    fresh_loader.setattr(_native, "ENABLED", False)
    fresh_loader.setattr(_native, "build", _failing_build)
    assert _native.module() is None and _native._state == "new"


def test_plans_are_stored_per_key(C):
    """The plan tables on the CPU (no launch): Python's plan objects are read into C++ plans under
    their key, None marks a key for the Python path, and clear_plans forgets them."""
    s = C.Slot(lambda grid, args, key: None)
    rows = dict(rows_fwd=2, rows_bwd=4, programs=8, colsum_block=64)
    x, w = torch.randn(3, 16), torch.randn(16)
    C.clear_plans()
    assert C.rms_norm_plan_state(x, w, False) == 0
    C.set_rms_norm_plan(x, w, False, SimpleNamespace(fwd=s, fwd_infer=s, bwd=s, colsum=s, **rows))
    C.set_rms_norm_plan(x, w, True, None)
    assert C.rms_norm_plan_state(x, w, False) == 1 and C.rms_norm_plan_state(x, w, True) == 2
    assert C.rms_norm_plan_state(x.double(), w, False) == 0  # the dtype is in the key
    assert C.rms_norm_plan_state(torch.randn(3, 32), torch.randn(32), False) == 0  # and N
    C.set_layer_norm_plan(x, w, None, SimpleNamespace(fwd=s, fwd_infer=s, bwd=s, colsum_w=s, colsum_b=s, **rows))
    assert (
        C.layer_norm_plan_state(x, w, None) == 1 and C.layer_norm_plan_state(x, w, w) == 0 and C.layer_norm_plan_state(x, None, None) == 0
    )
    C.set_fused_add_rms_norm_plan(x, x, w, SimpleNamespace(fwd=s, fwd_infer=s, bwd=s, bwd_dso=s, colsum=s, **rows))
    assert C.fused_add_rms_norm_plan_state(x, x, w) == 1
    C.set_glu_plan(x, x, 0, SimpleNamespace(fwd=s, bwd=s, block=64))
    assert C.glu_plan_state(x, x, 0) == 1 and C.glu_plan_state(x, x, 1) == 0  # the activation is in the key
    with pytest.raises(AttributeError):  # a plan without a field is refused, not half-read
        C.set_glu_plan(x, x, 2, SimpleNamespace(fwd=s, block=64))
    assert C.glu_plan_state(x, x, 2) == 0
    q, k = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 5, 16)
    C.set_rope_plan(q, k, SimpleNamespace(fwd=s, bwd=s, block_t=8, per_head=False))
    assert C.rope_plan_state(q, k) == 1
    assert C.rope_plan_state(torch.randn(1, 8, 7, 16), k[:1, :, :1]) == 1  # T counts by its next power of two
    assert C.rope_plan_state(torch.randn(1, 8, 9, 16), k) == 0
    assert C.rope_plan_state(q, torch.randn(2, 4, 5, 16)) == 0 and C.rope_plan_state(q[..., :8], k[..., :8]) == 0  # heads, D
    assert C.rms_norm(x, w, 1e-6, 0.0, False) is None  # CPU tensors: never the native path
    assert C.rope(q, k, q[:, 0], q[:, 0]) is None
    C.clear_plans()
    assert C.rms_norm_plan_state(x, w, False) == 0 and C.glu_plan_state(x, x, 0) == 0 and C.rope_plan_state(q, k) == 0


def test_serving_plans_are_stored_per_key(C):
    """The serving ops' plan tables on the CPU: keys, shared tables, refused half plans."""
    s = C.Slot(lambda grid, args, key: None)
    x = torch.randn(3, 16)
    C.clear_plans()
    tile = SimpleNamespace(slot=s, rows=1)
    C.set_glu_and_mul_plan(x, 0, SimpleNamespace(block=8, tiles=[tile]))
    assert C.glu_and_mul_plan_state(x, 0) == 1 and C.glu_and_mul_plan_state(x, 1) == 0  # the activation is in the key
    assert C.glu_and_mul_plan_state(torch.randn(500, 16), 0) == 1  # M is not (the plan holds a tile per M)
    assert C.glu_and_mul_plan_state(torch.randn(3, 32), 0) == 0 and C.glu_and_mul_plan_state(x.double(), 0) == 0
    with pytest.raises(ValueError):  # a plan without tiles is refused, not half-read
        C.set_glu_and_mul_plan(x, 2, SimpleNamespace(block=8, tiles=[]))
    assert C.glu_and_mul_plan_state(x, 2) == 0
    assert C.glu_and_mul(x, None, 0) is None and C.glu_and_mul(x, torch.empty(3, 8), 0) is None  # CPU: Python
    rows = dict(rows_fwd=2, rows_bwd=4, programs=8, colsum_block=64)
    w = torch.randn(16)
    C.set_fused_add_rms_norm_plan(x, x, w, SimpleNamespace(fwd=s, fwd_infer=s, bwd=s, bwd_dso=s, colsum=s, **rows))
    assert C.fused_add_rms_norm_inplace_plan_state(x, x, w) == 1  # the in-place op shares the plans
    assert C.fused_add_rms_norm_inplace(x, x, w, 1e-6, 0.0) is None
    q, k, cache = torch.randn(5, 8 * 16), torch.randn(5, 2 * 16), torch.randn(100, 16)
    C.set_rotary_embedding_plan(q, k, 16, cache, True, SimpleNamespace(fwd=s, block_h=8))
    assert C.rotary_embedding_plan_state(q, k, 16, cache, True) == 1
    assert C.rotary_embedding_plan_state(q.view(5, 8, 16), k.view(5, 2, 16), 16, cache, True) == 1  # 2-D or 3-D alike
    assert C.rotary_embedding_plan_state(torch.randn(9, 8 * 16), None, 16, cache, True) == 1  # tokens and key are not
    assert C.rotary_embedding_plan_state(q, k, 16, cache, False) == 0  # the pair layout is
    assert C.rotary_embedding_plan_state(q, k, 16, cache[:, :8], True) == 0  # and the rotary width
    assert C.rotary_embedding_plan_state(torch.randn(5, 4 * 16), None, 16, cache, True) == 0  # and the heads
    assert C.rotary_embedding(torch.zeros(5, dtype=torch.long), q, k, 16, cache, True) is None
    quant = SimpleNamespace(
        block=16, quant=[SimpleNamespace(slot=s, rows=1)], amax=[SimpleNamespace(slot=s, rows=1)], token=s, token_rows=1, rms=s, rms_rows=1
    )
    C.set_static_quant_fp8_plan(x, quant)
    assert C.static_quant_fp8_plan_state(x) == 1 and C.dynamic_quant_fp8_plan_state(x) == 1 and C.rms_norm_quant_fp8_plan_state(x) == 1
    assert C.static_quant_fp8_plan_state(x.half()) == 0 and C.static_quant_fp8_plan_state(torch.randn(3, 32)) == 0
    q8 = torch.empty(3, 16, dtype=torch.float8_e4m3fn)
    assert C.static_quant_fp8(x, torch.ones(1), q8) is None and C.dynamic_quant_fp8(x, True, q8, torch.ones(3, 1)) is None
    C.clear_plans()
    assert C.glu_and_mul_plan_state(x, 0) == 0 and C.rotary_embedding_plan_state(q, k, 16, cache, True) == 0
    assert C.static_quant_fp8_plan_state(x) == 0


@pytest.mark.slow
def test_serving_launch_arguments_match_the_python_launchers():
    """Without a GPU: each serving entry's launches (kernel, constexprs, grid, every argument)
    equal the Python launchers' for the same call (_native_host_check.py, in its own process: it
    loads a second build of the extension, one that takes CPU tensors and never launches).

    That build (~1 min on 2 cores) is kept beside the extension's own, as ``_native.build``
    keeps that one: its folder's name holds the same hash of every source, and ninja rebuilds it
    when a source, a header or a flag changes; a later run of the suite only loads it."""
    from polykernel.backends._extension_lock import build_lock

    script = Path(__file__).with_name("_native_host_check.py")
    own = _native.build_dir()
    with build_lock(own.with_name(f"host-test-{own.name}"), "the native host-test build") as build:  # a baton a killed run left goes
        out = subprocess.run([sys.executable, str(script), str(build)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    assert out.stdout.strip().splitlines()[-1].startswith("ok ")


@pytest.mark.parametrize("act", [0, 2])
def test_serving_plans_tile_every_row_count_as_python_does(monkeypatch, act):
    """The plans' tiles per power of two of M give, at the C++ path's index (M's next power of
    two, capped at the last), the tile the Python launchers choose for that M."""
    from polykernel.backends.triton import glu
    from polykernel.backends.triton import quant_fp8 as qf

    monkeypatch.setattr(_native, "slot", lambda kernel, **meta: (kernel, meta))
    index = lambda m, tiles: min((m - 1).bit_length(), len(tiles) - 1)  # csrc: ceil_log2, capped
    for n in (1, 2, 64, 128, 1000, 4096, 5000, 14336, 20000):
        plan = glu._AndMulPlan(n, act)
        quant = qf._NativePlan(n)
        for m in (1, 2, 3, 5, 7, 8, 9, 64, 100, 1000, 4096, 4097, 10**6):
            block, rows, warps = glu._fit(m, n, [2 * n, 2 * n, n])
            tile = plan.tiles[index(m, plan.tiles)]
            assert plan.block == block and tile.rows == rows
            assert tile.slot == (glu._glu_fwd_kernel, dict(ACT=act, BLOCK=block, ROWS=rows, num_warps=warps))
            block, rows, _, warps = qf._elementwise_tiles(m, n)
            for tiles, kernel in ((quant.quant, qf._static_kernel), (quant.amax, qf._amax_kernel)):
                tile = tiles[index(m, tiles)]
                assert quant.block == block and tile.rows == rows
                assert tile.slot == (kernel, dict(BLOCK=block, ROWS=rows, num_warps=warps))


def test_call_builds_a_plan_once_then_runs_natively(fresh_loader):
    """_native.call's protocol against a stand-in module: a key without a plan gets one (or the
    Python path's mark) from make_plan, once; then the op runs; None sends the call to Python."""
    plans: dict = {}
    made: list = []

    def op(x, scale):  # the C++ op: None until its key has a plan
        return None if plans.get(x.key) is None else ("native", x.key, scale)

    fake = SimpleNamespace(
        op=op,
        op_plan_state=lambda x: 0 if x.key not in plans else (1 if plans[x.key] is not None else 2),
        set_op_plan=lambda x, plan: plans.__setitem__(x.key, plan),
    )
    fresh_loader.setattr(_native, "_module", fake)
    fresh_loader.setattr(_native, "_state", "ready")
    fresh_loader.setattr(_native, "hooks_set", lambda: False)
    fresh_loader.setattr(_native, "transforms_active", lambda: False)  # the protocol, whatever this torch says

    def make_plan(x):
        made.append(x.key)
        return None if x.key == "long rows" else object()

    cuda = lambda key: SimpleNamespace(key=key, is_cuda=True)
    assert _native.call("op", (cuda("a"), 2), (cuda("a"),), make_plan) == ("native", "a", 2)
    assert _native.call("op", (cuda("a"), 3), (cuda("a"),), make_plan) == ("native", "a", 3)
    assert _native.call("op", (cuda("long rows"), 2), (cuda("long rows"),), make_plan) is None
    assert _native.call("op", (cuda("long rows"), 2), (cuda("long rows"),), make_plan) is None
    assert made == ["a", "long rows"]  # one plan per key
    cpu = SimpleNamespace(key="cpu", is_cuda=False)
    assert _native.call("op", (cpu, 2), (cpu,), make_plan) is None and made == ["a", "long rows"]


# ---------------------------------------------------------------------------------------------
# The build: torch picks the C++ standard, the build directory is keyed on every source; the
# launch layout is behind a check of the Triton release


def test_build_leaves_the_cxx_standard_to_torch():
    # torch 2.14's headers need C++20; a -std of ours after torch's own would override it
    assert not any(flag.startswith("-std") for flag in _native.CFLAGS)


def test_build_dir_is_keyed_on_every_source_and_torch(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(_native.CSRC, csrc)
    monkeypatch.setattr(_native, "CSRC", csrc)
    monkeypatch.setenv("POLYKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    names = {p.relative_to(csrc).as_posix() for p in _native.sources()}
    assert {"native.cpp", "slot.h", "driver.h", "plans.h", "ops/rms_norm.h", "ops/rope.h"} <= names
    first = _native.build_dir()
    assert first == _native.build_dir()  # stable
    header = csrc / "ops" / "glu.h"
    header.write_text(header.read_text() + "\n// changed\n")
    second = _native.build_dir()
    assert second != first  # an included header is part of the key, not only native.cpp
    (csrc / "README.md").write_text("notes only")
    assert _native.build_dir() == second  # what does not compile is not
    monkeypatch.setattr(torch, "__version__", "9.9.9+test")
    third = _native.build_dir()
    assert third != second and third.name.startswith("torch9.9.9_test-py")


def test_every_csrc_file_ships():
    tomllib = pytest.importorskip("tomllib")
    root = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["polykernel"]
    package = _native.CSRC.parent
    files = [p.relative_to(package).as_posix() for p in _native.CSRC.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    missing = [f for f in files if not any(fnmatch.fnmatchcase(f, g) for g in globs)]
    assert files and not missing


@pytest.mark.parametrize(("version", "expected"), [("3.6.0", (3, 6)), ("3.9.0", (3, 9)), ("3.10.1+git1a2b3c", (3, 10))])
def test_triton_version_is_read_as_major_minor(monkeypatch, version, expected):
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    assert _native.triton_version() == expected


def test_launch_layout_accepts_only_the_triton_it_was_written_for(C):
    try:
        for ok in [(3, 6), (3, 7), (3, 8), (3, 9)]:  # 3.6: the H200's; 3.8: torch 2.14's; 3.9: CI's
            assert C.accept_triton(*ok) == ""
        for bad in [(3, 5), (3, 10), (4, 0), (2, 9)]:
            why = C.accept_triton(*bad)
            assert f"Triton {bad[0]}.{bad[1]} " in why and "3.6 to 3.9" in why
    finally:
        C.accept_triton(*_native.triton_version())


def test_unknown_triton_takes_the_python_path(C, fresh_loader, caplog):
    fresh_loader.setattr(_native, "build", lambda verbose=False: C)
    fresh_loader.setattr(_native, "triton_version", lambda: (3, 99))
    fresh_loader.setattr(_native, "REQUIRED", False)
    try:
        with caplog.at_level("WARNING", logger="polykernel"):
            assert _native.module(wait=True) is None
            assert _native.module(wait=True) is None
        msgs = [r.getMessage() for r in caplog.records if "native launch path unavailable" in r.getMessage()]
        assert len(msgs) == 1 and "Triton 3.99" in msgs[0]
        fresh_loader.setattr(_native, "_state", "new")
        fresh_loader.setattr(_native, "REQUIRED", True)
        with pytest.raises(RuntimeError, match=r"Triton 3\.99.*POLYKERNEL_NATIVE=1"):
            _native.module()
    finally:
        C.accept_triton(*_native.triton_version())


# ---------------------------------------------------------------------------------------------
# POLYKERNEL_NATIVE: 0|1|auto and their spellings; anything else is an error where first consulted


@pytest.fixture
def unsettled(monkeypatch):
    """_native as if POLYKERNEL_NATIVE had not been read yet (restored after)."""
    for name in ("ENABLED", "REQUIRED"):
        if name in vars(_native):
            monkeypatch.delitem(vars(_native), name)
    return monkeypatch


@pytest.mark.parametrize(
    ("value", "required", "off"),
    [
        ("1", True, False),
        (" On ", True, False),
        ("TRUE", True, False),
        ("yes", True, False),
        ("0", False, True),
        ("off", False, True),
        ("False", False, True),
        ("NO\n", False, True),
        ("auto", False, False),
        (" AUTO", False, False),
        ("", False, False),
    ],
)
def test_native_setting_spellings(unsettled, value, required, off):
    unsettled.setenv("POLYKERNEL_NATIVE", value)
    assert _native.REQUIRED is required
    assert _native.ENABLED is (not off and _native._launch.ENABLED)


@pytest.mark.parametrize("value", ["garbage", "2", "required", "o n", "-1"])
def test_bad_native_setting_is_an_error_where_consulted(unsettled, value):
    unsettled.setenv("POLYKERNEL_NATIVE", value)
    match = r"POLYKERNEL_NATIVE=.*use 1 \(or on, true, yes.*0 \(or off, false, no.*auto"
    with pytest.raises(ValueError, match=match):
        _native.ENABLED  # noqa: B018 - what the ops read first
    with pytest.raises(ValueError, match=match):
        _native.module()
    with pytest.raises(ValueError, match=match):
        _native.set_enabled(True)
    assert "ENABLED" not in vars(_native)  # never settled on a guess: asked again, it raises again


def test_bad_native_setting_does_not_break_import():
    env = {**os.environ, "POLYKERNEL_NATIVE": "garbage"}
    code = (
        "import polykernel\n"
        "from polykernel.backends.triton import _native, rms_norm\n"
        "try:\n"
        "    _native.ENABLED\n"
        "except ValueError as exc:\n"
        "    print('raised:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "raised: POLYKERNEL_NATIVE='garbage'" in out.stdout
