"""polykernel.nn: each module against its torch equivalent (forward and parameter/input gradients),
``impl=`` passthrough (which impl actually ran), repr and reset_parameters.

Ops that have not landed in this build skip with the missing module named.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import polykernel
import polykernel.nn as pnn
from polykernel.core import registry
from polykernel.errors import ImplNotAvailableError, OpArgumentError
from polykernel.testing import runnable_impls


def need(op: str) -> None:
    if importlib.util.find_spec(f"polykernel.ops.{op}") is None:
        pytest.skip(f"polykernel.{op} has not landed in this build (src/polykernel/ops/{op}.py is missing)")


# None (the dispatcher's choice) and each impl by name; a named impl that cannot run here skips.
IMPLS = [None, "torch", "triton"]


def skip_unless_runnable(op: str, impl: str | None, dtype: torch.dtype = torch.float32) -> None:
    need(op)
    if impl is not None and impl not in runnable_impls(op, "cpu", dtype):
        pytest.skip(f"{op}: impl {impl!r} cannot run on the CPU here")


# Forward / backward tolerances per dtype: a module adds no math of its own, so these are the
# ops' own bounds (fp32: reduction order; bf16: one or two roundings of the output, ~2^-7).
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def grads_of(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return list(torch.autograd.grad(out, inputs, g))


def assert_close_all(xs: list[torch.Tensor], ys: list[torch.Tensor], dtype: torch.dtype, scale: float = 1.0) -> None:
    tol = {k: v * scale for k, v in TOL[dtype].items()}
    for i, (x, y) in enumerate(zip(xs, ys)):
        torch.testing.assert_close(x, y, **tol, msg=lambda m, i=i: f"tensor {i}: {m}")


# ------------------------------------------------------------------------------------------------
# RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_rmsnorm_matches_torch_nn_rmsnorm(impl, dtype):
    skip_unless_runnable("rms_norm", impl, dtype)
    torch.manual_seed(0)
    ours = pnn.RMSNorm(48, eps=1e-5, impl=impl, dtype=dtype)
    theirs = torch.nn.RMSNorm(48, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        ours.weight.copy_(1 + 0.1 * torch.randn(48))
    theirs.load_state_dict(ours.state_dict())  # same parameter names
    x = torch.randn(3, 5, 48, dtype=dtype)
    xa, xb = leaf(x), leaf(x)
    ya, yb = ours(xa), theirs(xb)
    assert ya.dtype == dtype
    torch.testing.assert_close(ya, yb, **TOL[dtype])
    assert_close_all(grads_of(ya, [xa, ours.weight]), grads_of(yb, [xb, theirs.weight]), dtype, scale=2)


def test_rmsnorm_llama_casting_matches_hugging_face():
    need("rms_norm")
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(0)
    hf = modeling.LlamaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(64))
    ours = pnn.RMSNorm(64, eps=1e-6, casting="llama", dtype=torch.bfloat16)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(4, 9, 64, dtype=torch.bfloat16)
    # bf16: the same two roundings in the same order; each result is within the op's error model
    # of the exact one, so the two are within twice that of each other
    from polykernel.ops.rms_norm import error_model

    want = hf(x)
    tol = error_model(x, ours.weight, 1e-6, casting="llama").output(0).tol(torch.bfloat16, want.double().abs().max().item())
    torch.testing.assert_close(ours(x), want, atol=2 * tol.atol, rtol=2 * tol.rtol)
    fp32 = pnn.RMSNorm(64, eps=1e-6, casting="fp32", dtype=torch.bfloat16)
    fp32.load_state_dict(hf.state_dict())
    assert not torch.equal(fp32(x), ours(x))  # the casting reaches the op


def test_rmsnorm_gemma_offset_initializes_to_unit_scale():
    need("rms_norm")
    norm = pnn.RMSNorm(16, offset=1.0)
    assert torch.equal(norm.weight, torch.zeros(16))  # Gemma stores w with 1 + w applied
    x = torch.randn(5, 16)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (16,), eps=1e-6))
    with torch.no_grad():
        norm.weight.fill_(0.5)
    torch.testing.assert_close(norm(x), 1.5 * torch.nn.functional.rms_norm(x, (16,), eps=1e-6))
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.zeros(16))


@pytest.mark.parametrize("casting", ["fp32", "llama"])
def test_rmsnorm_with_residual_returns_normed_sum_and_sum(casting):
    need("rms_norm")
    if casting == "fp32":
        need("fused_add_rms_norm")
    torch.manual_seed(0)
    norm = pnn.RMSNorm(32, casting=casting, dtype=torch.bfloat16, impl="torch")
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(32))
    x, r = torch.randn(6, 32, dtype=torch.bfloat16), torch.randn(6, 32, dtype=torch.bfloat16)
    y, s = norm(x, r)
    assert torch.equal(s, x + r)
    assert torch.equal(y, norm(x + r))


def test_rmsnorm_repr_and_reset():
    need("rms_norm")
    norm = pnn.RMSNorm(8, eps=1e-5, impl="torch")
    assert repr(norm) == "RMSNorm((8,), eps=1e-05, casting='fp32', impl='torch')"
    assert "offset=1.0" in repr(pnn.RMSNorm(8, offset=1.0))
    with torch.no_grad():
        norm.weight.mul_(3)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(8))


# ------------------------------------------------------------------------------------------------
# LayerNorm


@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("impl", IMPLS)
def test_layernorm_matches_torch_nn_layernorm(impl, affine, bias):
    skip_unless_runnable("layer_norm", impl)
    torch.manual_seed(0)
    theirs = torch.nn.LayerNorm(40, eps=1e-5, elementwise_affine=affine, bias=bias)
    if affine:
        with torch.no_grad():
            theirs.weight.copy_(1 + 0.1 * torch.randn(40))
            if bias:
                theirs.bias.copy_(0.1 * torch.randn(40))
    ours = pnn.LayerNorm(40, eps=1e-5, elementwise_affine=affine, bias=bias, impl=impl)
    ours.load_state_dict(theirs.state_dict())  # same names and presence of weight/bias
    x = torch.randn(2, 7, 40)
    xa, xb = leaf(x), leaf(x)
    ya, yb = ours(xa), theirs(xb)
    torch.testing.assert_close(ya, yb, **TOL[torch.float32])
    params_a = [xa] + [p for p in (ours.weight, ours.bias) if p is not None]
    params_b = [xb] + [p for p in (theirs.weight, theirs.bias) if p is not None]
    assert_close_all(grads_of(ya, params_a), grads_of(yb, params_b), torch.float32, scale=5)


def test_layernorm_repr_and_reset():
    need("layer_norm")
    ln = pnn.LayerNorm(6, bias=False)
    assert ln.bias is None and "bias=False" in repr(ln)
    with torch.no_grad():
        ln.weight.zero_()
    ln.reset_parameters()
    assert torch.equal(ln.weight, torch.ones(6))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_layernorm_without_weight_rejects_the_size_under_compile(fullgraph):
    # the layer checks x's size itself (no weight: the op cannot); that raise, in traced code, was
    # "Observed exception" under fullgraph (the message lost): now the error the eager call raises
    need("layer_norm")
    ln = pnn.LayerNorm(16, elementwise_affine=False)
    x = torch.randn(4, 8)
    with pytest.raises(OpArgumentError) as eager:
        ln(x)
    torch._dynamo.reset()
    with pytest.raises(OpArgumentError) as got:
        torch.compile(ln, fullgraph=fullgraph, backend="eager")(x)
    assert str(got.value) == str(eager.value) and (got.value.op, got.value.arg) == ("LayerNorm", "x")
    torch.testing.assert_close(torch.compile(ln, fullgraph=fullgraph, backend="eager")(torch.randn(4, 16)).shape, torch.Size([4, 16]))


# ------------------------------------------------------------------------------------------------
# SwiGLU / GEGLU


def _torch_gated(mod: torch.nn.Module, x: torch.Tensor, act) -> torch.Tensor:
    return mod.down_proj(act(mod.gate_proj(x)) * mod.up_proj(x))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_swiglu_matches_silu_times_up(impl, bias):
    skip_unless_runnable("swiglu", impl)
    torch.manual_seed(0)
    mlp = pnn.SwiGLU(24, 40, bias=bias, impl=impl)
    assert (mlp.gate_proj.bias is not None) == bias
    x = torch.randn(3, 5, 24)
    xa, xb = leaf(x), leaf(x)
    params = list(mlp.parameters())
    ya = mlp(xa)
    ga = grads_of(ya, [xa, *params])
    yb = _torch_gated(mlp, xb, F.silu)
    gb = grads_of(yb, [xb, *params])
    torch.testing.assert_close(ya, yb, **TOL[torch.float32])
    assert_close_all(ga, gb, torch.float32, scale=5)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("impl", IMPLS)
def test_geglu_matches_gelu_times_up(impl, approximate):
    skip_unless_runnable("geglu", impl)
    torch.manual_seed(0)
    mlp = pnn.GEGLU(16, 36, approximate=approximate, impl=impl)
    x = torch.randn(4, 16)
    xa, xb = leaf(x), leaf(x)
    params = list(mlp.parameters())
    ya = mlp(xa)
    ga = grads_of(ya, [xa, *params])
    yb = _torch_gated(mlp, xb, lambda g: F.gelu(g, approximate=approximate))
    gb = grads_of(yb, [xb, *params])
    torch.testing.assert_close(ya, yb, **TOL[torch.float32])
    assert_close_all(ga, gb, torch.float32, scale=5)


def test_gated_mlp_state_dict_uses_hugging_face_names():
    mlp = pnn.SwiGLU(8, 12)
    assert set(mlp.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert "approximate='tanh'" in repr(pnn.GEGLU(8, 12))
    with pytest.raises(ValueError, match="approximate"):
        pnn.GEGLU(8, 12, approximate="erf")
    before = mlp.down_proj.weight.clone()
    mlp.reset_parameters()
    assert not torch.equal(before, mlp.down_proj.weight)


# ------------------------------------------------------------------------------------------------
# Softmax, RotaryEmbedding


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_matches_torch(impl):
    skip_unless_runnable("softmax", impl)
    x = torch.randn(3, 4, 50)
    xa, xb = leaf(x), leaf(x)
    ya, yb = pnn.Softmax(impl=impl)(xa), torch.softmax(xb, -1)
    torch.testing.assert_close(ya, yb, **TOL[torch.float32])
    assert_close_all(grads_of(ya, [xa]), grads_of(yb, [xb]), torch.float32)


# ------------------------------------------------------------------------------------------------
# GroupNorm, DyT, PolyNorm, ReLUSquared, Sparsemax


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_groupnorm_matches_torch_nn_groupnorm(impl, affine):
    skip_unless_runnable("group_norm", impl)
    torch.manual_seed(0)
    ours = pnn.GroupNorm(4, 12, eps=1e-5, affine=affine, impl=impl)
    theirs = torch.nn.GroupNorm(4, 12, eps=1e-5, affine=affine)
    if affine:
        with torch.no_grad():
            ours.weight.copy_(1 + 0.1 * torch.randn(12))
            ours.bias.copy_(0.1 * torch.randn(12))
    theirs.load_state_dict(ours.state_dict())  # same parameter names
    x = torch.randn(3, 12, 5, 4)
    xa, xb = leaf(x), leaf(x)
    ya, yb = ours(xa), theirs(xb)
    torch.testing.assert_close(ya, yb, **TOL[torch.float32])
    params_a, params_b = ([ours.weight, ours.bias], [theirs.weight, theirs.bias]) if affine else ([], [])
    assert_close_all(grads_of(ya, [xa, *params_a]), grads_of(yb, [xb, *params_b]), torch.float32, scale=2)


def test_groupnorm_repr_reset_and_errors():
    gn = pnn.GroupNorm(2, 6, impl="torch")
    assert repr(gn) == "GroupNorm(2, 6, eps=1e-05, affine=True, impl='torch')"
    with torch.no_grad():
        gn.weight.fill_(3.0)
    gn.reset_parameters()
    assert torch.equal(gn.weight, torch.ones(6)) and torch.equal(gn.bias, torch.zeros(6))
    with pytest.raises(ValueError, match="divide"):
        pnn.GroupNorm(4, 6)


def test_dyt_loads_a_liger_checkpoint():
    # LigerDyT names its parameters alpha, gamma, beta (ours: the paper's alpha, weight, bias): a
    # model trained with Liger's module loads into ours, strict, and ours saves its own names
    alpha, gamma, beta = torch.tensor([0.3]), torch.randn(8), torch.randn(8)
    outer = torch.nn.Sequential(pnn.DyT(8))
    outer.load_state_dict({"0.alpha": alpha, "0.gamma": gamma, "0.beta": beta})
    m = outer[0]
    assert torch.equal(m.alpha.detach(), alpha) and torch.equal(m.weight.detach(), gamma) and torch.equal(m.bias.detach(), beta)
    assert set(outer.state_dict()) == {"0.alpha", "0.weight", "0.bias"}
    no_bias = pnn.DyT(8, bias=False)
    no_bias.load_state_dict({"alpha": alpha, "gamma": gamma})
    assert torch.equal(no_bias.weight.detach(), gamma)
    with pytest.raises(RuntimeError, match="beta"):  # Liger's bias into a module without one: not dropped silently
        pnn.DyT(8, bias=False).load_state_dict({"alpha": alpha, "gamma": gamma, "beta": beta})
    with pytest.raises(RuntimeError, match="weight"):  # both names of one parameter: an error, neither wins
        pnn.DyT(8).load_state_dict({"alpha": alpha, "gamma": gamma, "weight": gamma, "bias": beta})


@pytest.mark.parametrize("impl", IMPLS)
def test_dyt_module_is_weight_tanh_alpha_x_plus_bias(impl):
    skip_unless_runnable("dyt", impl)
    m = pnn.DyT(16, init_alpha=0.7, impl=impl)
    assert m.alpha.shape == (1,) and torch.equal(m.alpha, torch.tensor([0.7]))
    with torch.no_grad():
        m.weight.copy_(1 + 0.1 * torch.randn(16))
        m.bias.copy_(0.1 * torch.randn(16))
    x = leaf(torch.randn(3, 5, 16))
    y = m(x)
    want = m.weight * torch.tanh(m.alpha * x) + m.bias
    torch.testing.assert_close(y, want, **TOL[torch.float32])
    assert_close_all(grads_of(y, [x, m.alpha, m.weight, m.bias]), grads_of(want, [x, m.alpha, m.weight, m.bias]), torch.float32)
    assert pnn.DyT(8, bias=False).bias is None
    assert repr(pnn.DyT(8, bias=False)) == "DyT((8,), init_alpha=0.5, bias=False)"


@pytest.mark.parametrize("impl", IMPLS)
def test_polynorm_module_starts_at_the_polycom_initialization(impl):
    skip_unless_runnable("poly_norm", impl)
    m = pnn.PolyNorm(impl=impl)
    assert torch.equal(m.weight, torch.full((3,), 1 / 3)) and torch.equal(m.bias, torch.tensor(1.0))
    x = leaf(torch.randn(4, 24))
    y = m(x)

    def norm(u):
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6)

    w, b = m.weight, m.bias  # 1/3 each and 1
    want = w[0] * norm(x**3) + w[1] * norm(x**2) + w[2] * norm(x) + b
    torch.testing.assert_close(want, (norm(x**3) + norm(x**2) + norm(x)) / 3 + 1)
    torch.testing.assert_close(y, want, **TOL[torch.float32])
    assert_close_all(grads_of(y, [x, m.weight, m.bias]), grads_of(want, [x, m.weight, m.bias]), torch.float32, scale=2)


@pytest.mark.parametrize("impl", IMPLS)
def test_relu_squared_and_sparsemax_modules(impl):
    skip_unless_runnable("relu_squared", impl)
    skip_unless_runnable("sparsemax", impl)
    x = torch.randn(3, 4, 10)
    xa, xb = leaf(x), leaf(x)
    ya, yb = pnn.ReLUSquared(impl=impl)(xa), torch.relu(xb) ** 2
    torch.testing.assert_close(ya, yb)
    assert_close_all(grads_of(ya, [xa]), grads_of(yb, [xb]), torch.float32)
    from polykernel.ops.sparsemax import reference

    sm = pnn.Sparsemax(dim=1, impl=impl)
    assert repr(sm) == f"Sparsemax(dim=1{'' if impl is None else f', impl={impl!r}'})"
    xa, xb = leaf(x), leaf(x)
    ya, yb = sm(xa), reference(xb, 1)
    torch.testing.assert_close(ya, yb, **TOL[torch.float32])
    torch.testing.assert_close(ya.sum(1), torch.ones(3, 10))
    assert_close_all(grads_of(ya, [xa]), grads_of(yb, [xb]), torch.float32)


def _hf_rope(q, k, cos, sin):
    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), -1)

    cos, sin = cos[:, None], sin[:, None]
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def test_rotary_cos_sin_match_hugging_face_llama():
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64, rope_theta=10000.0)
    hf = modeling.LlamaRotaryEmbedding(cfg)
    ours = pnn.RotaryEmbedding(16, max_position_embeddings=64, base=10000.0)
    pos = torch.arange(20)[None].expand(2, 20)
    x = torch.randn(2, 20, 16)
    cos_hf, sin_hf = hf(x, pos)
    cos, sin = ours.cos_sin(pos, torch.float32)
    torch.testing.assert_close(cos, cos_hf, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, sin_hf, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_rotary_embedding_matches_rotate_half(impl):
    skip_unless_runnable("rope", impl)
    torch.manual_seed(0)
    rot = pnn.RotaryEmbedding(16, max_position_embeddings=32, impl=impl)
    q, k = torch.randn(2, 4, 10, 16), torch.randn(2, 2, 10, 16)
    qa, ka, qb, kb = leaf(q), leaf(k), leaf(q), leaf(k)
    out_a = rot(qa, ka)
    cos, sin = rot.cos_sin(torch.arange(10), torch.float32)
    out_b = _hf_rope(qb, kb, cos, sin)
    for a, b in zip(out_a, out_b):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    loss_a = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in out_a)
    loss_b = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in out_b)
    assert_close_all(torch.autograd.grad(loss_a, [qa, ka]), torch.autograd.grad(loss_b, [qb, kb]), torch.float32)
    # explicit positions (e.g. decoding at an offset) rotate by those positions
    pos = torch.arange(5, 15)
    cos5, sin5 = rot.cos_sin(pos, torch.float32)
    for a, b in zip(rot(q, k, pos), _hf_rope(q, k, cos5, sin5)):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_rotary_embedding_buffers_and_errors():
    rot = pnn.RotaryEmbedding(8, max_position_embeddings=16)
    assert "inv_freq" not in rot.state_dict()  # recomputed, never stored
    expected = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    torch.testing.assert_close(rot.inv_freq, expected)
    with torch.no_grad():
        rot.inv_freq.zero_()
    rot.reset_parameters()
    torch.testing.assert_close(rot.inv_freq, expected)
    cos, _ = rot.cos_sin(torch.arange(3), torch.bfloat16)
    assert cos.dtype == torch.bfloat16 and cos.shape == (1, 3, 8)
    with pytest.raises(ValueError, match="even"):
        pnn.RotaryEmbedding(7)


# ------------------------------------------------------------------------------------------------
# Losses


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.1}, {"ignore_index": 3}],
    ids=["mean", "sum", "none", "smoothing", "ignore3"],
)
@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_loss_matches_torch(impl, kwargs):
    skip_unless_runnable("cross_entropy", impl)
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 17)
    target = torch.randint(0, 17, (2, 6))
    target[0, 1] = kwargs.get("ignore_index", -100)
    la, lb = leaf(logits), leaf(logits)
    ours = pnn.CrossEntropyLoss(impl=impl, **kwargs)(la, target)
    # torch.nn.CrossEntropyLoss wants the class dim second: [B, V, T]
    theirs = torch.nn.CrossEntropyLoss(**kwargs)(lb.transpose(1, 2), target)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, **TOL[torch.float32])
    torch.testing.assert_close(torch.autograd.grad(ours.sum(), la)[0], torch.autograd.grad(theirs.sum(), lb)[0], **TOL[torch.float32])


def test_cross_entropy_loss_bf16_logits_give_fp32_loss():
    need("cross_entropy")
    logits = torch.randn(8, 33, dtype=torch.bfloat16)
    target = torch.randint(0, 33, (8,))
    loss = pnn.CrossEntropyLoss()(logits, target)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), target))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.2}],
    ids=["mean", "sum", "none", "smoothing"],
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_fused_linear_cross_entropy_loss_matches_linear_then_ce(impl, with_bias, kwargs):
    skip_unless_runnable("fused_linear_cross_entropy", impl)
    torch.manual_seed(0)
    hidden, weight, bias = torch.randn(2, 5, 12), 0.3 * torch.randn(23, 12), 0.1 * torch.randn(23)
    target = torch.randint(0, 23, (2, 5))
    target[1, 2] = -100
    ha, wa, ba = leaf(hidden), leaf(weight), leaf(bias)
    hb, wb, bb = leaf(hidden), leaf(weight), leaf(bias)
    ours = pnn.FusedLinearCrossEntropyLoss(impl=impl, **kwargs)(ha, wa, target, ba if with_bias else None)
    logits = F.linear(hb, wb, bb if with_bias else None)
    theirs = F.cross_entropy(logits.reshape(-1, 23), target.reshape(-1), **kwargs)
    if kwargs.get("reduction") == "none":
        theirs = theirs.reshape(target.shape)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, **TOL[torch.float32])
    inputs_a, inputs_b = [ha, wa] + ([ba] if with_bias else []), [hb, wb] + ([bb] if with_bias else [])
    assert_close_all(torch.autograd.grad(ours.sum(), inputs_a), torch.autograd.grad(theirs.sum(), inputs_b), torch.float32, scale=5)


@pytest.mark.parametrize("cls", [pnn.CrossEntropyLoss, pnn.FusedLinearCrossEntropyLoss])
def test_loss_modules_reject_bad_options_at_construction(cls):
    with pytest.raises(ValueError, match="reduction"):
        cls(reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        cls(label_smoothing=1.5)
    with pytest.raises(TypeError, match="ignore_index"):
        cls(ignore_index=1.0)
    assert "reduction='sum'" in repr(cls(reduction="sum", impl="torch")) and "impl='torch'" in repr(cls(impl="torch"))


# ------------------------------------------------------------------------------------------------
# impl= passthrough: which impl actually ran


@pytest.fixture
def ran(monkeypatch):
    """Records (op id, impl name) for every call the dispatcher routes to an impl."""
    calls: list[tuple[str, str]] = []
    real = registry.load_impl

    def spying_load(spec):
        fn = real(spec)

        def spy(*args, **kwargs):
            calls.append((spec.op, spec.impl))
            return fn(*args, **kwargs)

        return spy

    monkeypatch.setattr(registry, "load_impl", spying_load)
    polykernel.clear_caches()
    yield calls
    polykernel.clear_caches()


def _module_calls():
    """(op, module factory, call) for every module, small CPU shapes."""
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)
    return [
        ("rms_norm", lambda impl: pnn.RMSNorm(8, impl=impl), lambda m: m(torch.randn(3, 8))),
        ("fused_add_rms_norm", lambda impl: pnn.RMSNorm(8, impl=impl), lambda m: m(torch.randn(3, 8), torch.randn(3, 8))),
        ("layer_norm", lambda impl: pnn.LayerNorm(8, impl=impl), lambda m: m(torch.randn(3, 8))),
        ("swiglu", lambda impl: pnn.SwiGLU(8, 12, impl=impl), lambda m: m(torch.randn(3, 8))),
        ("geglu", lambda impl: pnn.GEGLU(8, 12, impl=impl), lambda m: m(torch.randn(3, 8))),
        ("softmax", lambda impl: pnn.Softmax(impl=impl), lambda m: m(torch.randn(3, 8))),
        ("group_norm", lambda impl: pnn.GroupNorm(2, 8, impl=impl), lambda m: m(torch.randn(3, 8, 5))),
        ("dyt", lambda impl: pnn.DyT(8, impl=impl), lambda m: m(torch.randn(3, 8))),
        ("poly_norm", lambda impl: pnn.PolyNorm(impl=impl), lambda m: m(torch.randn(3, 8))),
        ("relu_squared", lambda impl: pnn.ReLUSquared(impl=impl), lambda m: m(torch.randn(3, 8))),
        ("sparsemax", lambda impl: pnn.Sparsemax(impl=impl), lambda m: m(torch.randn(3, 8))),
        ("rope", lambda impl: pnn.RotaryEmbedding(8, impl=impl), lambda m: m(q, k)),
        ("cross_entropy", lambda impl: pnn.CrossEntropyLoss(impl=impl), lambda m: m(torch.randn(3, 8), torch.tensor([1, 2, 3]))),
        (
            "fused_linear_cross_entropy",
            lambda impl: pnn.FusedLinearCrossEntropyLoss(impl=impl),
            lambda m: m(torch.randn(3, 8), torch.randn(5, 8), torch.tensor([1, 2, 3])),
        ),
        (
            "moe_experts",
            lambda impl: pnn.MoEExperts(3, 8, 12, impl=impl),
            lambda m: m(torch.randn(2, 3, 8), torch.tensor([[[0, 2], [1, 0], [2, 1]]] * 2), torch.rand(2, 3, 2)),
        ),
    ]


_MODULE_CALLS = _module_calls()


@pytest.mark.parametrize("op, make, call", _MODULE_CALLS, ids=[c[0] for c in _MODULE_CALLS])
def test_impl_is_passed_through(ran, op, make, call):
    need(op)
    op_id = registry.resolve_op_id(op)
    # a forced impl runs, and only that one
    call(make("torch"))
    assert ran and set(ran) == {(op_id, "torch")}
    # forced triton runs triton where it can (the interpreter on the CPU), else fails strictly
    ran.clear()
    if "triton" in runnable_impls(op, "cpu", torch.float32):
        call(make("triton"))
        assert set(ran) == {(op_id, "triton")}
    # an impl the op does not have is a strict error that names the op and the impl
    with pytest.raises(ImplNotAvailableError) as info:
        call(make("cute_dsl"))
    assert op_id in str(info.value) and "cute_dsl" in str(info.value)
    # impl=None leaves the choice to the dispatcher: a use_impl scope applies
    ran.clear()
    with polykernel.use_impl("torch", op=op):
        call(make(None))
    assert set(ran) == {(op_id, "torch")}
    assert polykernel.explain(op, device="cpu").chosen is not None


def test_impl_none_follows_the_dispatchers_auto_choice(ran):
    need("rms_norm")
    pnn.RMSNorm(8)(torch.randn(2, 8))
    assert ran == [("norm.rms_norm", polykernel.explain("rms_norm", device="cpu").chosen)]


@pytest.mark.parametrize(
    "make",
    [
        lambda: pnn.RMSNorm(8, impl="tritn"),
        lambda: pnn.LayerNorm(8, impl=""),
        lambda: pnn.SwiGLU(8, 12, impl="triton,cuda"),
        lambda: pnn.GEGLU(8, 12, impl="fast"),
        lambda: pnn.Softmax(impl="x"),
        lambda: pnn.GroupNorm(2, 8, impl="tritonn"),
        lambda: pnn.DyT(8, impl="fast"),
        lambda: pnn.PolyNorm(impl="Liger"),
        lambda: pnn.ReLUSquared(impl="x"),
        lambda: pnn.Sparsemax(impl=""),
        lambda: pnn.RotaryEmbedding(8, impl="tri ton"),
        lambda: pnn.CrossEntropyLoss(impl="liger-kernel"),
        lambda: pnn.FusedLinearCrossEntropyLoss(impl="Torch"),
        lambda: pnn.MoEExperts(3, 8, 12, impl="grouped_mm"),
    ],
)
def test_unknown_impl_name_fails_at_construction(make):
    with pytest.raises(ValueError, match="not an impl name"):
        make()


def test_impl_preference_list_and_bad_casting_at_construction():
    assert pnn.RMSNorm(8, impl="triton,torch").impl == "triton,torch"  # a preference list is accepted
    with pytest.raises(ValueError, match="casting"):
        pnn.RMSNorm(8, casting="bf16")


def test_fused_linear_ce_module_rejects_a_target_of_another_shape():
    # Same element count, other shape: must not be silently reshaped into agreement.
    loss = polykernel.nn.FusedLinearCrossEntropyLoss()
    hidden, weight = torch.randn(2, 6, 16), torch.randn(32, 16)
    with pytest.raises(polykernel.OpArgumentError, match="target"):
        loss(hidden, weight, torch.randint(0, 32, (3, 4)))
    assert loss(hidden, weight, torch.randint(0, 32, (2, 6))).shape == ()
    none = polykernel.nn.FusedLinearCrossEntropyLoss(reduction="none")
    assert none(hidden, weight, torch.randint(0, 32, (2, 6))).shape == (2, 6)


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to(dtype=torch.float64)])
def test_rotary_embedding_keeps_fp32_inv_freq_through_dtype_casts(convert):
    # model.to(bf16) casts every floating buffer: a bf16 inv_freq is off by up to 2^-9 relative,
    # so by position 2000 the angles are off by radians (silently wrong cos/sin); keep it fp32.
    need("rope")
    ref = pnn.RotaryEmbedding(64)
    rot = convert(pnn.RotaryEmbedding(64))
    assert rot.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rot.inv_freq, ref.inv_freq, atol=0, rtol=0)
    pos = torch.arange(2048)
    for a, b in zip(rot.cos_sin(pos, torch.float32), ref.cos_sin(pos, torch.float32)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert "inv_freq" not in rot.state_dict()
    meta = convert(pnn.RotaryEmbedding(64, device="meta"))
    assert meta.inv_freq.device.type == "meta" and meta.inv_freq.dtype == torch.float32


@pytest.mark.parametrize(
    "cls, option, value, error",
    [
        (pnn.FusedLinearDPOLoss, "beta", -1.0, polykernel.OpArgumentError),
        (pnn.FusedLinearDPOLoss, "ignore_index", 1.5, TypeError),
        (pnn.FusedLinearDPOLoss, "average_log_prob", "False", TypeError),
        (pnn.FusedLinearGRPOLoss, "loss_type", "bogus", polykernel.OpArgumentError),
        (pnn.FusedLinearGRPOLoss, "importance_sampling_level", "tokens", polykernel.OpArgumentError),
        (pnn.FusedLinearGRPOLoss, "temperature", 0.0, polykernel.OpArgumentError),
        (pnn.FusedLinearGRPOLoss, "epsilon_low", 1.0, polykernel.OpArgumentError),
        (pnn.FusedLinearGRPOLoss, "max_completion_length", 0, polykernel.OpArgumentError),
        (pnn.FusedLinearORPOLoss, "beta", float("nan"), polykernel.OpArgumentError),
        (pnn.FusedLinearORPOLoss, "compute_nll_loss", 1, TypeError),
        (pnn.FusedLinearCPOLoss, "alpha", -0.5, polykernel.OpArgumentError),
        (pnn.FusedLinearCPOLoss, "label_smoothing", 0.7, polykernel.OpArgumentError),
        (pnn.FusedLinearSimPOLoss, "gamma", float("inf"), polykernel.OpArgumentError),
        (pnn.FusedLinearSimPOLoss, "label_smoothing", 2.0, polykernel.OpArgumentError),
        (pnn.FusedLinearKTOLoss, "beta", "0.1", polykernel.OpArgumentError),
        (pnn.FusedLinearKTOLoss, "ignore_index", 2**70, polykernel.OpArgumentError),
    ],
)
def test_preference_modules_check_options_at_construction(cls, option, value, error):
    # The op's own checks, at construction (as the other loss modules do), not at the first call.
    need(cls._fn)
    with pytest.raises(error, match=option) as info:
        cls(**{option: value})
    assert cls.__name__ in str(info.value)
    cls()  # the defaults pass


@pytest.mark.parametrize("cls", [pnn.RMSNorm, pnn.LayerNorm])
def test_norm_sizes_like_torch_normalized_shape_and_bad_sizes_and_eps_at_construction(cls):
    need("rms_norm")
    need("layer_norm")
    # torch's normalized_shape spellings of one last dim load and run as the int does
    theirs = getattr(torch.nn, cls.__name__)((12,), eps=1e-5)
    for shape in (12, (12,), [12], torch.Size([12])):
        ours = cls(shape, eps=1e-5)
        assert ours.hidden_size == 12 and repr(ours).startswith(f"{cls.__name__}((12,), eps=1e-05")
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn(3, 12)
        torch.testing.assert_close(ours(x), theirs(x), **TOL[torch.float32])
    with pytest.raises(ValueError, match="last dim only"):
        cls((4, 12))
    for bad in (12.7, True, "12"):  # int(12.7) == 12 and int(True) == 1: silently another layer
        with pytest.raises(TypeError, match="hidden_size"):
            cls(bad)
    with pytest.raises(ValueError, match="hidden_size"):
        cls(0)
    # at construction, not at the first call (RMSNorm's None is torch's finfo eps: test_nn_dropin.py)
    for eps in (-1.0, float("nan"), float("inf")) + ((None,) if cls is pnn.LayerNorm else ()):
        with pytest.raises((ValueError, TypeError), match="eps") as info:
            cls(12, eps=eps)
        assert cls.__name__ in str(info.value)


def test_groupnorm_polynorm_check_sizes_and_eps_at_construction():
    with pytest.raises(ValueError, match="num_groups"):
        pnn.GroupNorm(0, 4)  # was ZeroDivisionError
    with pytest.raises(TypeError, match="num_channels"):
        pnn.GroupNorm(2, 4.5)
    with pytest.raises(ValueError, match="eps"):
        pnn.GroupNorm(2, 4, eps=-1e-5)
    with pytest.raises(ValueError, match="eps"):
        pnn.PolyNorm(eps=float("nan"))
    with pytest.raises(TypeError, match="hidden_size"):
        pnn.DyT(8.5)
