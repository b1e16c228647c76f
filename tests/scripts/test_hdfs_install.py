"""``scripts/hdfs-test-cluster.sh install`` on a fresh machine: an empty jar cache.

The download itself is replaced by stand-ins (a fake ``python`` whose ``pip download``
produces a tiny pyspark sdist, fake Jersey jars, ``java`` = ``true``), so the test runs the
script's own control flow -- traps, ``set -u``, the cache layout -- in seconds and offline.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "hdfs-test-cluster.sh"

# A stand-in for python3: `-m venv DIR` copies itself to DIR/bin/python, `-m pip install` does
# nothing, `-m pip download ... -d DIR pyspark==2.4.8` writes a small sdist holding the jar.
_FAKE_PYTHON = f"""#!{sys.executable}
import io, os, shutil, sys, tarfile
args = sys.argv[1:]
if args[:2] == ["-m", "venv"]:
    os.makedirs(os.path.join(args[2], "bin"))
    shutil.copy(sys.argv[0], os.path.join(args[2], "bin", "python"))
elif args[:3] == ["-m", "pip", "download"]:
    target = args[args.index("-d") + 1]
    os.makedirs(target, exist_ok=True)
    with tarfile.open(os.path.join(target, "pyspark-2.4.8.tar.gz"), "w:gz") as sdist:
        for name in ("hadoop-hdfs-2.7.3.jar", "hadoop-common-2.7.3.jar"):
            info = tarfile.TarInfo("pyspark-2.4.8/deps/jars/" + name)
            data = b"jar " + name.encode()
            info.size = len(data)
            sdist.addfile(info, io.BytesIO(data))
elif args[:3] != ["-m", "pip", "install"]:
    sys.exit("unexpected call: " + " ".join(args))
"""


def _run_install(tmp_path: Path, python: str = _FAKE_PYTHON) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "fake-python"
    fake.write_text(python)
    fake.chmod(0o755)
    jersey = tmp_path / "jersey"
    jersey.mkdir(exist_ok=True)
    for jar in ("jsr311-api", "jersey1-core", "jersey1-server", "jersey1-servlet"):
        (jersey / f"{jar}.jar").write_bytes(b"jar")
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "JAVA": "true",
        "TRAJTRACK_JERSEY_DIR": str(jersey),
        "TRAJTRACK_HADOOP_CACHE": str(tmp_path / "cache" / "hadoop-2.7.3"),
        "TMPDIR": str(scratch),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), "install"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def test_install_into_an_empty_cache_succeeds_and_cleans_up(tmp_path: Path) -> None:
    done = _run_install(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "unbound variable" not in done.stderr
    jars = tmp_path / "cache" / "hadoop-2.7.3" / "jars"
    assert (jars / "hadoop-hdfs-2.7.3.jar").read_bytes() == b"jar hadoop-hdfs-2.7.3.jar"
    assert (jars / ".complete").exists()
    assert list((tmp_path / "tmp").iterdir()) == []  # the download's scratch directory is gone


def test_install_with_a_warm_cache_downloads_nothing(tmp_path: Path) -> None:
    assert _run_install(tmp_path).returncode == 0
    again = _run_install(tmp_path, python="#!/bin/sh\necho must not run >&2\nexit 3\n")
    assert again.returncode == 0, again.stderr
    assert "must not run" not in again.stderr
