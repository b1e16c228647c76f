"""``python -m trajtrack``: the same as the ``trajtrack`` console script."""

from __future__ import annotations

import sys

from trajtrack.cli import main

if __name__ == "__main__":
    sys.exit(main())
