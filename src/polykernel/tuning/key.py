"""What a measured decision is keyed on: the environment identity (the store's namespace) and the
per-call key (op, argument class with bucketed sizes, dtypes, layout, platform).

Both are plain JSON so that a person reading the store can tell what an entry is for::

    identity: {"schema": 1, "polykernel": "0.1.0", "source": "4e57c8184cb9a243", "torch": "2.8.0",
               "triton": "3.4.0", "backends": {"liger-kernel": null, ...}, "cuda": "12.8",
               "gpus": ["NVIDIA H200"], "timing": "...", "triton_interpret": false}
    key:      {"op": "norm.rms_norm", "platform": "cuda NVIDIA H200 sm_90", "deterministic": false,
               "class": {"dtype": "bfloat16", "needs_grad": false, "n": 4096, ...},
               "tensors": ["bfloat16[16384x4096]", "bfloat16[1x4096]"]}

Sizes are bucketed: the last dim exactly (kernels specialize on it), the product of the other dims
rounded up to a power of two (so 1000 and 1024 rows share an entry). A non-contiguous tensor is
marked ``:strided``, since an impl's speed (and eligibility) can depend on its layout; when the
call needs gradients, each tensor that requires grad is marked ``:grad`` (a frozen weight's
backward computes no weight gradient: another time, and a gradient that parity never checked).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import env

if TYPE_CHECKING:
    from ..core.protocols import OpLike

SCHEMA = 1
# Names the timing method in the identity: times taken another way never mix with these.
TIMING_METHOD = "cuda: events, L2 flushed, interleaved, median + host perf_counter per call; cpu: wall, interleaved, median"
# Distributions whose version changes what an impl does (None when not installed).
BACKEND_DISTS = ("triton", "nvidia-cutlass-dsl", "cuda-tile", "liger-kernel", "quack-kernels", "flashinfer-python", "sglang-kernel")


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# The files whose content decides what an impl computes and how fast: the kernels and their launchers.
SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".h")


def source_fingerprint(root: Path) -> str:
    """A hash of the package's source files (names and contents, never times).

    The version alone is 0.1.0 for every development tree and every install from git: a winner
    measured before a kernel changed would outlive the change. ~10 ms over ~2 MB, once per process.
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts):
        try:
            data = path.read_bytes()
        except OSError:  # unreadable: its name still counts
            data = b""
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:16]


@functools.cache
def _static_identity() -> dict[str, Any]:
    import torch

    from .. import __version__

    gpus: list[str] = []
    if torch.cuda.is_available():
        gpus = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return {
        "schema": SCHEMA,
        "polykernel": __version__,
        "source": source_fingerprint(Path(__file__).resolve().parent.parent),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "backends": {d: _version(d) for d in BACKEND_DISTS if d != "triton"},
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "gpus": gpus,
        "timing": TIMING_METHOD,
    }


def identity() -> dict[str, Any]:
    """The environment identity: a decision measured under one never applies under another."""
    return {**_static_identity(), "triton_interpret": env.triton_interpret()}


def namespace(ident: dict[str, Any]) -> str:
    """A short, stable name for an identity (the store's file name)."""
    text = json.dumps(ident, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def platform_name(device: Any) -> str:
    """``"cuda NVIDIA H200 sm_90"`` or ``"cpu <model>"``: the device kind, never its index."""
    from ..spec import PlatformInfo

    info = PlatformInfo.detect(device)
    if info.device_type == "cpu":
        return f"cpu {_cpu_model()}"
    arch = f" sm_{info.sm}" if info.cuda_arch else ""
    return f"{info.device_type} {info.name}{arch}"


def bucket(n: int) -> int:
    """The next power of two >= n (0 stays 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _plain(value: Any) -> Any:
    """A JSON value for an argument-class entry (dtypes and devices by name)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    text = str(value)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    import torch

    if isinstance(value, torch.device):
        return value.type
    return text


def tensor_class(t: Any, grad: bool = False) -> str:
    """``"bfloat16[16384x4096]"``: dtype, bucketed leading size x exact last dim, layout; with
    ``grad`` (the call needs gradients) ``:grad`` on a tensor that requires grad, since which
    gradients a backward computes changes its time and what parity checked."""
    dtype = str(t.dtype).removeprefix("torch.")
    marks = ("" if t.is_contiguous() else ":strided") + (":grad" if grad and t.requires_grad else "")
    if t.dim() == 0:
        return f"{dtype}[]{marks}"
    rows = 1
    for d in t.shape[:-1]:
        rows *= int(d)
    shape = f"{bucket(rows)}x{int(t.shape[-1])}" if t.dim() > 1 else f"{int(t.shape[-1])}"
    return f"{dtype}[{shape}]{marks}"


def key(op: OpLike, argkey: tuple[Any, ...], tensors: Any, deterministic: bool = False) -> str:
    """The store key for one call: JSON text (readable in the store, usable as a dict key)."""
    import torch

    fields = {f: _plain(v) for f, v in zip(op.fields, argkey) if f != "device" and not isinstance(v, torch.device)}
    return json.dumps(
        {
            "op": op.id,
            "platform": platform_name(argkey[0]),
            "deterministic": bool(deterministic),
            "class": fields,
            "tensors": [tensor_class(t, bool(argkey[2])) for t in tensors if isinstance(t, torch.Tensor)],
        },
        separators=(",", ":"),
    )
