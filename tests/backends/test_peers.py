"""Peer impls (Liger-Kernel, QuACK): gating, predicates, lazy imports; Liger adapters where
Triton's CPU interpreter runs Liger's kernels. Their parity on the GPU is in each op's
``test_parity_gpu_large`` (every runnable impl) and ``benchmarks/kernels/check_peers.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import polykernel
from polykernel.core import registry

PEER_OPS = {
    "rms_norm": ("liger", "quack"),
    "fused_add_rms_norm": ("liger", "quack"),
    "layer_norm": ("liger",),
    "swiglu": ("liger",),
    "geglu": ("liger",),
    "softmax": ("liger",),
    "cross_entropy": ("liger", "quack"),
    "fused_linear_cross_entropy": ("liger",),
    "moe_experts": ("liger",),
    "group_norm": ("liger",),
    "dyt": ("liger",),
    "poly_norm": ("liger",),
    "sparsemax": ("liger",),
}


def _impls(explanation) -> dict[str, dict]:
    return {row["name"]: row for row in explanation.impls}


@pytest.mark.parametrize("op", sorted(PEER_OPS))
def test_registered_and_gated(op):
    specs = registry.specs_for(op)
    for peer in PEER_OPS[op]:
        spec = specs[peer]
        assert spec.backend.value == peer
        assert spec.target.startswith(f"polykernel.backends.{peer}.")
        if peer == "quack":
            assert spec.requires_modules == ("quack", "cutlass")
            assert {str(c) for c in spec.capabilities} == {"cuda[sm_90..]"}
        else:
            assert spec.requires_modules[0] == "liger_kernel"
    rows = _impls(polykernel.explain(op, device="cpu", dtype=torch.bfloat16))
    for peer in PEER_OPS[op]:
        assert not rows[peer]["runnable"]
        assert rows[peer]["reason"] in ("needs a CUDA device", f"module {'quack' if peer == 'quack' else 'liger_kernel'!r} not installed")


def test_quack_flce_not_registered():
    assert "quack" not in registry.specs_for("fused_linear_cross_entropy")


_SCRIPT = r"""
import json, sys, torch, polykernel
x = torch.randn(4, 64, requires_grad=True); w = torch.ones(64, requires_grad=True); b = torch.zeros(64, requires_grad=True)
t = torch.randint(0, 64, (4,))
q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
cos, sin = torch.ones(1, 3, 8), torch.zeros(1, 3, 8)
outs = [
    polykernel.rms_norm(x, w), polykernel.fused_add_rms_norm(x, x, w)[0], polykernel.layer_norm(x, w, b),
    polykernel.swiglu(x, x), polykernel.geglu(x, x), polykernel.softmax(x), polykernel.rope(q, k, cos, sin)[0],
    polykernel.cross_entropy(x, t), polykernel.fused_linear_cross_entropy(x, torch.randn(10, 64), t % 10),
]
sum(o.float().sum() for o in outs).backward()
for op in polykernel.core.registry.all_op_ids():
    str(polykernel.explain(op, device="cpu", dtype=torch.bfloat16))
    polykernel.available_impls(op, device="cpu", dtype=torch.float32)
