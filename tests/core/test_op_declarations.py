"""The op files' declarations give exactly the tables that were spelled out before.

- Impls (``Backend.impl`` rows through ``impls``): ``EXPECTED`` is the KernelSpec table as it
  stood before the declarative form (copied from the op files' ``IMPLS`` lists), field by field,
  in the same order.
- Per-op facts (``Op(compile_mode=, saved=, saved_grads=, dtensor_layout=)``): ``FACTS`` is what
  ``compile/library.py`` (``COMPILE_MODES``, ``SAVED``, ``SAVED_GRADS``) and
  ``distributed/dtensor.py`` (``LAYOUTS``, ``_LOSS_ARGS``) held.

A change to a backend's facts or an op's declaration that moves any of these fails here, so such
a change is made on purpose (update the row with it).
"""

import importlib

import pytest

from polykernel.ops import OP_MODULES
from polykernel.spec import CapabilityRequirement, FormatSignature, KernelSpec

CUDA = CapabilityRequirement.CUDA


def _fn(name):
    if name is None:
        return None
    module, _, attr = name.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def Row(backend, target, caps, modules, dtypes, backward, in_place, fmt, rank, det, graph, subclasses, predicate, rank_for, description):
    """One expected spec (``predicate``/``rank_for`` as ``"module:name"``, compared by identity)."""
    return (
        KernelSpec(
            "",  # the op id, filled in per op below
            backend,
            target,
            capabilities=frozenset(caps),
            requires_modules=modules,
            format_signature=FormatSignature(dtypes, in_place=in_place, supports_backward=backward, description=fmt),
            rank=rank,
            deterministic=det,
            cuda_graph_safe=graph,
            description=description,
            accepts_subclasses=subclasses,
        ),
        predicate,
        rank_for,
    )


