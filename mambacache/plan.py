"""`python -m mambacache.plan`: size a model on a topology without a chip (parallel/plan.py)."""

from __future__ import annotations

import sys

from mambacache.parallel.plan import main

if __name__ == "__main__":
    sys.exit(main())
