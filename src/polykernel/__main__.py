"""python -m polykernel"""

from .tools.cli import main

raise SystemExit(main())