EXPECTED = {
    "norm.rms_norm": [
        Row(
            "torch",
            "polykernel.backends.torch.rms_norm:rms_norm",
            (),
            (),
            (),
            True,
            False,
            "",
            100,
            True,
            True,
            True,
            None,
            None,
            "F.rms_norm (PyTorch's fused kernel) for casting='fp32', else the reference",
        ),
        Row(
            "triton",
            "polykernel.backends.triton.rms_norm:rms_norm",
            (CUDA,),
            ("triton",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            10,
            True,
            True,
            False,
            None,
            None,
            "one row per program (chunked for long rows); dW from per-program partials (deterministic)",
        ),
        Row(
            "quack",
            "polykernel.backends.quack.rms_norm:rms_norm",
            (CapabilityRequirement.cuda(90, None),),
            ("quack", "cutlass"),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            50,
            True,
            True,
            False,
            "polykernel.backends.quack._gates:rms_norm",
            "polykernel.ops.rms_norm:_quack_rank",
            "QuACK rmsnorm (CuTeDSL, cluster reductions); casting='fp32' only; one compile per N",
        ),
        Row(
            "liger",
            "polykernel.backends.liger.rms_norm:rms_norm",
            (CUDA,),
            ("liger_kernel", "triton"),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            60,
            True,
            True,
            False,
            "polykernel.backends.liger._gates:rms_norm",
            None,
            "Liger LigerRMSNormFunction (gemma/llama casting, in_place=False); N <= 65536",
        ),
        Row(
            "cutile",
            "polykernel.backends.cutile.rms_norm:rms_norm",
            (CapabilityRequirement.cuda(80, 121),),
            ("cuda.tile",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            40,
            True,
            True,
            False,
            "polykernel.backends.cutile._gates:rms_norm",
            None,
            "one tile per row block (chunked beyond 8192); persistent backward, dW from per-block partials (deterministic)",
        ),
        Row(
            "cute_dsl",
            "polykernel.backends.cute_dsl.rms_norm:rms_norm",
            (CapabilityRequirement.cuda(90, None),),
            ("cutlass", "tvm_ffi"),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            40,
            True,
            True,
            False,
            "polykernel.backends.cute_dsl._gates:rms_norm",
            None,
            "rows in registers, 128-bit vectors, warp/block/cluster sums (rows past 16K over a thread-block cluster, DSMEM); dW from per-CTA partials (deterministic)",
        ),
    ],
    "norm.fused_add_rms_norm": [
        Row(
            "torch",
            "polykernel.backends.torch.fused_add_rms_norm:fused_add_rms_norm",
            (),
            (),
            (),
            True,
            False,
            "",
            100,
            True,
            True,
            True,
            None,
            None,
            "x + residual, then the torch rms_norm impl (F.rms_norm where it matches)",
        ),
        Row(
            "triton",
            "polykernel.backends.triton.fused_add_rms_norm:fused_add_rms_norm",
            (CUDA,),
            ("triton",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            10,
            True,
            True,
            False,
            None,
            None,
            "add + RMSNorm in one pass (chunked for long rows); dW from per-program partials (deterministic)",
        ),
        Row(
            "quack",
            "polykernel.backends.quack.fused_add_rms_norm:fused_add_rms_norm",
            (CapabilityRequirement.cuda(90, None),),
            ("quack", "cutlass"),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            50,
            True,
            True,
            False,
            "polykernel.backends.quack._gates:fused_add_rms_norm",
            None,
            "QuACK rmsnorm(residual=, prenorm=True); normalizes the unrounded fp32 sum",
        ),
        Row(
            "liger",
            "polykernel.backends.liger.fused_add_rms_norm:fused_add_rms_norm",
            (CUDA,),
            ("liger_kernel", "triton"),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            60,
            True,
            True,
            False,
            "polykernel.backends.liger._gates:fused_add_rms_norm",
            None,
            "Liger LigerFusedAddRMSNormFunction (gemma casting); N <= 65536",
        ),
    ],
    "norm.layer_norm": [
        Row(
            "torch",
            "polykernel.backends.torch.layer_norm:layer_norm",
            (),
            (),
            (),
            True,
            False,
            "",
            100,
            True,
            True,
            True,
            None,
            None,
            "F.layer_norm (PyTorch's fused kernel) where the parameter dtypes match x, else the reference",
        ),
        Row(
            "triton",
            "polykernel.backends.triton.layer_norm:layer_norm",
            (CUDA,),
            ("triton",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            10,
            True,
            True,
            False,
            None,
            None,
            "one row per program (chunked for long rows); dW/dB from per-program partials (deterministic)",
        ),
        Row(
            "liger",
            "polykernel.backends.liger.layer_norm:layer_norm",
            (CUDA,),
            ("liger_kernel", "triton"),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            60,
            True,
            True,
            False,
            "polykernel.backends.liger._gates:layer_norm",
            None,
            "Liger LigerLayerNormFunction; weight and bias required; N <= 65536",
        ),
        Row(
            "cute_dsl",
            "polykernel.backends.cute_dsl.layer_norm:layer_norm",
            (CapabilityRequirement.cuda(90, None),),
            ("cutlass", "tvm_ffi"),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            40,
            True,
            True,
            False,
            "polykernel.backends.cute_dsl._gates:layer_norm",
            "polykernel.ops.layer_norm:_cute_rank",
            "as cute_dsl rms_norm, centred in registers (two-pass variance); dW/dB from per-CTA partials (deterministic)",
        ),
    ],
    "activation.swiglu": [
        Row(
            "torch",
            "polykernel.backends.torch.swiglu:swiglu",
            (),
            (),
            (),
            True,
            False,
            "",
            100,
            True,
            True,
            True,
            None,
            None,
            "the reference's fp32 math; backward saves only gate and up",
        ),
        Row(
            "triton",
            "polykernel.backends.triton.swiglu:swiglu",
            (CUDA,),
            ("triton",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            10,
            True,
            True,
            False,
            None,
            None,
            "one elementwise pass each way (flat or row-strided, 16-byte accesses); backward recomputes silu",
        ),
        Row(
            "liger",
            "polykernel.backends.liger.swiglu:swiglu",
            (CUDA,),
            ("liger_kernel", "triton"),
            ("float32",),
            True,
            False,
            "",
            60,
            True,
            True,
            False,
            "polykernel.backends.liger._gates:swiglu",
            None,
            "Liger LigerSiLUMulFunction (silu(gate) rounded to up's dtype before the multiply); gate/up copied when grad is on",
        ),
        Row(
            "cutile",
            "polykernel.backends.cutile.swiglu:swiglu",
            (CapabilityRequirement.cuda(80, 121),),
            ("cuda.tile",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            40,
            True,
            True,
            False,
            "polykernel.backends.cutile._gates:swiglu",
            None,
            "one elementwise pass each way over [M, N] views (any strides); backward recomputes silu",
        ),
    ],
    "activation.geglu": [
        Row(
            "torch",
            "polykernel.backends.torch.geglu:geglu",
            (),
            (),
            (),
            True,
            False,
            "",
            100,
            True,
            True,
            True,
            None,
            None,
            "the reference's fp32 math; backward saves only gate and up",
        ),
        Row(
            "triton",
            "polykernel.backends.triton.geglu:geglu",
            (CUDA,),
            ("triton",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            10,
            True,
            True,
            False,
            None,
            None,
            "one elementwise pass each way (flat or row-strided, 16-byte accesses); backward recomputes gelu",
        ),
        Row(
            "liger",
            "polykernel.backends.liger.geglu:geglu",
            (CUDA,),
            ("liger_kernel", "triton"),
            ("float32",),
            True,
            False,
            "",
            60,
            True,
            True,
            False,
            "polykernel.backends.liger._gates:geglu",
            None,
            "Liger LigerGELUMulFunction (tanh only); gate/up copied when grad is on",
        ),
        Row(
            "cutile",
            "polykernel.backends.cutile.geglu:geglu",
            (CapabilityRequirement.cuda(80, 121),),
            ("cuda.tile",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            40,
            True,
            True,
            False,
            "polykernel.backends.cutile._gates:geglu",
            None,
            "one elementwise pass each way over [M, N] views (any strides); erf from an erfc fit (cuTile has no erf)",
        ),
    ],
    "activation.softmax": [
        Row(
            "torch",
            "polykernel.backends.torch.softmax:softmax",
            (),
            (),
            (),
            True,
            False,
            "",
            100,
            True,
            True,
            True,
            None,
            None,
            "torch.softmax (fp32 accumulation, x's dtype out); bf16/fp16 backward recomputes fp32 y from x",
        ),
        Row(
            "triton",
            "polykernel.backends.triton.softmax:softmax",
            (CUDA,),
            ("triton",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            10,
            True,
            True,
            False,
            None,
            None,
            "one block per row up to 32K (one read, one write), online chunked beyond (rows split when few); backward recomputes fp32 y from x",
        ),
        Row(
            "cute_dsl",
            "polykernel.backends.cute_dsl.softmax:softmax",
            (CapabilityRequirement.cuda(90, None),),
            ("cutlass", "tvm_ffi"),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            40,
            True,
            True,
            False,
            "polykernel.backends.cute_dsl._predicates:softmax",
            "polykernel.backends.cute_dsl._predicates:softmax_rank",
            "one CTA per row, the row in registers (N <= 32768, 16-byte rows); backward recomputes fp32 y from x",
        ),
        Row(
            "liger",
            "polykernel.backends.liger.softmax:softmax",
            (CUDA,),
            ("liger_kernel", "triton"),
            ("float32",),
            True,
            False,
            "",
            60,
            True,
            True,
            False,
            "polykernel.backends.liger._gates:softmax",
            None,
            "Liger LigerSoftmaxFunction; N <= 65536; backward from the saved y",
        ),
        Row(
            "cutile",
            "polykernel.backends.cutile.softmax:softmax",
            (CapabilityRequirement.cuda(80, 121),),
            ("cuda.tile",),
            ("float32", "bfloat16", "float16"),
            False,
            False,
            "",
            40,
            True,
            True,
            False,
            "polykernel.backends.cutile._gates:softmax",
            None,
            "forward only: one tile per row block (chunked online max/sum beyond 8192)",
        ),
    ],
    "embedding.rope": [
        Row(
            "torch",
            "polykernel.backends.torch.rope:rope",
            (),
            (),
            (),
            True,
            False,
            "",
            100,
            True,
            True,
            True,
            None,
            None,
            "fp32 rotate-half in eager torch (autograd gives every gradient, cos/sin included)",
        ),
        Row(
            "triton",
            "polykernel.backends.triton.rope:rope",
            (CUDA,),
            ("triton",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            10,
            True,
            True,
            False,
            "polykernel.ops.rope:_triton_predicate",
            None,
            "a tile of positions per program, all q and k heads, cos/sin loaded once; strided (no copies); backward is the same kernel rotating by -sin",
        ),
        Row(
            "cutile",
            "polykernel.backends.cutile.rope:rope",
            (CapabilityRequirement.cuda(80, 121),),
            ("cuda.tile",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            40,
            True,
            True,
            False,
            "polykernel.backends.cutile._gates:rope",
            None,
            "gathers by element index (any D, any q/k strides); cos/sin loaded once per position tile for all heads",
        ),
    ],
    "loss.cross_entropy": [
        Row(
            "torch",
            "polykernel.backends.torch.cross_entropy:cross_entropy",
            (),
            (),
            (),
            True,
            False,
            "",
            100,
            True,
            True,
            True,
            None,
            None,
            "row-chunked torch (fp32 temporaries O(chunk), not O(N·V)); backward recomputes softmax from the saved LSE",
        ),
        Row(
            "triton",
            "polykernel.backends.triton.cross_entropy:cross_entropy",
            (CUDA,),
            ("triton",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            10,
            True,
            True,
            False,
            None,
            None,
            "one program per row, online softmax over V in chunks; backward re-reads the logits with the saved LSE",
        ),
        Row(
            "cute_dsl",
            "polykernel.backends.cute_dsl.cross_entropy:cross_entropy",
            (CapabilityRequirement.cuda(90, None),),
            ("cutlass", "tvm_ffi"),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            40,
            True,
            True,
            False,
            "polykernel.backends.cute_dsl._predicates:cross_entropy",
            "polykernel.backends.cute_dsl._predicates:cross_entropy_rank",
            "one CTA per row, online softmax over V in 128-bit chunks; backward re-reads the logits with the saved LSE (dlogits rounded once)",
        ),
        Row(
            "quack",
            "polykernel.backends.quack.cross_entropy:cross_entropy",
            (CapabilityRequirement.cuda(90, None),),
            ("quack", "cutlass"),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            50,
            True,
            True,
            False,
            "polykernel.backends.quack._gates:cross_entropy",
            None,
            "QuACK cross_entropy (CuTeDSL); no label smoothing",
        ),
        Row(
            "liger",
            "polykernel.backends.liger.cross_entropy:cross_entropy",
            (CUDA,),
            ("liger_kernel", "triton"),
            ("float32",),
            True,
            False,
            "",
            60,
            True,
            False,
            False,
            None,
            None,
            "Liger's CE kernel with an fp32 loss and a private gradient buffer (the logits stay unwritten); host sync per call",
        ),
    ],
    "loss.fused_linear_cross_entropy": [
        Row(
            "torch",
            "polykernel.backends.torch.fused_linear_cross_entropy:fused_linear_cross_entropy",
            (),
            (),
            (),
            True,
            False,
            "",
            100,
            True,
            True,
            True,
            None,
            None,
            "row chunks: torch matmul + row-chunked torch cross-entropy, gradients during the forward",
        ),
        Row(
            "triton",
            "polykernel.backends.triton.fused_linear_cross_entropy:fused_linear_cross_entropy",
            (CUDA,),
            ("triton",),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            10,
            True,
            True,
            False,
            None,
            None,
            "row chunks: torch matmul + the Triton cross-entropy kernel (loss and dlogits in one launch, in place)",
        ),
        Row(
            "liger",
            "polykernel.backends.liger.fused_linear_cross_entropy:fused_linear_cross_entropy",
            (CUDA,),
            ("liger_kernel", "triton"),
            ("float32", "bfloat16", "float16"),
            True,
            False,
            "",
            60,
            True,
            False,
            False,
            None,
            None,
            "Liger LigerFusedLinearCrossEntropyFunction (grads in the forward, fp32 dW accumulation); host sync per call",
        ),
    ],
}


@pytest.mark.parametrize("op_id", list(OP_MODULES))
def test_declared_impls_equal_the_former_tables(op_id):
    import dataclasses

    module = importlib.import_module(OP_MODULES[op_id])
    got = list(module.IMPLS)
    want = EXPECTED[op_id]
    assert [s.impl for s in got] == [w[0].impl for w in want]  # same impls, same order
    for spec, (expected, predicate, rank_for) in zip(got, want):
        expected = dataclasses.replace(expected, op=op_id)
        assert isinstance(spec, KernelSpec)
        assert spec == expected, spec.impl  # every compared field
        for field in dataclasses.fields(KernelSpec):  # and each one by name, for a readable failure
            if field.compare:
                assert getattr(spec, field.name) == getattr(expected, field.name), (spec.impl, field.name)
        assert spec.predicate is _fn(predicate), (spec.impl, "predicate")
        assert spec.rank_for is _fn(rank_for), (spec.impl, "rank_for")


def test_every_op_module_is_covered():
    assert set(EXPECTED) == set(OP_MODULES)


def test_a_backend_declares_its_facts_once_and_an_impl_row_only_what_differs():
    from polykernel.backends.declare import Backend, impls

    toy = Backend("cuda_jit", modules=("m",), capabilities=CUDA, dtypes=("bfloat16",), rank=30, graph_safe=False)
    plain, odd = impls(
        "group.some_op",
        toy.impl(description="d"),
        Backend("torch").impl(rank=7, dtypes=("float32",), supports_backward=False, deterministic=False, target="a.b:c"),
    )
    assert plain == KernelSpec(
        "group.some_op",
        "cuda_jit",
        "polykernel.backends.cuda_jit.some_op:some_op",  # the default target
        capabilities=frozenset({CUDA}),
        requires_modules=("m",),
        format_signature=FormatSignature(("bfloat16",)),
        rank=30,  # the backend's default rank
        cuda_graph_safe=False,
        description="d",
    )
    assert (odd.target, odd.rank, odd.deterministic, odd.cuda_graph_safe) == ("a.b:c", 7, False, True)
    assert odd.format_signature == FormatSignature(("float32",), supports_backward=False)
    with pytest.raises(ValueError, match="more than one impl of backend cuda_jit"):
        impls("group.some_op", toy.impl(), toy.impl(rank=1))
    with pytest.raises(ValueError):
        Backend("not_a_backend")


def test_backend_declarations_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from polykernel.backends.torch import TORCH\n"
        "from polykernel.backends.triton import TRITON\n"
        "from polykernel.backends.cute_dsl import CUTE_DSL\n"
        "from polykernel.backends.cutile import CUTILE\n"
        "from polykernel.backends.liger import LIGER\n"
        "from polykernel.backends.quack import QUACK\n"
        "print(TORCH.name, TRITON.modules, CUTILE.capabilities)\n"
    )
    src = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "src")
    env = {**__import__("os").environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr


# op -> (compile mode, saved kinds, saved_grads slots, layout: lead dims, outputs, loss args)
FACTS = {
    "norm.rms_norm": ("ours", ("rows",), None, ("rows", (0,), None)),
    "norm.fused_add_rms_norm": ("decompose", None, None, ("rows", (0, 0), None)),
    "norm.layer_norm": ("ours", ("rows", "rows"), None, ("rows", (0,), None)),
    "activation.softmax": ("ours", ("rows", "rows"), None, ("rows", (0,), None)),
    "activation.swiglu": ("decompose", None, None, ("any", (0,), None)),
    "activation.geglu": ("decompose", None, None, ("any", (0,), None)),
    "embedding.rope": ("decompose", None, None, ((0, 1, 2), (0, 1), None)),
    "loss.cross_entropy": ("ours", ("rows", "sum"), None, ("rows", ("loss",), (1, 2, 4))),
    "loss.fused_linear_cross_entropy": (
        "ours",
        ("lead", "sum", "sum"),
        {"hidden": 0, "weight": 1, "bias": 2},
        ("rows", ("loss",), (2, 4, 6)),
    ),
}
# the arguments that share the lead's shard dim (the rest are replicated), per row-wise op
SAME = {
    "norm.rms_norm": {0},
    "norm.fused_add_rms_norm": {0, 1},
    "norm.layer_norm": {0},
    "activation.softmax": {0},
    "activation.swiglu": {0, 1},
    "activation.geglu": {0, 1},
    "loss.cross_entropy": {0, 1},
    "loss.fused_linear_cross_entropy": {0, 2},
}


@pytest.mark.parametrize("op_id", list(OP_MODULES))
def test_per_op_facts_equal_the_former_tables(op_id):
    import torch

    from polykernel.core import registry

    op = registry.get_op(op_id)
    mode, saved, grads, (lead, outputs, loss) = FACTS[op_id]
    assert (op.compile_mode, op.saved) == (mode, saved)
    assert (op.saved_grads and op.saved_grads.slots) == grads
    if grads is not None:
        assert op.saved_grads.when({"reduction": "mean"}) and op.saved_grads.when({"reduction": "sum"})
        assert not op.saved_grads.when({"reduction": "none"})
    layout = op.dtensor_layout
    assert (layout.lead_dims, layout.outputs, layout.loss_args) == (lead, outputs, loss)
    if op_id == "embedding.rope":
        assert layout.why_not == "it is the head dim D, which the rotation mixes"
        q, k = torch.empty(2, 4, 3, 8), torch.empty(2, 2, 3, 8)
        per_batch, shared = torch.empty(2, 3, 8), torch.empty(1, 3, 8)
        assert layout.expect((q, k, per_batch, per_batch), 0) == {0: 0, 1: 0, 2: 0, 3: 0}
        assert layout.expect((q, k, shared, shared), 0) == {0: 0, 1: 0, 2: None, 3: None}
        assert layout.expect((q, k, per_batch, per_batch), 1) == {0: 1, 1: 1, 2: None, 3: None}
        assert layout.expect((q, k, per_batch, per_batch), 2) == {0: 2, 1: 2, 2: 1, 3: 1}
    else:
        assert layout.why_not == "it is the dim the op reduces over, which needs a cross-rank reduction"
        args = (*(torch.empty(2) for _ in range(4)), 1.0)
        assert layout.expect(args, 1) == {i: (1 if i in SAME[op_id] else None) for i in range(4)}