print(json.dumps({"mods": sorted(m for m in sys.modules if m.split(".")[0] in ("liger_kernel", "quack", "cutlass"))}))
"""


@pytest.mark.parametrize("env", [{}, {"POLYKERNEL_IMPL": "liger"}, {"POLYKERNEL_IMPL": "quack"}, {"POLYKERNEL_IMPL": "quack,liger"}])
def test_cpu_use_imports_no_peer(env):
    """Ops, explain and a peer preference on CPU: every op runs (torch) and no peer is imported."""
    full = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "src"), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["mods"] == []


def test_forcing_a_peer_on_cpu_names_the_reason():
    x, w = torch.randn(4, 64), torch.ones(64)
    for peer in ("liger", "quack"):
        with pytest.raises(polykernel.ImplNotAvailableError, match=r"needs a CUDA device|not installed"):
            polykernel.rms_norm(x, w, impl=peer)


# -- predicates: the argument class of real calls, read by each peer's gate --------------------


def _why(op: str, peer: str, *args, **kwargs) -> str | None:
    the_op = registry.get_op(op)
    spec = registry.specs_for(op)[peer]
    return spec.predicate(the_op.arg_class(the_op.key(*args, **kwargs))) if spec.predicate else None


def t(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(shape, dtype=dtype).requires_grad_(grad)


def test_predicates_rms_norm():
    assert _why("rms_norm", "liger", t(2, 65536), t(65536)) is None
    assert "65536" in _why("rms_norm", "liger", t(2, 65537), t(65537))
    assert _why("rms_norm", "liger", t(2, 64), t(64), casting="llama", offset=1.0) is None
    assert _why("rms_norm", "quack", t(2, 64), t(64, dtype=torch.float32), offset=1.0) is None
    assert "casting" in _why("rms_norm", "quack", t(2, 64), t(64), casting="llama")
    assert _why("rms_norm", "quack", t(2, 262144), t(262144)) is None  # bf16 backward fits
    big = t(2, 262144, dtype=torch.float32, grad=True)
    assert "131072" in _why("rms_norm", "quack", big, t(262144, dtype=torch.float32))
    with torch.no_grad():
        assert _why("rms_norm", "quack", big, t(262144, dtype=torch.float32)) is None  # forward only


def test_predicates_other_norms():
    assert "65536" in _why("fused_add_rms_norm", "liger", t(2, 70000), t(2, 70000), t(70000))
    assert _why("fused_add_rms_norm", "quack", t(2, 70000), t(2, 70000), t(70000)) is None
    # QuACK stages x and the residual in shared memory: fp32 at N = 262144 asks 262,408 bytes (H200)
    f32 = dict(dtype=torch.float32)
    assert "shared memory" in _why("fused_add_rms_norm", "quack", t(2, 262144, **f32), t(2, 262144, **f32), t(262144, **f32))
    assert _why("fused_add_rms_norm", "quack", t(2, 16384, **f32), t(2, 16384, **f32), t(16384, **f32)) is None
    assert _why("fused_add_rms_norm", "quack", t(2, 262144), t(2, 262144), t(262144)) is None  # bf16: half the bytes
    assert _why("layer_norm", "liger", t(2, 64), t(64), t(64)) is None
    assert "bias" in _why("layer_norm", "liger", t(2, 64), t(64))
    assert "weight" in _why("layer_norm", "liger", t(2, 64))


def test_quack_fused_add_rms_norm_leads_with_a_backward_in_cuda_graphs_only():
    # measured at N = 4096 in bf16 graph replays (backends/quack/_gates.py names the files): ahead
    # of Triton with a backward from 4096 rows on; eager calls and other N keep the static ranks
    spec = registry.specs_for("fused_add_rms_norm")["quack"]
    the_op = registry.get_op("fused_add_rms_norm")

    def rank(n, capturing=True, dtype=torch.bfloat16, grad=True):
        info = the_op.arg_class(the_op.key(t(2, n, dtype=dtype, grad=grad), t(2, n, dtype=dtype), t(n, dtype=dtype)))
        return spec.rank_here(info, capturing)

    first, why = rank(4096)
    assert first < registry.specs_for("fused_add_rms_norm")["triton"].rank and "in CUDA graphs" in why
    assert rank(4096, capturing=False) == (spec.rank, None)
    for other in (rank(4096, grad=False), rank(2048), rank(8192), rank(4096, dtype=torch.float32)):
        assert other == (spec.rank, None)


def test_predicates_activations_and_losses():
    assert _why("geglu", "liger", t(2, 64), t(2, 64)) is None
    assert "65536" in _why("geglu", "liger", t(2, 70000), t(2, 70000))  # one block per row
    assert _why("swiglu", "liger", t(2, 64, dtype=torch.float32), t(2, 64, dtype=torch.float32)) is None
    assert "65536" in _why("swiglu", "liger", t(2, 70000, dtype=torch.float32), t(2, 70000, dtype=torch.float32))
    assert "tanh" in _why("geglu", "liger", t(2, 64), t(2, 64), "none")
    assert "tanh" in _why("geglu", "liger", t(2, 64), t(2, 64), approximate="none")
    assert "65536" in _why("softmax", "liger", t(2, 70000, dtype=torch.float32))
    logits, target = t(3, 128), torch.zeros(3, dtype=torch.long)
    assert _why("cross_entropy", "quack", logits, target) is None
    assert "label_smoothing" in _why("cross_entropy", "quack", logits, target, label_smoothing=0.1)
    assert "label_smoothing" in _why("cross_entropy", "quack", logits, target, -100, 0.1, "mean")  # the impl's order
    assert _why("cross_entropy", "liger", logits, target, label_smoothing=0.1) is None


def test_predicates_moe_experts():
    def args(weights_dtype=torch.bfloat16, activation="silu"):
        index = torch.zeros(4, 2, dtype=torch.long)
        return (t(4, 16), index, t(4, 2, dtype=weights_dtype), t(3, 48, 16), t(3, 16, 24), activation)

    assert _why("moe_experts", "liger", *args()) is None
    assert "SwiGLU" in _why("moe_experts", "liger", *args(activation="gelu"))
    assert "hidden's dtype" in _why("moe_experts", "liger", *args(weights_dtype=torch.float32))
    spec = registry.specs_for("moe_experts")["liger"]
    assert not spec.deterministic and not spec.cuda_graph_safe  # atomics in its backward, a host sync per call


def test_predicates_new_ops():
    f32 = dict(dtype=torch.float32)
    x4 = t(2, 6, 5, **f32)
    assert _why("group_norm", "liger", x4, 3, t(6, **f32), t(6, **f32)) is None
    assert "both weight and bias" in _why("group_norm", "liger", x4, 3, t(6, **f32))
    assert "x's dtype" in _why("group_norm", "liger", x4, 3, t(6), t(6, **f32))  # bf16 weight, fp32 x
    assert _why("dyt", "liger", t(2, 64), t(1), t(64), t(64)) is None
    assert _why("dyt", "liger", t(2, 64), t(1), t(64)) is None  # no bias
    assert "x's dtype" in _why("dyt", "liger", t(2, 64), t(1, **f32), t(64), None)  # fp32 alpha: dalpha would round twice
    assert _why("poly_norm", "liger", t(2, 64, **f32), t(3, **f32), t(**f32)) is None
    assert "x's dtype" in _why("poly_norm", "liger", t(2, 64, **f32), t(3, **f32), t())
    assert "65536" in _why("poly_norm", "liger", t(2, 70000, **f32), t(3, **f32), t(**f32))
    assert _why("sparsemax", "liger", t(2, 65536)) is None
    assert "65536" in _why("sparsemax", "liger", t(2, 70000))
    assert "65536" in _why("sparsemax", "liger", t(70000, 2), 0)  # the length along dim
    # the dtypes Liger's kernels compute right: group_norm, poly_norm and sparsemax fp32 only
    for op in ("group_norm", "poly_norm", "sparsemax"):
        assert registry.specs_for(op)["liger"].format_signature.supported_dtypes == ("float32",)
    assert not registry.specs_for("group_norm")["liger"].deterministic  # its dW, dB by atomics
    assert not registry.specs_for("dyt")["liger"].cuda_graph_safe  # autotuned on its first call


def test_dropped_peers_not_registered():
    # failed parity on the H200 (the reasons are next to the other registrations)
    assert "quack" not in registry.specs_for("softmax")
    assert "liger" not in registry.specs_for("rope")
    assert "liger" not in registry.specs_for("relu_squared")  # turns NaN into 0 (ops/relu_squared.py)


def test_quack_needs_16_byte_rows():
    assert "divisible by 8" in _why("rms_norm", "quack", t(2, 70001), t(70001))
    assert "divisible by 8" in _why("cross_entropy", "quack", t(3, 4999), torch.zeros(3, dtype=torch.long))
    assert _why("rms_norm", "quack", t(2, 4096), t(4096)) is None


def test_new_fields_keep_the_public_results():
    """geglu's class now holds ``approximate`` and cross_entropy's ``label_smoothing``: two calls
    that differ only there get their own decisions, and the results stay the reference's."""
    g, u = torch.randn(3, 8), torch.randn(3, 8)
    for approx in ("tanh", "none"):
        torch.testing.assert_close(polykernel.geglu(g, u, approx), registry.get_op("geglu").reference(g, u, approx))
    logits, target = torch.randn(4, 10), torch.tensor([1, 2, -100, 9])
    for ls in (0.0, 0.2):
        ref = registry.get_op("cross_entropy").reference(logits, target, label_smoothing=ls)
        torch.testing.assert_close(polykernel.cross_entropy(logits, target, label_smoothing=ls), ref)
    assert polykernel.explain("cross_entropy", logits, target, label_smoothing=0.2).arg_class["label_smoothing"] == 0.2
    assert polykernel.explain("geglu", g, u, "none").arg_class["approximate"] == "none"


