"""The compiler probe's kernel: a 16-element copy, compiled ahead of time for one arch (no launch,
no device needed), which runs tileiras exactly as a first launch would."""

from __future__ import annotations

import io

import cuda.tile as ct
from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, export_kernel

TILE = 16


@ct.kernel
def _copy(src, dst, TILE: ct.Constant[int]):
    i = ct.bid(0)
    ct.store(dst, index=(i,), tile=ct.load(src, index=(i,), shape=(TILE,)))


def compile_for(sm: int | None) -> int:
    """Compile the probe for ``sm_<sm>`` (sm_90 when unknown); returns the cubin's size."""
    arr = ArrayConstraint(ct.float32, 1, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(), may_alias_internally=False)
    sig = KernelSignature([arr, arr, TILE], CallingConvention.cutile_python_v2())
    buf = io.BytesIO()
    export_kernel(_copy, [sig], buf, gpu_code=f"sm_{sm or 90}", output_format="cubin")
    return len(buf.getvalue())
