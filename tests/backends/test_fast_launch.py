"""The direct Triton launch path (polykernel.backends.triton._launch).

On the CPU: under the interpreter every launch goes through ``kernel[grid]``; the caching logic
itself runs against a stand-in kernel. On the GPU (``-m gpu``): the fast path and ``kernel[grid]``
give identical results, and the cache keys separate aligned/unaligned pointers and dtypes.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from polykernel import _compat  # noqa: E402
from polykernel.backends.triton import _launch  # noqa: E402
from polykernel.backends.triton import rms_norm as tk  # noqa: E402


def _rms_args(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor):
    m, n = x.shape
    block_n, rows, warps = tk._tile(n, 4096, None)
    grid = (triton.cdiv(m, rows),)
    args = (x, w, y, rstd, m, n, x.stride(0), y.stride(0), 1e-6, 0.0)
    meta = dict(BLOCK_N=block_n, ROWS=rows, LLAMA=False, STORE_RSTD=True, num_warps=warps)
    return grid, args, meta


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU here")
def test_interpreter_launches_go_through_kernel_grid():
    assert not _launch.ENABLED
    x, w = torch.randn(5, 48), torch.randn(48)
    y, rstd = torch.empty_like(x), torch.empty(5)
    grid, args, meta = _rms_args(x, w, y, rstd)
    for _ in range(2):
        _launch.launch(tk._rms_fwd_kernel, grid, *args, **meta)
    torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, rtol=1e-5, atol=1e-5)
    assert _launch.cached_keys(tk._rms_fwd_kernel) == []


# -- the caching logic, against a stand-in for a JITFunction ------------------------------------


class _Compiled:
    def __init__(self, log: list) -> None:
        self.function, self.packed_metadata = object(), object()
        self.run = lambda *a: log.append(("fast", a))


class _FakeKernel:
    """Parameters (X, N, F, BLOCK: constexpr, FLAG: constexpr = 7); kernel[grid] records a slow launch."""

    def __init__(self) -> None:
        self.log: list = []
        self.pre_run_hooks: list = []
        self.used_global_vals: dict = {}
        empty = inspect.Parameter.empty
        self.params = [
            SimpleNamespace(name=n, default=d) for n, d in (("X", empty), ("N", empty), ("F", empty), ("BLOCK", empty), ("FLAG", 7))
        ]

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("slow", grid, args, meta))
            return _Compiled(self.log)

        return run


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(_launch, "_JITFunction", _FakeKernel)
    monkeypatch.setattr(_launch, "_get_device", lambda: 0)
    monkeypatch.setattr(_launch, "_get_stream", lambda device: 1234)
    monkeypatch.setattr(_launch, "_runtime_knobs", SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=None))
    return _FakeKernel()


def _kinds(kernel: _FakeKernel) -> list[str]:
    return [entry[0] for entry in kernel.log]


def test_second_launch_of_a_specialization_is_direct(fake):
    x = torch.zeros(64)
    _launch.launch(fake, (3,), x, 32, 0.5, BLOCK=16, num_warps=4)
    _launch.launch(fake, (3, 2), x, 48, 0.25, BLOCK=16, num_warps=4)  # same kinds: 48 % 16 == 0 too
    assert _kinds(fake) == ["slow", "fast"]
    _, args = fake.log[1]
    grid, stream, tail = args[:3], args[3], args[9:]
    assert grid == (3, 2, 1) and stream == 1234
    assert args[6:9] == (None, None, None)  # no launch metadata or hooks
    assert tail == (x, 48, 0.25, 16, 7)  # runtime args, then constexprs (FLAG's default) in order


@pytest.mark.parametrize(
    "change",
    [
        lambda x: (x.to(torch.float16), 32, 0.5),  # dtype
        lambda x: (x[1:], 32, 0.5),  # a pointer 4 bytes off 16-byte alignment
        lambda x: (x, 33, 0.5),  # an int no longer divisible by 16
        lambda x: (x, 1, 0.5),  # an int equal to 1 (Triton specializes it)
        lambda x: (x, 2**40, 0.5),  # an int beyond i32
        lambda x: (x, 32, 1),  # an int where a float was
    ],
    ids=["dtype", "unaligned", "divisibility", "one", "i64", "type"],
)
def test_anything_triton_specializes_on_is_a_miss(fake, change):
    x = torch.zeros(64)
    _launch.launch(fake, (1,), x, 32, 0.5, BLOCK=16)
    _launch.launch(fake, (1,), *change(x), BLOCK=16)
    assert _kinds(fake) == ["slow", "slow"]
    assert len(_launch.cached_keys(fake)) == 2


def test_constexprs_and_options_are_part_of_the_key(fake):
    x = torch.zeros(64)
    _launch.launch(fake, (1,), x, 32, 0.5, BLOCK=16, num_warps=4)
    _launch.launch(fake, (1,), x, 32, 0.5, BLOCK=32, num_warps=4)
    _launch.launch(fake, (1,), x, 32, 0.5, BLOCK=16, num_warps=8)
    _launch.launch(fake, (1,), x, 32, 0.5, BLOCK=16, num_warps=4)
    assert _kinds(fake) == ["slow", "slow", "slow", "fast"]


def test_hooks_and_pre_run_hooks_take_tritons_path(fake, monkeypatch):
    x = torch.zeros(64)
    _launch.launch(fake, (1,), x, 32, 0.5, BLOCK=16)
    monkeypatch.setattr(_launch._runtime_knobs, "launch_enter_hook", SimpleNamespace(calls=[print]))
    _launch.launch(fake, (1,), x, 32, 0.5, BLOCK=16)
    assert _kinds(fake) == ["slow", "slow"]
    hooked = _FakeKernel()
    hooked.pre_run_hooks.append(print)
    monkeypatch.setattr(_launch._runtime_knobs, "launch_enter_hook", None)
    for _ in range(2):
        _launch.launch(hooked, (1,), x, 32, 0.5, BLOCK=16)
    assert _kinds(hooked) == ["slow", "slow"]


def test_unexpected_internals_turn_the_fast_path_off(fake):
    x = torch.zeros(64)
    for _ in range(3):  # BLOCK neither passed nor defaulted: the launcher's arguments are unknown
        _launch.launch(fake, (1,), x, 32, 0.5)
    assert _kinds(fake) == ["slow", "slow", "slow"]


def test_a_rebound_global_takes_tritons_path(fake):
    namespace = {"G": object()}
    fake.used_global_vals = {("G", id(namespace)): (namespace["G"], namespace)}
    x = torch.zeros(64)
    for _ in range(2):
        _launch.launch(fake, (1,), x, 32, 0.5, BLOCK=16)
    namespace["G"] = object()  # Triton would now raise: its path decides
    _launch.launch(fake, (1,), x, 32, 0.5, BLOCK=16)
    assert _kinds(fake) == ["slow", "fast", "slow"]


# -- on the GPU: the real thing ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fast_path_matches_kernel_grid_and_keys_separate(dtype):
    if not _launch.ENABLED:
        pytest.skip("fast launch disabled here (POLYKERNEL_FAST_LAUNCH=0 or TRITON_INTERPRET=1)")
    kernel = tk._rms_fwd_kernel
    _launch.clear()
    base = torch.randn(257 * 4096 + 8, device="cuda", dtype=dtype)
    w = torch.randn(4096, device="cuda", dtype=dtype)
    for offset in (0, 1):  # 16-byte aligned, then not
        x = base[offset : offset + 257 * 4096].view(257, 4096)
        outs = []
        for how in ("grid", "launch-miss", "launch-hit"):
            y, rstd = torch.empty_like(x), torch.empty(257, device="cuda")
            grid, args, meta = _rms_args(x, w, y, rstd)
            if how == "grid":
                kernel[grid](*args, **meta)
            else:
                _launch.launch(kernel, grid, *args, **meta)
            outs.append((y, rstd))
        torch.cuda.synchronize()
        for y, rstd in outs[1:]:
            assert torch.equal(y, outs[0][0]) and torch.equal(rstd, outs[0][1])
    keys = [k for k in _launch.cached_keys(kernel) if dtype in k]
    aligned = {k[k.index(dtype) + 1] for k in keys}
    assert aligned == {True, False}, keys


@pytest.mark.gpu
def test_gpu_keys_separate_dtypes():
    if not _launch.ENABLED:
        pytest.skip("fast launch disabled here")
    _launch.clear()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(8, 256, device="cuda", dtype=dtype)
        w = torch.randn(256, device="cuda", dtype=dtype)
        y, rstd = torch.empty_like(x), torch.empty(8, device="cuda")
        grid, args, meta = _rms_args(x, w, y, rstd)
        _launch.launch(tk._rms_fwd_kernel, grid, *args, **meta)
    keys = _launch.cached_keys(tk._rms_fwd_kernel)
    seen = {next(v for v in k if isinstance(v, torch.dtype)) for k in keys}
    assert seen == {torch.float32, torch.bfloat16, torch.float16}


# -- the lean autograd apply -------------------------------------------------------------------


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * x * scale

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * g * ctx.scale, None


def test_lean_apply_records_the_same_node_and_gradient():
    from polykernel.backends.triton._autograd import lean_apply

    x = torch.randn(5, requires_grad=True)
    y = lean_apply(_Square)(x, 3.0)
    assert type(y.grad_fn) is type(_Square.apply(x, 3.0).grad_fn)
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, 6 * x.detach())


def test_lean_apply_defers_to_apply_under_functorch_transforms():
    from polykernel.backends.triton._autograd import lean_apply

    x = torch.randn(5)
    with pytest.raises(RuntimeError, match="setup_context") as plain:
        torch.func.grad(lambda t: _Square.apply(t, 3.0).sum())(x)
    with pytest.raises(RuntimeError, match="setup_context") as lean:
        torch.func.grad(lambda t: lean_apply(_Square)(t, 3.0).sum())(x)
    assert str(lean.value) == str(plain.value)


@pytest.mark.skipif(_compat.function_apply(_Square) is None, reason="no C entry point here (polykernel._compat): lean_apply is cls.apply")
def test_lean_apply_switch_routes_through_apply(monkeypatch):
    from polykernel.backends.triton import _autograd

    calls = []
    original = _Square.apply.__func__

    def counting(cls, *args):
        calls.append(args)
        return original(cls, *args)

    monkeypatch.setattr(_Square, "apply", classmethod(counting))
    lean = _autograd.lean_apply(_Square)
    x = torch.randn(5, requires_grad=True)
    lean(x, 3.0)
    assert calls == []  # on: the C entry point, not the Python wrapper
    old = _autograd.set_enabled(False)
    try:
        y = lean(x, 3.0)
    finally:
        _autograd.set_enabled(old)
    assert len(calls) == 1 and old is True
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, 6 * x.detach())


@pytest.mark.parametrize("p, n", [(1, 5), (7, 64), (33, 130), (70, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_colsum_matches_sum_then_cast(p, n, dtype):
    from polykernel.backends.triton._colsum import colsum

    part = torch.randn(p, n, dtype=torch.float32)
    out = colsum(part, dtype)
    assert out.shape == (n,) and out.dtype == dtype
    # fp32 sums in another order, then one rounding: equal to within one ulp of the output dtype
    torch.testing.assert_close(out, part.sum(0).to(dtype), rtol=2 * torch.finfo(dtype).eps, atol=1e-5)


def test_plain_cdiv_and_next_pow2_match_triton():
    from polykernel.backends.triton._rows import cdiv, next_pow2

    for a in [*range(0, 70), 4095, 4096, 4097, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_pow2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 8, 16, 127, 4096):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
