"""Moved to :mod:`polykernel.backends._double_backward`, shared by every backend (so that no
backend imports another); this name stays for the scripts that import it from here."""

from .._double_backward import *  # noqa: F403
from .._double_backward import refusing  # noqa: F401  (benchmarks/host/peer_refusing.py)