# -- Liger's adapters on CPU tensors, through Triton's interpreter (where it runs Liger's kernels:
# softmax, RoPE, cross-entropy, fused linear cross-entropy; its norms and GLUs use `eps.to(...)` on
# Python floats, which the interpreter does not support) ------------------------------------------

needs_liger = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or registry.specs_for("softmax")["liger"].missing_modules() != [],
    reason="needs liger_kernel and TRITON_INTERPRET=1",
)


def _grads(out, inputs, cots):
    return torch.autograd.grad(out, inputs, cots, allow_unused=True)


@needs_liger
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_liger_cross_entropy_adapter(reduction, ls):
    impl = registry.specs_for("cross_entropy")["liger"].load()
    ref = registry.get_op("cross_entropy").reference
    torch.manual_seed(0)
    x = (3 * torch.randn(2, 7, 3001)).requires_grad_()
    target = torch.randint(0, 3001, (2, 7)).masked_fill(torch.rand(2, 7) < 0.3, -100)
    x0 = x.detach().clone()
    out = impl(x, target, -100, ls, reduction)
    assert out.dtype == torch.float32 and out.shape == ref(x0, target, -100, ls, reduction).shape
    cot = torch.randn_like(out)
    xr = x0.clone().requires_grad_()
    expect = ref(xr, target, -100, ls, reduction)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_grads(out, [x], [cot])[0], _grads(expect, [xr], [cot])[0], atol=1e-7, rtol=1e-5)
    assert torch.equal(x.detach(), x0)  # the logits are not written to (Liger's own Function would)


