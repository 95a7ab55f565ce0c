"""Ops under ``torch.autocast`` on the CPU: what the equivalent torch code computes there.

Autocast lowers matmuls and leaves elementwise math alone. The fused linear ops take their heads
as ``F.linear`` under autocast does (the op on the head's inputs cast to autocast's dtype), every
impl alike, eager and compiled; an op's own fp32 math is never lowered behind its back."""

import inspect

import pytest
import torch
import torch.nn.functional as F

import polykernel as pk
from polykernel.core import registry
from polykernel.errors import ImplNotAvailableError
from polykernel.ops import _autocast
from polykernel.spec import CapabilityRequirement
from polykernel.testing import isolated, runnable_impls

BF16 = torch.bfloat16
PREFERENCE = ["fused_linear_dpo_loss", "fused_linear_orpo_loss", "fused_linear_cpo_loss", "fused_linear_simpo_loss",
              "fused_linear_kto_loss", "fused_linear_grpo_loss"]  # fmt: skip
HEAD_KWARGS = ("ref_hidden", "ref_weight", "ref_bias")


def _need(op, impl, dtype=torch.float32):
    if impl not in runnable_impls(op, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


def _fresh(args, kwargs):
    """Leaf copies of the case's tensors (the same values each time)."""
    copy = lambda a: a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
    return [copy(a) for a in args], {k: copy(v) for k, v in kwargs.items()}


def _floats(out):
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _run(fn, args, kwargs, *, autocast, cast_heads=False, device="cpu", cast=None):
    """The call's float outputs and the gradients of its first one for the leaves that need them."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if cast is not None:
        args, kwargs = cast(args, kwargs)
    if cast_heads:  # the heads' inputs as F.linear under autocast takes them (differentiable casts)
        args = [a.to(BF16) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
        kwargs = {k: v.to(BF16) if k in HEAD_KWARGS and v is not None else v for k, v in kwargs.items()}
    with torch.autocast(device, dtype=BF16, enabled=autocast):
        outs = _floats(fn(*args, **kwargs))
    return [o.detach() for o in outs], list(torch.autograd.grad(outs[0], leaves))


# -- the fused linear ops: heads as F.linear under autocast, every impl alike -------------------------


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_fused_linear_jsd_under_cpu_autocast_is_the_op_on_autocast_heads(impl, dtype):
    # Both heads' logits as F.linear under autocast (bf16), the JSD in fp32. Was: the projections'
    # fp32 matmuls lowered to bf16 behind the op's back, which the Triton chunk read as fp32 (NaN or
    # 0.3 off; bf16 inputs too, through their fp32 upcast), the torch one in bf16 (2.5e-3 off)
    _need("fused_linear_jsd", impl)
    g = torch.Generator().manual_seed(0)
    hs, ws = torch.randn(8, 16, generator=g), torch.randn(300, 16, generator=g)
    ht, wt = torch.randn(8, 24, generator=g), torch.randn(300, 24, generator=g)
    hs, ws = hs.to(dtype).requires_grad_(), ws.to(dtype).requires_grad_()
    ht, wt = ht.to(dtype), wt.to(dtype)
    loss = lambda *a: pk.fused_linear_jsd(*a, beta=0.3, impl=impl)
    got, got_g = _run(loss, (hs, ws, ht, wt), {}, autocast=True)
    # the same op on the heads' inputs in bf16, autocast off
    want = loss(hs.to(BF16), ws.to(BF16), ht.to(BF16), wt.to(BF16))
    want_g = torch.autograd.grad(want, (hs, ws))
    assert got[0].dtype == torch.float32 and torch.isfinite(got[0])
    torch.testing.assert_close(got[0], want.detach())
    for a, b, x in zip(got_g, want_g, (hs, ws)):
        assert a.dtype == x.dtype
        torch.testing.assert_close(a, b)
    # and the torch code it stands for, under the same autocast (which also rounds the logits to bf16)
    with torch.autocast("cpu", dtype=BF16):
        ref = pk.jsd(F.linear(hs, ws).float().log_softmax(-1), F.linear(ht, wt).float().log_softmax(-1), beta=0.3, impl="torch")
    torch.testing.assert_close(got[0], ref.detach(), rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("name", PREFERENCE)
def test_fused_linear_preference_losses_under_cpu_autocast_are_the_op_on_autocast_heads(name, impl):
    # Was: the chunk's logits lowered to bf16 by autocast, the bias added in bf16 and the gradient
    # matmuls partly lowered, differently per impl (DPO: torch 0.048 off, Triton 0.026)
    op = registry.get_op(name)
    _need(op.id, impl)
    torch.manual_seed(0)
    cases = op.cases("cpu", torch.float32)
    case = next((c for c in cases if "ref-head" in c.label), cases[0])  # a reference head where the loss takes one
    fn = lambda *a, **k: getattr(pk, name)(*a, impl=impl, **k)
    got, got_g = _run(fn, *_fresh(case.args, case.kwargs), autocast=True)
    want, want_g = _run(fn, *_fresh(case.args, case.kwargs), autocast=False, cast_heads=True)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for a, b in zip(got + got_g, want + want_g):
        torch.testing.assert_close(a, b)


# -- an op's own fp32 matmuls stay fp32 ----------------------------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_cross_entropy_with_class_weights_and_smoothing_under_cpu_autocast(impl):
    # F.cross_entropy runs in fp32 under autocast; so does ours. Was: the smoothing term's
    # z @ w (a matvec over the classes) lowered to bf16 in the torch impl (60x the fp32 error)
    _need("cross_entropy", impl)
    g = torch.Generator().manual_seed(0)
    x, t, w = 4 * torch.randn(8, 1000, generator=g), torch.randint(0, 1000, (8,), generator=g), torch.rand(1000, generator=g) + 0.5
    with torch.autocast("cpu", dtype=BF16):
        got = pk.cross_entropy(x, t, weight=w, label_smoothing=0.1, reduction="none", impl=impl)
        want = F.cross_entropy(x, t, weight=w, label_smoothing=0.1, reduction="none")
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["moe_experts", "moe_experts_gpt_oss"])
def test_moe_experts_looped_gemms_under_cpu_autocast_compute_in_the_inputs_dtype(name):
    # Sizes torch._grouped_mm refuses (H, I not multiples of 16 bytes) take one F.linear per
    # expert, which autocast lowered to bf16 (0.01 off) while the grouped path and the Triton impl
    # ran fp32: the op's result depended on a size. Now the same as without autocast.
    op = registry.get_op(name)
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 7, 10, 6, 3, 2
    hidden = torch.randn(t, h, generator=g)
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    if name == "moe_experts":
        args = (hidden, index, weights, torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g))
    else:  # gpt-oss: interleaved gate/up [E, H, 2I] with biases, down [E, I, H]
        args = (hidden, index, weights, torch.randn(e, h, 2 * i, generator=g), torch.randn(e, 2 * i, generator=g),
                torch.randn(e, i, h, generator=g), torch.randn(e, h, generator=g))  # fmt: skip
    fn = getattr(pk, name)
    want = fn(*args, impl="torch")
    with torch.autocast("cpu", dtype=BF16):
        got = fn(*args, impl="torch")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, op.reference(*args), rtol=1e-5, atol=1e-5)


# -- compiled: the custom op runs with autocast off, so the casts are traced ----------------------------


@pytest.mark.parametrize("name", ["fused_linear_cross_entropy", "fused_linear_jsd"])
def test_compiled_fused_linear_ops_under_cpu_autocast_match_eager(name):
    # Was: the compiled call computed the heads in fp32 (0.007 off the eager loss of FLCE)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(8, 16, generator=g), torch.randn(40, 16, generator=g)
    t = torch.randint(0, 40, (8,), generator=g)
    if name == "fused_linear_cross_entropy":
        fn = lambda h, w: pk.fused_linear_cross_entropy(h, w, t, impl="torch")
    else:
        fn = lambda h, w: pk.fused_linear_jsd(h, w, 0.5 * h, 0.9 * w, impl="torch")
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    outs = []
    for f in (fn, compiled):
        leaves = (h.clone().requires_grad_(), w.clone().requires_grad_())
        with torch.autocast("cpu", dtype=BF16):
            loss = f(*leaves)
        outs.append((loss.detach(), *torch.autograd.grad(loss, leaves)))
    for a, b in zip(*outs):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(b, a)


# -- every impl alike: a peer's too (its own matmuls, which autocast would lower its own way) -------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", ["fused_linear_cross_entropy", "fused_linear_jsd", *PREFERENCE])
def test_under_autocast_every_impl_gets_the_heads_cast_and_autocast_off(name, compiled):
    # Was: only our drivers cast the heads; a peer's impl (Liger's, which runs its own matmuls)
    # got the fp32 heads with autocast on, and computed whatever autocast made of its code. Under
    # torch.compile the preference losses (compile mode "eager": a graph break around the eager
    # call) still did: the call behind the break ran with autocast on, on the fp32 heads.
    op = registry.get_op(name)
    heads = [i for i, p in enumerate(inspect.signature(op.reference).parameters) if p in _autocast.HEADS]
    seen = []

    def spy(*args):
        seen.append(
            (torch.is_autocast_enabled("cpu"), [args[i].dtype for i in heads if i < len(args) and isinstance(args[i], torch.Tensor)])
        )
        return op.reference(*args)

    case = op.cases("cpu", torch.float32)[0]
    args, kwargs = _fresh(case.args, case.kwargs)
    with isolated():
        pk.register_impl(op=name, backend="liger", rank=0, capabilities=frozenset({CapabilityRequirement.CPU}))(spy)
        pk.clear_caches()
        try:
            call = lambda *a: getattr(pk, name)(*a, impl="liger", **kwargs)
            if compiled:
                torch._dynamo.reset()
                call = torch.compile(call, backend="eager")
            with torch.autocast("cpu", dtype=BF16):
                call(*args)
        finally:
            pk.clear_caches()
    (on, dtypes), *_ = seen
    assert not on and len(dtypes) >= 2 and set(dtypes) == {BF16}, (on, dtypes)


def _cast_heads(op, args, kwargs):
    """The op's head arguments (ops._autocast.HEADS) in bf16, differentiably: F.linear's under autocast."""
    names = list(inspect.signature(op.reference).parameters)
    cast = lambda a: a.to(BF16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
    return [cast(a) if names[i] in _autocast.HEADS else a for i, a in enumerate(args)], {
        k: cast(v) if k in _autocast.HEADS else v for k, v in kwargs.items()
    }


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fused_linear_cross_entropy", "fused_linear_jsd", *PREFERENCE])
def test_under_cuda_autocast_every_impl_is_the_op_on_autocast_heads(name):
    # Autocast training on the GPU (fp32 master weights, bf16 matmuls): each impl that can run,
    # peers included, computes what it computes on the heads cast to bf16 with autocast off.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    op = registry.get_op(name)
    torch.manual_seed(0)
    case = op.cases("cuda", torch.float32)[0]
    ran = []
    for impl in runnable_impls(op, "cuda", BF16):
        fn = lambda *a, impl=impl, **k: getattr(pk, name)(*a, impl=impl, **k)
        try:
            got, got_g = _run(fn, *_fresh(case.args, case.kwargs), autocast=True, device="cuda")
        except ImplNotAvailableError:  # its predicate refuses this case (an option it lacks)
            continue
        want, want_g = _run(fn, *_fresh(case.args, case.kwargs), autocast=False, device="cuda", cast=lambda a, k: _cast_heads(op, a, k))
        assert [t.dtype for t in got] == [t.dtype for t in want], impl
        for a, b in zip(got + got_g, want + want_g):  # the same impl on the same bf16 heads: up to its atomics' order
            torch.testing.assert_close(
                a, b, rtol=2e-2, atol=1e-2 * max(b.abs().max().item(), 1e-6), msg=lambda m, impl=impl: f"{impl}: {m}"
            )
        ran.append(impl)
    assert ran


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_linear_cross_entropy_takes_mixed_head_dtypes_under_autocast_as_f_linear_does(impl):
    # An fp32 hidden state (an fp32 final norm) with a bf16 head: F.linear under autocast takes it.
    # Was: refused on the CPU (validation ran before the cast) and taken on CUDA (after it).
    _need("fused_linear_cross_entropy", impl, BF16)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 16, generator=g).requires_grad_()
    w = torch.randn(40, 16, generator=g).to(BF16).requires_grad_()
    t = torch.randint(0, 40, (6,), generator=g)
    with torch.autocast("cpu", dtype=BF16):
        loss, acc = pk.fused_linear_cross_entropy(h, w, t, impl=impl, return_token_accuracy=True)
        logits = F.linear(h, w)
    want = F.cross_entropy(logits.float(), t)
    torch.testing.assert_close(loss, want)
    assert acc.item() == (logits.argmax(-1) == t).float().mean().item()
    gh, gw = torch.autograd.grad(loss, (h, w))
    wh, ww = torch.autograd.grad(want, (h, w))
    assert (gh.dtype, gw.dtype) == (torch.float32, BF16)
    torch.testing.assert_close(gh, wh, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(gw, ww, rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "softmax", "cross_entropy"])
def test_under_cuda_autocast_the_common_ops_keep_their_inputs_dtype(name, x_dtype):
    # CUDA autocast runs F.rms_norm, F.layer_norm and softmax in fp32 (fp32 outputs for 16-bit
    # inputs; AutocastCUDA's fp32 list): ours compute in fp32 too but return the input's dtype, as
    # Liger's and HF's own norm modules do (docs/impls.md, "Under torch.autocast"); the values are
    # torch's to that dtype's rounding. The loss is fp32 either way.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 512, device="cuda", generator=g).to(x_dtype)
    w = (1 + 0.1 * torch.randn(512, device="cuda", generator=g)).to(x_dtype)
    b = (0.1 * torch.randn(512, device="cuda", generator=g)).to(x_dtype)
    t = torch.randint(0, 512, (64,), device="cuda", generator=g)
    ours, theirs = {
        "rms_norm": (lambda: pk.rms_norm(x, w, 1e-6), lambda: F.rms_norm(x, (512,), w, 1e-6)),
        "layer_norm": (lambda: pk.layer_norm(x, w, b, 1e-5), lambda: F.layer_norm(x, (512,), w, b, 1e-5)),
        "softmax": (lambda: pk.softmax(x), lambda: torch.softmax(x, -1)),
        "cross_entropy": (lambda: pk.cross_entropy(x, t), lambda: F.cross_entropy(x, t)),
    }[name]
    with torch.autocast("cuda", dtype=BF16):
        got, want = ours(), theirs()
    assert got.dtype == (torch.float32 if name == "cross_entropy" else x_dtype), (got.dtype, want.dtype)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=2e-2, atol=2e-2)
