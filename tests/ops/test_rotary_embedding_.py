"""serving.rotary_embedding_: vLLM's semantics (NeoX and GPT-J, partial rotary_dim, the cache by
position), in place, the bounds on positions, bad input."""

import pytest
import torch

import polykernel
from polykernel.core import registry
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.rotary_embedding_ import rope_cache
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]
OP = "rotary_embedding_"


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls(OP, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity(OP, [impl], device="cpu", dtypes=[dtype])


def vllm_native(positions, query, key, head_size, cos_sin_cache, is_neox):
    """vLLM's RotaryEmbedding.forward_native (vllm/model_executor/layers/rotary_embedding),
    restated independently of polykernel's reference, in float64."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    cos, sin = cos_sin.chunk(2, dim=-1)

    def apply(x):
        shape = x.shape
        x = x.reshape(positions.shape[0], -1, head_size)
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        if is_neox:
            x1, x2 = torch.chunk(rot, 2, dim=-1)
        else:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        rot = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((rot, rest), dim=-1).reshape(shape)

    return apply(query), (apply(key) if key is not None else None)


@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full", "partial"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_vllm_forward_native(impl, is_neox, rotary_dim):
    _need(impl)
    t, hq, hk, hs = 5, 4, 2, 32
    positions = torch.randint(0, 100, (t,))
    cache = rope_cache(100, rotary_dim)
    q, k = torch.randn(t, hq * hs), torch.randn(t, hk * hs)
    want_q, want_k = vllm_native(positions, q.double(), k.double(), hs, cache.double(), is_neox)
    got_q, got_k = polykernel.rotary_embedding_(positions, q, k, hs, cache, is_neox=is_neox, impl=impl)
    assert got_q is q and got_k is k
    torch.testing.assert_close(q.double(), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.double(), want_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_neox_is_hugging_faces_rotate_half(impl):
    # the training op (HF layout, cos/sin duplicated over both halves) on the gathered rows
    _need(impl)
    t, h, hs = 6, 3, 16
    positions = torch.tensor([0, 7, 3, 3, 60, 1])
    cache = rope_cache(64, hs)
    q, k = torch.randn(t, h * hs), torch.randn(t, hs)
    cos, sin = cache[positions].chunk(2, -1)
    cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]  # [1, T, hs]
    q4 = q.view(t, h, hs).transpose(0, 1)[None]  # [1, H, T, hs]
    k4 = k.view(t, 1, hs).transpose(0, 1)[None]
    want_q, want_k = polykernel.rope(q4, k4, cos, sin, impl="torch")
    polykernel.rotary_embedding_(positions, q, k, hs, cache, impl=impl)
    torch.testing.assert_close(q.view(t, h, hs).transpose(0, 1)[None], want_q)
    torch.testing.assert_close(k.view(t, 1, hs).transpose(0, 1)[None], want_k)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("impl", IMPLS)
def test_partial_rotary_leaves_the_tail_and_v_untouched(impl, is_neox):
    _need(impl, torch.bfloat16)
    t, hq, hk, hs, rd = 4, 2, 1, 24, 8
    qkv = torch.randn(t, (hq + 2 * hk) * hs, dtype=torch.bfloat16)
    before = qkv.clone()
    q, k = qkv[:, : hq * hs], qkv[:, hq * hs : (hq + hk) * hs]
    polykernel.rotary_embedding_(torch.arange(t), q, k, hs, rope_cache(16, rd), is_neox=is_neox, rotary_dim=rd, impl=impl)
    heads = qkv.view(t, hq + 2 * hk, hs)
    old = before.view(t, hq + 2 * hk, hs)
    assert torch.equal(heads[..., rd:], old[..., rd:])  # every head's pass-through features
    assert torch.equal(heads[:, hq + hk :], old[:, hq + hk :])  # v
    assert torch.equal(heads[0], old[0])  # position 0: angle 0
    assert not torch.equal(heads[1:, : hq + hk, :rd], old[1:, : hq + hk, :rd])


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_positions(impl):
    _need(impl)
    cache = rope_cache(8, 16)
    q, k = torch.randn(3, 32), torch.randn(3, 16)
    keep = (q.clone(), k.clone())
    for bad in ([0, 8, 1], [0, -1, 2]):
        with pytest.raises(OpArgumentError, match="outside the cache") as info:
            polykernel.rotary_embedding_(torch.tensor(bad), q, k, 16, cache, impl=impl)
        assert info.value.arg == "positions"
        assert torch.equal(q, keep[0]) and torch.equal(k, keep[1])  # nothing written
    # Past the CPU check (as on CUDA, where it is not made): no read outside the cache, NaN in
    # the bad token's rotated features, the other tokens right.
    fn = registry.load_impl(registry.specs_for(f"serving.{OP}")[impl])
    pos = torch.tensor([2, 1000, 5])
    want_q, want_k = vllm_native(torch.tensor([2, 0, 5]), q.double(), k.double(), 16, cache.double(), True)
    fn(pos, q, k, 16, cache, True, 16)
    assert q[1].isnan().all() and k[1].isnan().all()
    torch.testing.assert_close(q[[0, 2]].double(), want_q[[0, 2]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k[[0, 2]].double(), want_k[[0, 2]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_key_3d_layout_and_int32_positions(impl):
    _need(impl)
    cache = rope_cache(32, 8)
    pos = torch.tensor([1, 9, 30], dtype=torch.int32)
    q = torch.randn(3, 2, 8)
    want, _ = vllm_native(pos, q.double(), None, 8, cache.double(), False)
    got_q, got_k = polykernel.rotary_embedding_(pos, q, None, 8, cache, is_neox=False, impl=impl)
    assert got_q is q and got_k is None
    torch.testing.assert_close(q.double(), want, rtol=1e-5, atol=1e-5)
    assert polykernel.rotary_embedding_(torch.tensor([], dtype=torch.long), torch.randn(0, 16), None, 8, cache, impl=impl)[0].shape == (
        0,
        16,
    )


def _args():
    return torch.tensor([0, 3]), torch.randn(2, 64), torch.randn(2, 32), 16, rope_cache(8, 16)


BAD = [
    ("float positions", lambda p, q, k, hs, c: (p.float(), q, k, hs, c), {}, OpTypeError, "positions"),
    ("2-d positions", lambda p, q, k, hs, c: (p[None], q, k, hs, c), {}, OpTypeError, "positions"),
    ("head size does not divide q", lambda p, q, k, hs, c: (p, q[:, :40], k, hs, c), {}, OpArgumentError, "query"),
    ("head size does not divide k", lambda p, q, k, hs, c: (p, q, k[:, :24], hs, c), {}, OpArgumentError, "key"),
    ("tokens differ", lambda p, q, k, hs, c: (p, q[:1], k, hs, c), {}, OpArgumentError, "query"),
    ("3-d query of another head size", lambda p, q, k, hs, c: (p, q.view(2, 2, 32), k, hs, c), {}, OpArgumentError, "query"),
    ("key dtype", lambda p, q, k, hs, c: (p, q, k.half(), hs, c), {}, OpTypeError, "key"),
    ("key is query", lambda p, q, k, hs, c: (p, q, q, hs, c), {}, OpArgumentError, "key"),
    ("odd cache width", lambda p, q, k, hs, c: (p, q, k, hs, c[:, :15]), {}, OpArgumentError, "cos_sin_cache"),
    ("cache wider than a head", lambda p, q, k, hs, c: (p, q, k, 8, torch.randn(8, 16)), {}, OpArgumentError, "cos_sin_cache"),
    ("empty cache", lambda p, q, k, hs, c: (p, q, k, hs, c[:0]), {}, OpArgumentError, "cos_sin_cache"),
    ("rotary_dim not the cache's", lambda p, q, k, hs, c: (p, q, k, hs, c), {"rotary_dim": 8}, OpArgumentError, "rotary_dim"),
    ("zero head size", lambda p, q, k, hs, c: (p, q, k, 0, c), {}, OpArgumentError, "head_size"),
    ("is_neox not a bool", lambda p, q, k, hs, c: (p, q, k, hs, c), {"is_neox": 1}, OpTypeError, "is_neox"),
    ("query needs grad", lambda p, q, k, hs, c: (p, q.requires_grad_(), k, hs, c), {}, OpArgumentError, "query"),
    ("cache on another device", lambda p, q, k, hs, c: (p, q, k, hs, c.to("meta")), {}, OpArgumentError, "cos_sin_cache"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_bad_input_raises_before_anything_is_written(case):
    _, make, kwargs, error, arg = case
    args = make(*_args())
    before = [a.detach().clone() for a in args[1:3]]
    with pytest.raises(error) as info:
        polykernel.rotary_embedding_(*args, **kwargs)
    assert info.value.op == f"serving.{OP}" and info.value.arg == arg
    for a, b in zip(args[1:3], before):
        assert torch.equal(a.detach(), b)


def test_rope_cache_is_vllms():
    # vLLM's RotaryEmbedding._compute_cos_sin_cache: inv_freq = 1 / base^(arange(0, rd, 2) / rd)
    cache = rope_cache(5, 8, base=500.0, dtype=torch.float64)
    inv = 1.0 / (500.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    freqs = torch.arange(5, dtype=torch.float64)[:, None] * inv
    torch.testing.assert_close(cache, torch.cat((freqs.cos(), freqs.sin()), -1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("rotary_embedding_", device="cuda", dtypes=[dtype], large=True)
