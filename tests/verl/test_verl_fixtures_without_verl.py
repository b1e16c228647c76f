"""verl's objects read as data where neither verl nor tensordict can be imported (#33 item 1).

The committed fixtures (real verl 0.9.1 ``DataProto``s and verl's ``RolloutSample``, written by
``tests/verl/make_fixtures.py``) are read in a fresh interpreter whose ``sitecustomize`` puts a
meta-path finder in front that refuses ``verl`` and ``tensordict``; the load worker that
trajtrack spawns inherits it. What comes back is compared with values built from torch and
numpy alone (``_support.verl_cases.expected``), by ``torch.equal`` and numpy's equality.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _support.verl_cases import FIXTURES, NAMES

TESTS = Path(__file__).resolve().parent.parent
SRC = TESTS.parent / "src"

BLOCKER = """
import sys

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("verl", "tensordict"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, _Blocked())
"""

CHECK = """
import sys

import numpy as np

from _support.expect import assert_same
from _support.verl_cases import FIXTURES, NAMES, expected
from trajtrack.reader import allow_in_this_process, load_dump_file


def main():
    if sys.argv[1] == "in-process":
        allow_in_this_process()  # what the trajtrack command does
    try:
        import tensordict  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("tensordict was importable: the blocker is not in place")
    for name in NAMES:
        got = load_dump_file(FIXTURES / f"{name}.pt")
        assert_same(got, expected(name), name)
        batch = got.full_batch if name == "verl_sample" else got
        batch = batch[0] if name == "containers" else batch
        arrays = getattr(batch, "non_tensor_batch", {})
        assert all(type(a) is np.ndarray for a in arrays.values()), name
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("verl", "tensordict"))
    assert not loaded, loaded
    print("read", len(NAMES))


if __name__ == "__main__":
    main()
"""


def blocked_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(TESTS), str(SRC)])
    return env


def test_the_fixtures_are_committed_and_small() -> None:
    sizes = {name: (FIXTURES / f"{name}.pt").stat().st_size for name in NAMES}
    assert all(0 < size < 8192 for size in sizes.values()), sizes


@pytest.mark.parametrize("mode", ["in-process", "load-worker"])
def test_fixtures_read_as_data_without_verl_or_tensordict(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    done = subprocess.run(
        [sys.executable, str(script), mode],
        env=blocked_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"read {len(NAMES)}" in done.stdout


def test_show_and_diff_of_fixture_runs_without_verl(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        run.mkdir()
        shutil.copy(FIXTURES / "nested.pt", run / "batch.pth")
        shutil.copy(FIXTURES / "verl_sample.pt", run / "sample.pth")
    shutil.copy(FIXTURES / "consolidated.pt", b / "batch.pth")  # differs: no 'critic' entry
    env = blocked_env(tmp_path)

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "trajtrack", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )

    shown = cli("show", str(a), "sample")
    assert shown.returncode == 0, shown.stderr
    assert "RolloutSample" in shown.stdout and "['critic']: dict" in shown.stdout
    assert "'uid-0', 'uid-1', 'uid-2'" in shown.stdout
    diffed = cli("diff", str(a), str(b))
    assert diffed.returncode == 1, diffed.stdout + diffed.stderr
    assert "critic" in diffed.stdout and "1 equal, 1 different" in diffed.stdout
