"""The serving ops' native launches against the Python launchers', without a GPU (run by
tests/backends/test_native.py in a subprocess: it loads a second build of the extension).

The build given as argv[1] is compiled with POLYKERNEL_NATIVE_HOST_TEST: its entries take CPU
tensors and its Slots only call back. Each C++ entry and the Python path of the same call record
what they would launch (kernel, constexprs and launch options, grid, every argument: a tensor by
its data pointer and dtype, a number by its value and type); the two records must be equal.
Prints ``ok <cases>``.
"""

from __future__ import annotations

import sys

import torch
from torch.utils import cpp_extension

from polykernel.backends.triton import _native, glu
from polykernel.backends.triton import fused_add_rms_norm as far
from polykernel.backends.triton import fused_add_rms_norm_ as far_
from polykernel.backends.triton import quant_fp8 as qf
from polykernel.backends.triton import rotary_embedding_ as rot

C = cpp_extension.load(
    name="polykernel_native_host_test",
    sources=[str(_native.SOURCE)],
    build_directory=sys.argv[1],
    extra_cflags=["-O0", "-DPOLYKERNEL_NATIVE_HOST_TEST"],
)
C.accept_triton(*_native.triton_version())
records: list = []


def recording_slot(kernel, **meta):
    return C.Slot(lambda grid, args, key: records.append((kernel, meta, tuple(grid), args)))


def python_launch(kernel, grid, *args, **meta):
    records.append((kernel, meta, tuple(grid) + (1,) * (3 - len(grid)), args))


_native.slot = recording_slot
_native.colsum_slot = lambda: recording_slot("colsum")
for mod in (glu, qf, rot, far):
    mod.launch = python_launch
qf._target = lambda q, n: (glu._row_view(q, n), False)  # q's own rows, as on the GPU (not the CPU scratch)
_native.set_enabled(False)  # the Python path


def filled(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of ``shape``: only its data pointer, dtype, shape and strides are compared (the
    launches are recorded, never run), so any finite values do; a cheap fill, not randn (whose
    draws for the 5000-row cases took most of this script's time after the build)."""
    return torch.empty(shape, dtype=dtype).fill_(0.5)


def described(args, single_token: bool):
    out = [("t", a.data_ptr(), a.dtype) if isinstance(a, torch.Tensor) else (type(a).__name__, a) for a in args]
    if single_token and len(out) == 17:  # rotary: one token's stride is only ever multiplied by 0
        out[9] = out[12] = None
    return out


def same(label, native_op, python_op, args, launches=1):
    """``native_op(*args)`` (the C++ entry) and ``python_op(*args)`` (the Python path) launch alike."""
    records.clear()
    result = native_op(*args)
    assert result is not None, f"{label}: the native entry declined"
    native = list(records)
    records.clear()
    python_op(*args)
    assert len(native) == len(records) == launches, (label, native, records)
    for (k1, m1, g1, a1), (k2, m2, g2, a2) in zip(native, records):
        one = g1[0] == 1
        assert (k1, m1, g1) == (k2, m2, g2), (label, (m1, g1), (m2, g2))
        assert described(a1, one) == described(a2, one), (label, described(a1, one), described(a2, one))
    return result


cases = 0
for dtype in (torch.bfloat16, torch.float32):
    for rows in (1, 7, 64, 5000):
        for d in (1, 128, 1001, 4096):
            x = filled(rows, 2 * d, dtype=dtype)
            for act in (0, 1, 2):
                C.set_glu_and_mul_plan(x, act, glu._and_mul_plan(x, act))
                y = C.glu_and_mul(x, None, act)
                assert y.shape == (rows, d) and y.dtype == dtype and y.is_contiguous()
                assert same("glu_and_mul", C.glu_and_mul, glu.glu_and_mul, (x, y, act)) is y
                cases += 1
        for n in (128, 4096, 14336):
            x, r = filled(rows, n, dtype=dtype), filled(rows, n, dtype=dtype)
            for w in (filled(n, dtype=dtype), filled(n)):
                C.set_fused_add_rms_norm_inplace_plan(x, r, w, far._native_plan(x, r, w))
                same("fused_add_rms_norm_", C.fused_add_rms_norm_inplace, far_.fused_add_rms_norm_, (x, r, w, 1e-6, 1.0))
                cases += 1
        for n in (128, 1000, 4096, 20000):
            x, w = filled(rows, n, dtype=dtype), filled(n, dtype=dtype)
            C.set_static_quant_fp8_plan(x, qf._native_plan(x))
            q = torch.empty(rows, n, dtype=torch.float8_e4m3fn)
            for scale in (torch.tensor([0.5]), torch.tensor(0.5), torch.rand(rows, 1) + 0.1):
                same("static_quant_fp8", C.static_quant_fp8, qf.static_quant, (x, scale, q))
                same("rms_norm_quant_fp8", C.rms_norm_quant_fp8, qf.rms_norm_quant, (x, w, scale, 1e-6, q))
            s = torch.empty(rows, 1)
            same("dynamic_quant_fp8 per token", C.dynamic_quant_fp8, qf.dynamic_quant, (x, True, q, s))
            s = torch.empty(1)
            same("dynamic_quant_fp8 per tensor", C.dynamic_quant_fp8, qf.dynamic_quant, (x, False, q, s), 2)
            cases += 1
        for hq, hk, hs, rd, layout in [(32, 8, 128, 128, "2d"), (8, 0, 64, 32, "2d"), (40, 40, 80, 80, "3d"), (32, 8, 128, 64, "qkv")]:
            cache = filled(100, rd, dtype=dtype)
            if layout == "qkv":  # slices of one fused projection
                buf = filled(rows, (hq + 2 * hk) * hs, dtype=dtype)
                q, k = buf[:, : hq * hs], buf[:, hq * hs : (hq + hk) * hs]
            else:
                q = filled(rows, hq * hs, dtype=dtype)
                k = filled(rows, hk * hs, dtype=dtype) if hk else None
                if layout == "3d":
                    q, k = q.view(rows, hq, hs), k.view(rows, hk, hs)
            for is_neox in (True, False):
                pos = torch.randint(0, 100, (rows,), dtype=torch.int32 if is_neox else torch.int64)
                C.set_rotary_embedding_plan(q, k, hs, cache, is_neox, rot._native_plan(q, k, hs, cache, is_neox))
                out = same("rotary_embedding_", C.rotary_embedding, rot.rotary_embedding_, (pos, q, k, hs, cache, is_neox))
                assert out[0] is q and out[1] is k
                cases += 1
print("ok", cases)
