"""The sgl-kernel AOT library's registered ops (``import sgl_kernel`` loads the library for the
device's arch and registers ``torch.ops.sgl_kernel``), and the PDL flag its wrappers pass."""

from __future__ import annotations

import sgl_kernel  # noqa: F401  (registers torch.ops.sgl_kernel)
import torch

from ...spec import PlatformInfo

ops = torch.ops.sgl_kernel


def pdl(t: torch.Tensor) -> bool:
    """Programmatic dependent launch, as sgl-kernel's wrappers enable it: on sm_90 and newer."""
    sm = PlatformInfo.detect(t).sm
    return sm is not None and sm >= 90
