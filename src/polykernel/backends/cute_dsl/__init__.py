"""Our own CuTeDSL kernels (``cute_dsl`` impls, sm_90+): one module per op plus shared helpers.

Importing this package imports neither ``cutlass`` nor torch. The per-call predicates live in
:mod:`._gates` (torch- and CuTeDSL-free, so the op files can import them on any machine); the
DSL helpers every kernel shares (row reductions, tiled copies, the compile cache and the launch
path) live in :mod:`._common`, which imports ``cutlass`` and is loaded only when an impl is
selected. Each op module reads like the Triton ones: kernel -> host launcher -> registered impl.
"""
