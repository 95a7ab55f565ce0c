"""python -m polykernel"""

from .cli import main

raise SystemExit(main())
