"""``python -m polykernel.tools.demo`` (the same as ``polykernel demo``)."""

from .command import main

raise SystemExit(main())
