"""Write the verl fixtures (``tests/verl/fixtures/*.pt``) with real verl 0.9.1 and tensordict.

Run from the repository root: ``python tests/verl/make_fixtures.py``. The marked verl tests
(``tests/verl/test_verl_objects.py``) check that freshly written files read the same as these.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for _support

from _support.verl_cases import FIXTURES, write_fixtures

if __name__ == "__main__":
    write_fixtures(FIXTURES)
    for path in sorted(FIXTURES.glob("*.pt")):
        print(f"{path.stat().st_size:7d}  {path}")
