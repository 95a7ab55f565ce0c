"""What ``polykernel bench`` measures: each op's shapes (the README's, else its op file's), the
options some rows run with, the sizes a ``--sweep`` adds and the rows' labels. Kept apart from the
measuring (:mod:`polykernel.tools.bench`), which re-exports these names.

>>> from polykernel.tools.bench_shapes import cases_for
>>> [label for label, _, _ in cases_for("softmax", sweep=False)]
['8192x32768']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# the fused preference and RL losses, in the README's order (matmul-bound: rated by their op files' flops)
_PREFERENCE = tuple(f"fused_linear_{n}_loss" for n in ("dpo", "orpo", "cpo", "simpo", "kto", "grpo"))

# op -> list of (label, example shape): the README's tables, curated by hand (each a model's real
# width, and the README's figures are measured at them). An op not listed here is benched at its
# op file's ``Op(bench_shapes=...)`` (shapes_for): a new op needs no edit here.
SHAPES: dict[str, list[tuple[str, tuple[int, ...]]]] = {
    "rms_norm": [
        ("16384x4096", (16384, 4096)),
        ("4096x16384", (4096, 16384)),
        ("2048x65536", (2048, 65536)),
        ("512x262144", (512, 262144)),
    ],
    "fused_add_rms_norm": [("16384x4096", (16384, 4096))],
    "layer_norm": [("16384x4096", (16384, 4096))],
    "group_norm": [("16x512x64x64", (16, 512, 64, 64))],  # 32 groups (a Stable Diffusion VAE block)
    "dyt": [("16384x4096", (16384, 4096))],
    "poly_norm": [("16384x4096", (16384, 4096))],
    "swiglu": [("16384x14336", (16384, 14336))],
    "geglu": [("16384x14336", (16384, 14336))],
    "relu_squared": [("16384x14336", (16384, 14336))],
    "softmax": [("8192x32768", (8192, 32768))],
    "sparsemax": [("16384x4096", (16384, 4096)), ("2048x32768", (2048, 32768))],
    "rope": [("q4x32x4096x128,k8", (4, 32, 4096, 128))],
    "mrope": [("q2x28x4096x128,k7", (2, 28, 4096, 128))],  # Qwen2-VL-7B's width (k: the example's Hq // 4)
    "cross_entropy": [("8192x128256", (8192, 128256)), ("8192x256000,softcap30", (8192, 256000))],
    "fused_linear_cross_entropy": [
        ("N8192,H4096,V128256", (8192, 4096, 128256)),
        ("N8192,H2304,V256000,softcap30,z1e-4", (8192, 2304, 256000)),  # Gemma 2's head, a PaLM z-loss
    ],
    # (T, H, I, E, k): one experts layer of Qwen3-30B-A3B and of Mixtral 8x7B (issue 24)
    "moe_experts": [("T8192,H2048,I768,E128,k8", (8192, 2048, 768, 128, 8)), ("T8192,H4096,I14336,E8,k2", (8192, 4096, 14336, 8, 2))],
    "moe_router": [("T8192,E128,k8", (8192, 128, 8))],
    "moe_experts_gpt_oss": [("T8192,H2880,I2880,E32,k4", (8192, 2880, 2880, 32, 4))],  # gpt-oss-20b's experts
    # serving layouts (forward only): prefill (8192 tokens) first, the sweep's base, then decode (64)
    "silu_and_mul": [("8192x28672", (8192, 28672)), ("64x28672", (64, 28672))],
    "gelu_and_mul": [("8192x28672", (8192, 28672)), ("64x28672", (64, 28672))],
    "fused_add_rms_norm_": [("8192x4096", (8192, 4096)), ("64x4096", (64, 4096))],
    "rotary_embedding_": [("T8192,q32x128,k8", (8192, 4096)), ("T64,q32x128,k8", (64, 4096))],
    "dynamic_quant_fp8": [("8192x4096", (8192, 4096)), ("64x4096", (64, 4096))],
    "static_quant_fp8": [("8192x4096", (8192, 4096)), ("64x4096", (64, 4096))],
    "rms_norm_quant_fp8": [("8192x4096", (8192, 4096)), ("64x4096", (64, 4096))],
    "kl_div": [("8192x128256", (8192, 128256))],
    "jsd": [("8192x128256", (8192, 128256))],
    "tvd": [("8192x128256", (8192, 128256))],
    "fused_linear_jsd": [("N8192,H4096,V128256", (8192, 4096, 128256))],
    # the fused preference/RL losses at the 1B-model shape: 2×4 sequences of 1024 tokens
    # (R, T, H, V), H = 2048, V = 128256 (issue 22)
    **{name: [("R8,T1024,H2048,V128256", (8, 1024, 2048, 128256))] for name in _PREFERENCE},
}

# The tables below refine some ops' rows and are optional: an op not in them gets its example's
# default options, a sweep along dim 0, an "AxB" label and GB/s from its bytes_moved.
# (op, label) -> the op's options for that row (the rows above whose labels name them)
OPTIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("cross_entropy", "8192x256000,softcap30"): {"softcap": 30.0},
    ("fused_linear_cross_entropy", "N8192,H2304,V256000,softcap30,z1e-4"): {"softcap": 30.0, "z_loss": 1e-4},
}

# op -> (index of the dimension a sweep scales, how many smaller sizes): the README shape, then
# the swept dimension divided by 4, 16, 64 (rope: the sequence length; the losses: the tokens).
_SWEEP_DIM: dict[str, tuple[int, int]] = {
    "rope": (2, 3),
    "mrope": (2, 3),
    "cross_entropy": (0, 2),
    "fused_linear_cross_entropy": (0, 1),
    "kl_div": (0, 2),
    "jsd": (0, 2),
    "tvd": (0, 2),
    "fused_linear_jsd": (0, 1),
    "group_norm": (2, 3),  # the image height (the batch of 16 is too short to divide)
}
# Matmul-bound ops, rated in TFLOP/s: op -> FLOPs of (N, H, V) forward / forward+backward
# (each op file's ``flops``: the fused linear JSD runs two heads forward, the student's backward).
_FLOPS: dict[str, Callable[[int, int, int, bool], int]] = {
    "fused_linear_cross_entropy": lambda n, h, v, bwd: (6 if bwd else 2) * n * h * v,
    "fused_linear_jsd": lambda n, h, v, bwd: (8 if bwd else 4) * n * h * v,
}


def shapes_for(op_name: str) -> list[tuple[str, tuple[int, ...]]]:
    """The op's bench shapes: its README shapes (:data:`SHAPES`), else those its op file declares
    (``Op(bench_shapes=...)``); an op with neither is a clear error, before anything is measured."""
    if op_name in SHAPES:
        return SHAPES[op_name]
    from polykernel.core import registry

    op = registry.get_op(op_name)
    if not op.bench_shapes:
        raise ValueError(f"{op.id}: no bench shapes (declare them in its op file: Op(bench_shapes=[(label, shape), ...]))")
    return list(op.bench_shapes)


def sweep_shapes(op_name: str) -> list[tuple[str, tuple[int, ...]]]:
    """The op's first README shape and smaller sizes along one dimension, largest first.

    >>> [label for label, _ in sweep_shapes("softmax")]
    ['8192x32768', '2048x32768', '512x32768', '128x32768']
    """
    label, shape = shapes_for(op_name)[0]
    dim, steps = _SWEEP_DIM.get(op_name, (0, 3))
    out = [(label, shape)]
    for k in range(1, steps + 1):
        s = list(shape)
        s[dim] = max(1, shape[dim] // 4**k)
        out.append((_label(op_name, tuple(s)), tuple(s)))
    return out


def _label(op_name: str, shape: tuple[int, ...]) -> str:
    if op_name in ("rope", "mrope"):
        b, h, t, d = shape
        return f"q{b}x{h}x{t}x{d},k{max(1, h // 4)}"
    if op_name in _FLOPS:
        n, h, v = shape
        return f"N{n},H{h},V{v}"
    if op_name in ("moe_experts", "moe_experts_gpt_oss"):
        return "T{},H{},I{},E{},k{}".format(*shape)
    if op_name == "moe_router":
        return "T{},E{},k{}".format(*shape)
    if op_name == "rotary_embedding_":  # [T, Hq·128] queries, Hq/4 key heads (ops/rotary_embedding_.py's example)
        t, width = shape
        return f"T{t},q{width // 128}x128,k{max(1, width // 512)}"
    return "x".join(map(str, shape))


def cases_for(op_name: str, sweep: bool) -> list[tuple[str, tuple[int, ...], bool]]:
    """(label, shape, in the sweep series) for one op: the README shapes, plus the sweep's."""
    series = sweep_shapes(op_name) if sweep else []
    in_series = {s for _, s in series}
    listed = shapes_for(op_name)
    out = [(label, shape, shape in in_series) for label, shape in listed]
    out += [(label, shape, True) for label, shape in series if shape not in {s for _, s in listed}]
    return out
