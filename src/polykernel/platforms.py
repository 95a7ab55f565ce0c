"""Platforms: what a device is (:class:`PlatformInfo`) and where an impl can run
(:class:`CapabilityRequirement`).

Importable without torch, like :mod:`polykernel.spec`, which re-exports every public name here.
Only :meth:`PlatformInfo.detect` touches torch, lazily, and it never raises.

Example::

    >>> from polykernel.platforms import CapabilityRequirement, PlatformInfo
    >>> hopper = PlatformInfo("cuda", 0, (9, 0), "NVIDIA H200")
    >>> CapabilityRequirement.cuda(min_sm=90).is_satisfied_by(hopper)
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "CapabilityRequirement",
    "DeviceType",
    "PlatformInfo",
    "capabilities_satisfied",
    "capabilities_unmet_reason",
]


class DeviceType(str, Enum):
    """Kind of device a tensor lives on (matches ``torch.device.type``)."""

    CUDA = "cuda"
    HIP = "hip"
    NPU = "npu"
    XPU = "xpu"
    MPS = "mps"
    CPU = "cpu"
    META = "meta"

    def __str__(self) -> str:
        return self.value


def _device_type(value: DeviceType | str) -> DeviceType:
    return value if isinstance(value, DeviceType) else DeviceType(str(value))


@dataclass(frozen=True)
class PlatformInfo:
    """What a device is. ``cuda_arch`` is ``(major, minor)`` for CUDA devices, else None.

    ``device_type`` is a :class:`DeviceType` value (``"cuda"``, ``"cpu"``, ...). ROCm devices,
    which torch reports as ``cuda``, are reported as ``hip``.
    """

    device_type: str = "cpu"
    device_index: int | None = None
    cuda_arch: tuple[int, int] | None = None
    name: str = "cpu"

    @property
    def device(self) -> DeviceType:
        return _device_type(self.device_type)

    @property
    def sm(self) -> int | None:
        """``cuda_arch`` as one number (``(9, 0)`` -> 90), or None."""
        return None if self.cuda_arch is None else _sm(self.cuda_arch)

    def __str__(self) -> str:
        where = self.device_type if self.device_index is None else f"{self.device_type}:{self.device_index}"
        arch = f", sm_{self.sm}" if self.cuda_arch else ""
        if self.name in ("", self.device_type) and not arch:
            return where  # "cpu", not "cpu (cpu)"
        return f"{where} ({self.name}{arch})"

    @staticmethod
    def detect(where: Any = None) -> PlatformInfo:
        """Describe the device of ``where``: a tensor, a ``torch.device``, a string or None.

        None means the current CUDA device if there is one, else the CPU. Never raises: anything
        it cannot resolve is reported as the CPU platform.

        >>> PlatformInfo.detect("cpu").device_type
        'cpu'
        """
        try:
            return _detect(where)
        except Exception:
            return _CPU


_CPU = PlatformInfo()
_platform_memo: dict[tuple[str, int | None], PlatformInfo] = {}


def _detect(where: Any) -> PlatformInfo:
    try:
        import torch
    except ImportError:
        return _CPU
    if where is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    elif isinstance(where, torch.Tensor):
        device = where.device
    else:
        device = torch.device(where)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.type, device.index)
    hit = _platform_memo.get(key)
    if hit is not None:
        return hit
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device.index)
        if getattr(torch.version, "hip", None):
            info = PlatformInfo("hip", device.index, None, props.name)
        else:
            info = PlatformInfo("cuda", device.index, (props.major, props.minor), props.name)
    elif device.type == "cpu":
        info = _CPU
    else:
        info = PlatformInfo(device.type, device.index, None, device.type)
    _platform_memo[key] = info
    return info


def _arch(value: int | tuple[int, int] | list[int] | None) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return (int(value[0]), int(value[1]))
    return (int(value) // 10, int(value) % 10)


def _sm(arch: tuple[int, int]) -> int:
    return arch[0] * 10 + arch[1]


@dataclass(frozen=True)
class CapabilityRequirement:
    """One place an impl can run: a device type and, for CUDA, an inclusive arch window.

    >>> CapabilityRequirement.cuda(min_sm=80, max_sm=90).is_satisfied_by(PlatformInfo("cuda", 0, (10, 0), "B200"))
    False
    """

    device: str = "cuda"
    min_cuda_arch: tuple[int, int] | None = None
    max_cuda_arch: tuple[int, int] | None = None

    # Class constants (CUDA, HIP, NPU, CPU) are attached after the class body.

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", str(_device_type(self.device)))  # validates the name
        object.__setattr__(self, "min_cuda_arch", _arch(self.min_cuda_arch))
        object.__setattr__(self, "max_cuda_arch", _arch(self.max_cuda_arch))

    @staticmethod
    def cuda(min_sm: int | tuple[int, int] | None = None, max_sm: int | tuple[int, int] | None = None) -> CapabilityRequirement:
        """CUDA within an inclusive arch window; ``90`` and ``(9, 0)`` are the same arch."""
        return CapabilityRequirement("cuda", _arch(min_sm), _arch(max_sm))

    def is_satisfied_by(self, platform: PlatformInfo) -> bool:
        return self.unmet_reason(platform) is None

    def unmet_reason(self, platform: PlatformInfo) -> str | None:
        """None when satisfied, else a short reason such as ``'sm_90 < required sm_100'``."""
        want = str(_device_type(self.device))
        if str(platform.device) != want:
            return f"needs a {want.upper()} device" if want != "cpu" else "needs the CPU"
        if want != "cuda":
            return None
        if platform.cuda_arch is None:
            return "CUDA arch unknown"
        if self.min_cuda_arch is not None and platform.cuda_arch < self.min_cuda_arch:
            return f"sm_{_sm(platform.cuda_arch)} < required sm_{_sm(self.min_cuda_arch)}"
        if self.max_cuda_arch is not None and platform.cuda_arch > self.max_cuda_arch:
            return f"sm_{_sm(platform.cuda_arch)} > supported sm_{_sm(self.max_cuda_arch)}"
        return None

    def __str__(self) -> str:
        if self.min_cuda_arch is None and self.max_cuda_arch is None:
            return str(_device_type(self.device))
        lo = f"sm_{_sm(self.min_cuda_arch)}" if self.min_cuda_arch else ""
        hi = f"sm_{_sm(self.max_cuda_arch)}" if self.max_cuda_arch else ""
        return f"cuda[{lo}..{hi}]"


CapabilityRequirement.CUDA = CapabilityRequirement("cuda")  # type: ignore[attr-defined]
CapabilityRequirement.HIP = CapabilityRequirement("hip")  # type: ignore[attr-defined]
CapabilityRequirement.NPU = CapabilityRequirement("npu")  # type: ignore[attr-defined]
CapabilityRequirement.XPU = CapabilityRequirement("xpu")  # type: ignore[attr-defined]
CapabilityRequirement.CPU = CapabilityRequirement("cpu")  # type: ignore[attr-defined]


def _as_caps(caps: CapabilityRequirement | Iterable[CapabilityRequirement] | None) -> tuple[CapabilityRequirement, ...]:
    if caps is None:
        return ()
    if isinstance(caps, CapabilityRequirement):
        return (caps,)
    return tuple(caps)


def capabilities_satisfied(caps: CapabilityRequirement | Iterable[CapabilityRequirement] | None, platform: PlatformInfo) -> bool:
    """OR over ``caps``; an empty set means unrestricted. A single requirement is accepted."""
    reqs = _as_caps(caps)
    return not reqs or any(r.is_satisfied_by(platform) for r in reqs)


def capabilities_unmet_reason(caps: CapabilityRequirement | Iterable[CapabilityRequirement] | None, platform: PlatformInfo) -> str | None:
    """None when ``capabilities_satisfied``; else the reason of the closest requirement."""
    reqs = _as_caps(caps)
    if not reqs:
        return None
    reasons = [r.unmet_reason(platform) for r in reqs]
    if any(r is None for r in reasons):
        return None
    # Prefer a reason about the platform's own device type (an arch window) over "needs X".
    same = [r for req, r in zip(reqs, reasons) if str(_device_type(req.device)) == str(platform.device)]
    return (same or reasons)[0]