@needs_liger
def test_liger_cross_entropy_adapter_edges():
    impl = registry.specs_for("cross_entropy")["liger"].load()
    x = torch.randn(5, 300, requires_grad=True)
    out = impl(x, torch.full((5,), -100), -100, 0.0, "mean")
    assert torch.isnan(out)  # PyTorch's mean over no target (Liger's own is 0)
    (g,) = torch.autograd.grad(out, x)
    assert torch.equal(g, torch.zeros_like(g))
    with torch.no_grad():  # no gradient: Liger's kernel writes nothing, no copy is made
        x2 = torch.randn(4, 50)
        x2c = x2.clone()
        impl(x2, torch.tensor([1, 2, 3, 4]), -100, 0.0, "sum")
        assert torch.equal(x2, x2c)
    empty = impl(torch.randn(0, 50, requires_grad=True), torch.zeros(0, dtype=torch.long), -100, 0.0, "mean")
    assert torch.isnan(empty)


@needs_liger
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_liger_flce_adapter(reduction):
    impl = registry.specs_for("fused_linear_cross_entropy")["liger"].load()
    ref = registry.get_op("fused_linear_cross_entropy").reference
    torch.manual_seed(0)
    h, w, b = torch.randn(2, 5, 32, requires_grad=True), torch.randn(300, 32, requires_grad=True), torch.randn(300, requires_grad=True)
    target = torch.randint(0, 300, (2, 5))
    target[0, 0] = -100
    out = impl(h, w, target, b, -100, 0.1, reduction)
    expect = ref(h, w, target, b, -100, 0.1, reduction)
    torch.testing.assert_close(out, expect.float(), atol=1e-5, rtol=1e-5)
    cot = torch.randn_like(out)
    for a, r in zip(_grads(out, [h, w, b], [cot]), _grads(expect, [h, w, b], [cot])):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)
    allign = impl(h, w, torch.full((2, 5), -100), b, -100, 0.0, "mean")
    assert torch.isnan(allign)


