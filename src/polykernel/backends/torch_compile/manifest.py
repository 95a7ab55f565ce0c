"""The ops the ``torch_compile`` backend implements, and its impl row for each (torch-free; see
:mod:`polykernel.backends`). Rank 110 (the backend's), behind torch: auto never pays its compile;
measured selection charges the compile (tuning/measure.py), impl="torch_compile" forces it."""

from . import TORCH_COMPILE, _gates

IMPLS = {
    "norm.rms_norm": TORCH_COMPILE.impl(
        description="the reference under torch.compile(dynamic=True) (Inductor fuses it; autograd through AOTAutograd); compiles on a class's first call",
        predicate=_gates.rms_norm,
    ),
}
