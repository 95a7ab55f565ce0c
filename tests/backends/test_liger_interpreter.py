"""Liger's adapters in Triton's CPU interpreter, on their ops' own small cases, against the float64
references under the ops' error models (the parity harness), fp32 and fp16: a Liger result
outside an error model shows here before a GPU run does (its 16-bit TVD loss did, with its
predicate off: up to 1e6x; so do the 16-bit misses its dtype gates refuse).

The dispatcher runs Liger on CUDA only; these tests let it run in the interpreter, with shims for
what the interpreter lacks (never for what Liger computes):

- a Python float argument is an fp32 scalar, as compiled Triton types it (the interpreter keeps a
  Python float: Liger's ``eps.to(tl.float32)`` raises);
- libdevice's rsqrt and tanh (no interpreter version: they return None) are numpy's;
- an autotuned kernel takes its first config (the interpreter has no driver to time them);
- Liger's DyT backward sizes its per-SM partials only on cuda/xpu/npu: 4 here.

bfloat16 is left out: the interpreter keeps it as raw uint16 bits and its arithmetic on them is
garbage (Liger's llama-mode RMSNorm dW, its fused add: 1e30 off), an interpreter artifact.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
from collections.abc import Iterator

import pytest
import torch

import polykernel
from polykernel import spec as pk_spec
from polykernel.core import registry
from polykernel.testing import assert_parity, refusal

pytest.importorskip("liger_kernel")
pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's tests"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy's log(0), inf - inf that the kernels mask
]

F32, F16 = torch.float32, torch.float16
# op -> dtypes its Liger impl takes (the others are refused by its dtypes or predicate)
OPS = {
    "rms_norm": (F32, F16),
    "fused_add_rms_norm": (F32, F16),
    "layer_norm": (F32, F16),
    "dyt": (F32, F16),
    "kl_div": (F32, F16),
    "jsd": (F32, F16),
    "fused_linear_jsd": (F32, F16),
    "fused_linear_cross_entropy": (F32, F16),
    "swiglu": (F32,),
    "geglu": (F32,),
    "softmax": (F32,),
    "sparsemax": (F32,),
    "group_norm": (F32,),
    "poly_norm": (F32,),
    "cross_entropy": (F32,),
    "tvd": (F32,),
    "fused_linear_dpo_loss": (F32,),  # (torch code: Liger's chunked losses, uncompiled off CUDA)
    "fused_linear_orpo_loss": (F32,),
    "fused_linear_cpo_loss": (F32,),
    "fused_linear_simpo_loss": (F32,),
    "fused_linear_grpo_loss": (F32,),
    "moe_experts": (F16,),  # 16-bit only; one case (seconds each in the interpreter)
}
CASES = {"moe_experts": 1}  # per op (else PER_OP)
# divergences the predicates cannot see (they read no values): Liger's JSD is NaN where a
# probability is 0 (backends/liger/jsd.py); with a NaN loss (a one-token sequence all ignored: a
# NaN mean log-prob) Liger's preference losses spread NaN to every row's gradient, where the
# reference keeps an ignored row's 0 (its V = 1 cases, as drawn from seed 0)
SKIP_LABELS = ("masked-vocab", "2x1x8x1")
MAX_ELEMENTS, PER_OP = 20_000, 3


def _elements(case) -> int:
    return sum(a.numel() for a in (*case.args, *case.kwargs.values()) if isinstance(a, torch.Tensor))


@contextlib.contextmanager
def liger_in_the_interpreter() -> Iterator[None]:
    import liger_kernel.ops
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    cvt = interpreter._implicit_cvt

    def fp32_floats(arg):
        if isinstance(arg, float):  # compiled Triton types it fp32
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return cvt(arg)

    def unary(fn):
        return lambda x: tl.tensor(interpreter.interpreter_builder.unary_op(x.handle, fn), x.type)

    numpy_fns = {"rsqrt": lambda a: (1 / np.sqrt(a)).astype(a.dtype), "tanh": np.tanh}
    unavailable = pk_spec.KernelSpec.unavailable_reason

    def runs_interpreted(self, platform):
        if self.backend is pk_spec.KernelBackend.LIGER and pk_spec.triton_interpret_allows(platform):
            missing = self.missing_modules()
            return f"module {missing[0]!r} not installed" if missing else self.failed_import()
        return unavailable(self, platform)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_implicit_cvt", fp32_floats)
        mp.setattr(pk_spec.KernelSpec, "unavailable_reason", runs_interpreted)
        for info in pkgutil.iter_modules(liger_kernel.ops.__path__):
            try:
                mod = importlib.import_module(f"liger_kernel.ops.{info.name}")
            except Exception:  # a backend of Liger's this machine lacks
                continue
            for obj in list(vars(mod).values()):
                if isinstance(obj, Autotuner) and len(obj.configs) > 1:
                    mp.setattr(obj, "configs", obj.configs[:1])
            for name, fn in numpy_fns.items():
                if "libdevice" in getattr(getattr(mod, name, None), "__module__", ""):
                    mp.setattr(mod, name, unary(fn))
        dyt = importlib.import_module("liger_kernel.ops.dyt")
        mp.setattr(dyt, "infer_device", lambda: "npu")
        mp.setattr(dyt, "get_npu_core_count", lambda: 4)
        polykernel.clear_caches()
        try:
            yield
        finally:
            polykernel.clear_caches()  # no decision made here outlives the shims


@pytest.mark.parametrize(("name", "dtype"), [(n, d) for n, ds in OPS.items() for d in ds], ids=str)
def test_liger_matches_the_reference_in_the_interpreter(name, dtype):
    op = registry.get_op(name)
    with liger_in_the_interpreter():
        torch.manual_seed(0)
        cases = [
            c
            for c in op.cases("cpu", dtype)
            if 0 < _elements(c) <= MAX_ELEMENTS and not any(s in c.label for s in SKIP_LABELS) and refusal(op, "liger", c) is None
        ][: CASES.get(name, PER_OP)]
        assert cases, f"Liger took none of {name}'s small cases here"  # the shims broke: not a silent pass
        assert_parity(op, ["liger"], device="cpu", dtypes=[dtype], cases=cases)
