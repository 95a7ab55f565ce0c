"""cuTile (``cuda-tile``, NVIDIA's tile-level Python DSL) impls: one kernel file per op.

Importing this package imports neither ``cuda.tile`` nor torch: each op module does, and the
dispatcher imports an op module only when its impl is selected. :mod:`._gates` holds the
torch-free gates: the arch window of the tileiras 13.4 compiler (sm_80 to sm_121), and a probe
that compiles one tiny kernel for the device's arch, once per process and arch, the first time a
cuTile impl is considered, so ``explain`` can say ``tileiras not found`` or
``tileiras failed: <first line>`` instead of failing at the first launch.

Ops: swiglu, geglu (fwd+bwd, :mod:`.glu`), rms_norm (fwd+bwd), rope (fwd+bwd, any q/k strides),
softmax (fwd). Kernels are JIT-compiled by cuTile on the first launch per signature (dtypes,
ranks, constants) and cached by it, in memory and on disk.
"""