@needs_liger
def test_liger_softmax_adapter():
    impl = registry.specs_for("softmax")["liger"].load()
    ref = registry.get_op("softmax").reference
    x = torch.randn(3, 5, 200)[:, ::2].requires_grad_()
    out = impl(x)
    cot = torch.randn_like(out)
    torch.testing.assert_close(out, ref(x), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(_grads(out, [x], [cot])[0], _grads(ref(x), [x], [cot])[0], atol=1e-6, rtol=1e-5)


@needs_liger
@pytest.mark.parametrize("dim", [-1, 0])
def test_liger_sparsemax_adapter(dim):
    impl = registry.specs_for("sparsemax")["liger"].load()
    ref = registry.get_op("sparsemax").reference
    x = torch.randn(5, 3, 200)[:, :, ::2].requires_grad_()
    out = impl(x, dim)
    cot = torch.randn_like(out)
    torch.testing.assert_close(out, ref(x, dim), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(_grads(out, [x], [cot])[0], _grads(ref(x, dim), [x], [cot])[0], atol=1e-6, rtol=1e-5)


@needs_liger
def test_liger_sparsemax_adapter_rows_without_a_finite_max():
    # Liger gives zeros for an all -inf row and no probability vector for one with +inf; the
    # adapter gives the contract's NaN row, and a zero gradient there
    impl = registry.specs_for("sparsemax")["liger"].load()
    inf = float("inf")
    x = torch.tensor([[-inf, -inf, -inf], [1.0, inf, 0.0], [float("nan"), 0.0, 1.0], [0.0, -inf, 1.0]], requires_grad=True)
    out = impl(x, -1)
    assert torch.isnan(out[:3]).all() and torch.equal(out[3].detach(), torch.tensor([0.0, 0.0, 1.0]))
    (g,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert torch.equal(g, torch.zeros_like(g))


def test_quack_cross_entropy_hands_its_kernel_a_unit_stride_target(monkeypatch):
    """QuACK compiles its cross-entropy for a target of unit stride (its fake tensors' layout): the
    adapter hands over a contiguous one. Shifted labels sliced with a step (``labels[::2]``, a 1-D
    view of stride 2) would otherwise be read as if dense. The fake kernel below reads the target
    as the compiled one would, at unit stride from its data pointer."""
    import importlib
    import sys
    import types

    import torch.nn.functional as F

    def fake_kernel(logits, target, ignore_index, reduction):
        dense = torch.as_strided(target, (target.numel(),), (1,))  # what a unit-stride kernel reads
        return F.cross_entropy(logits.float(), dense, ignore_index=ignore_index, reduction=reduction)

    fake = types.ModuleType("quack.cross_entropy")
    fake.cross_entropy = fake_kernel
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.cross_entropy", fake)
    monkeypatch.delitem(sys.modules, "polykernel.backends.quack.cross_entropy", raising=False)
    adapter = importlib.import_module("polykernel.backends.quack.cross_entropy")
    try:
        logits = torch.randn(5, 32)
        labels = torch.randint(0, 32, (10,))
        target = labels[::2]  # stride 2
        got = adapter.cross_entropy(logits, target, -100, 0.0, "none")
        torch.testing.assert_close(got, F.cross_entropy(logits, target, reduction="none"))
    finally:
        sys.modules.pop("polykernel.backends.quack.cross_entropy", None)


def test_quack_adapters_hand_over_16_byte_aligned_rows(monkeypatch):
    """QuACK compiles its kernels assuming 16-byte aligned data pointers (quack/compile_utils.py
    make_fake_tensor: assumed_align of 16 bytes at every N its gates admit): a contiguous view at
    an odd offset is handed over as an aligned copy, for x, the residual, the weight and logits."""
    import importlib
    import sys
    import types

    import torch.nn.functional as F

    seen: list[torch.Tensor] = []

    def fake_rmsnorm(x, weight, residual=None, eps=1e-6, prenorm=False, weight_offset=0.0):
        seen.extend(u for u in (x, weight, residual) if u is not None)
        s = x if residual is None else x + residual
        y = polykernel.rms_norm(s, weight, eps, offset=weight_offset, impl="torch")
        return (y, s) if prenorm else y

    def fake_ce(logits, target, ignore_index, reduction):
        seen.append(logits)
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)

    rms, ce = types.ModuleType("quack.rmsnorm"), types.ModuleType("quack.cross_entropy")
    rms.rmsnorm, ce.cross_entropy = fake_rmsnorm, fake_ce
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.rmsnorm", rms)
    monkeypatch.setitem(sys.modules, "quack.cross_entropy", ce)
    names = [f"polykernel.backends.quack.{m}" for m in ("rms_norm", "fused_add_rms_norm", "cross_entropy")]
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:

        def odd(*shape):  # contiguous, 2 bytes past a 16-byte boundary
            flat = torch.randn(1 + torch.Size(shape).numel(), dtype=torch.bfloat16)
            v = flat[1:].view(shape)
            assert v.is_contiguous() and v.data_ptr() % 16 == 2
            return v

        x, r, w = odd(3, 64), odd(3, 64), odd(64)
        y = importlib.import_module(names[0]).rms_norm(x, w, 1e-6, 0.0, "fp32")
        torch.testing.assert_close(y, polykernel.rms_norm(x, w, impl="torch"), rtol=0, atol=0)
        importlib.import_module(names[1]).fused_add_rms_norm(x, r, w, 1e-6, 0.0)
        logits, target = odd(4, 32), torch.randint(0, 32, (4,))
        importlib.import_module(names[2]).cross_entropy(logits, target, -100, 0.0, "none")
        assert len(seen) == 6 and all(u.is_contiguous() and u.data_ptr() % 16 == 0 for u in seen)
    finally:
        for name in names:
            sys.modules.pop(name, None)


def test_liger_group_norm_sends_tensors_past_int32_offsets_to_torch(monkeypatch):
    """Liger's group-norm kernels (liger_kernel/ops/group_norm.py, _group_norm_forward and
    _group_norm_backward) step to a sample at ``tl.program_id(0) * X_row_stride``, int32 times an
    int32 argument: from 2**31 elements on the offset wraps (an illegal address or another sample's
    rows). The adapter hands such tensors to the torch impl (the limit lowered here to 64)."""
    pytest.importorskip("liger_kernel")
    import importlib

    adapter = importlib.import_module("polykernel.backends.liger.group_norm")
    calls: list[tuple] = []

    class Recorder:
        @staticmethod
        def apply(x, weight, bias, channels, groups, eps):
            calls.append(tuple(x.shape))
            return polykernel.group_norm(x, groups, weight, bias, eps, impl="torch")

    monkeypatch.setattr(adapter, "_GroupNorm", Recorder)
    monkeypatch.setattr(adapter, "INT32_ELEMS", 64, raising=False)
    w, b = torch.randn(4), torch.randn(4)
    small, big = torch.randn(2, 4, 8), torch.randn(2, 4, 9)  # 64 elements, 72
    adapter.group_norm(small, 2, w, b, 1e-5)
    assert calls == [(2, 4, 8)]
    y = adapter.group_norm(big, 2, w, b, 1e-5)
    assert calls == [(2, 4, 8)]  # the torch impl took it
    torch.testing.assert_close(y, polykernel.group_norm(big, 2, w, b, 1e-5, impl="torch"), rtol=0, atol=0)
