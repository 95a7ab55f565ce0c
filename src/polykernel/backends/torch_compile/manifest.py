"""The ops the ``torch_compile`` backend implements, and its impl row for each (torch-free; see
:mod:`polykernel.backends`). Rank 110 (the backend's), behind torch: auto never pays its compile;
measured selection charges the compile (tuning/measure.py), impl="torch_compile" forces it."""

from . import TORCH_COMPILE, _gates

IMPLS = {
    "norm.rms_norm": TORCH_COMPILE.impl(
        description="the reference under torch.compile(dynamic=True) (Inductor fuses it; autograd through AOTAutograd); compiles on a class's first call",
        predicate=_gates.rms_norm,
    ),
    # torch.compile: rank 110 (the backend's), behind torch: auto never pays its compile; measured
    # selection charges the compile (tuning/measure.py), impl="torch_compile" forces it.
    "norm.fused_add_rms_norm": TORCH_COMPILE.impl(
        description="the reference (add, then rms_norm) under torch.compile(dynamic=True), one fused Inductor kernel; compiles on a class's first call",
        predicate=_gates.fused_add_rms_norm,
    ),
    # torch.compile: rank 110 (the backend's), behind torch: auto never pays its compile; measured
    # selection charges the compile (tuning/measure.py), impl="torch_compile" forces it.
    "activation.geglu": TORCH_COMPILE.impl(
        description="the reference under torch.compile(dynamic=True): one Inductor kernel each way; compiles on a class's first call",
        predicate=_gates.geglu,
    ),
    # torch.compile: rank 110 (the backend's), behind torch: auto never pays its compile; measured
    # selection charges the compile (tuning/measure.py), impl="torch_compile" forces it.
    "activation.swiglu": TORCH_COMPILE.impl(
        description="the reference under torch.compile(dynamic=True): one Inductor kernel each way; compiles on a class's first call",
        predicate=_gates.swiglu,
    ),
    # torch.compile: rank 110 (the backend's), behind torch: auto never pays its compile; measured
    # selection charges the compile (tuning/measure.py), impl="torch_compile" forces it.
    "norm.layer_norm": TORCH_COMPILE.impl(
        description="the reference under torch.compile(dynamic=True) (Inductor fuses it; autograd through AOTAutograd); compiles on a class's first call",
        predicate=_gates.layer_norm,
    ),
    "embedding.rope": TORCH_COMPILE.impl(
        description="the reference under torch.compile(dynamic=True): q and k in one Inductor graph; compiles on a class's first call",
        predicate=_gates.rope,
    ),
    "serving.silu_and_mul": TORCH_COMPILE.impl(
        description="the reference under torch.compile(dynamic=True), Inductor writing into out; compiles on a class's first call",
        predicate=_gates.silu_and_mul,
    ),
}
