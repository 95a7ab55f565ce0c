"""Declared output shapes (``Op.outputs``) and the lazy import they buy.

The first call of each decision checks an impl's outputs against the op's expected shapes and
dtypes (polykernel.core.first_call). Built-in ops declare them (``outputs=`` on their Op) rather than
running the reference on meta tensors, which imports ``torch._dynamo`` and, through it,
``torch.distributed.tensor`` (~1 s): a process that never sees a DTensor must not pay that.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

from polykernel.core import registry
from polykernel.core.first_call import _expected


@pytest.mark.parametrize("op_id", registry.all_op_ids())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_declared_outputs_match_the_reference_on_meta(op_id, dtype):
    op = registry.get_op(op_id)
    assert op.outputs is not None, f"{op_id} declares no outputs: its first call would import torch._dynamo"
    for case in op.cases("cpu", dtype):
        bound = inspect.signature(op.reference).bind(*case.args, **case.kwargs)
        bound.apply_defaults()
        args = tuple(bound.arguments.values())  # positional, in the impl's order
        meta = tuple(torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a for a in args)
        data_dependent = False
        try:
            want = op.reference(*meta)
        except NotImplementedError:  # shapes that follow the values (KTO's statistics): the real reference
            data_dependent = True
            with torch.no_grad():
                want = op.reference(*args)
        wants = want if isinstance(want, tuple) else (want,)
        got = [None if o is None else (tuple(o[0]), o[1]) for o in op.outputs(*args)]  # None: no tensor (rope's absent key)
        assert len(got) == len(wants), f"{op_id} {case.label}"
        for g, w in zip(got, wants):
            if g is None:  # not a tensor (a NamedTuple of metrics, an absent key), or a shape the values decide
                assert not isinstance(w, torch.Tensor) or data_dependent, f"{op_id} {case.label}"
            else:
                assert g == (tuple(w.shape), w.dtype), f"{op_id} {case.label}"


def test_expected_falls_back_to_the_reference_without_declared_outputs():
    class Bare:
        outputs = None

        @staticmethod
        def reference(x, w):
            return x * w, x.sum(-1)

    got = _expected(Bare, (torch.randn(3, 4), torch.randn(4)))
    assert got == [((3, 4), torch.float32), ((3,), torch.float32)]


_PLAIN_CALLS = """
import sys
import torch
baseline = "torch.distributed.tensor" in sys.modules
import polykernel
x, w = torch.randn(4, 16), torch.ones(16)
t = torch.tensor([1, 2, -100, 3])
q, cos = torch.randn(1, 2, 4, 16), torch.randn(1, 4, 16)
polykernel.rms_norm(x, w)
polykernel.rms_norm(x.requires_grad_(), w).sum().backward()
polykernel.fused_add_rms_norm(x, x, w)
polykernel.layer_norm(x, w, w)
polykernel.softmax(x)
polykernel.swiglu(x, x)
polykernel.geglu(x, x)
polykernel.rope(q, q, cos, cos)
polykernel.cross_entropy(x, t)
polykernel.fused_linear_cross_entropy(x, torch.randn(8, 16), t)
polykernel.explain("rms_norm", x, w)
print(baseline, "torch.distributed.tensor" in sys.modules, "torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["triton-interpreter", "torch-impls"])
def test_plain_calls_do_not_import_dtensor(interpret):
    """Every op's first calls on plain CPU tensors (torch impls; Triton's interpreter) leave
    ``torch.distributed.tensor`` (and ``torch._dynamo``) unimported, unless ``import torch``
    itself imported it."""
    env = {"TRITON_INTERPRET": interpret, "POLYKERNEL_TUNE": "off", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PLAIN_CALLS)],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": ":".join(p for p in sys.path if p)},
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    baseline, dtensor, dynamo = out.stdout.split()[-3:]
    if baseline == "True":
        pytest.skip("this torch imports torch.distributed.tensor at import torch")
    assert dtensor == "False", "a plain call imported torch.distributed.tensor"
    assert dynamo == "False", "a plain call imported torch._dynamo (which imports torch.distributed.tensor)"
