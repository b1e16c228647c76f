"""Session fixtures for the real HDFS test cluster (NameNode + DataNode started by the suite).

The cluster is ``scripts/hdfs-test-cluster.sh`` (Hadoop 2.7.3 from the pyspark 2.4.8 sdist,
loopback only, free ports): started once per session in a temporary directory, stopped at the
end. Without Java (or when the jars cannot be installed) HDFS tests skip, saying why, unless
``TRAJTRACK_REQUIRE_HDFS=1`` (CI), where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "hdfs-test-cluster.sh"
REQUIRE_VAR = "TRAJTRACK_REQUIRE_HDFS"


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_VAR) == "1":
        pytest.fail(f"HDFS test cluster required ({REQUIRE_VAR}=1) but {reason}", pytrace=False)
    pytest.skip(f"HDFS test cluster unavailable: {reason}")


@dataclass
class HdfsCluster:
    """A running test cluster, and the fault injection the fault tests need.

    Every method goes through the script, which acts on the PIDs it recorded in *directory*.
    """

    directory: Path
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reload()

    def reload(self) -> None:
        text = (self.directory / "cluster.env").read_text()
        self.env = dict(re.findall(r"^(\w+)=(.*)$", text, re.MULTILINE))

    @property
    def webhdfs_url(self) -> str:
        """``webhdfs://127.0.0.1:<NameNode HTTP port>``."""
        return self.env["WEBHDFS_URL"]

    @property
    def hdfs_url(self) -> str:
        """``hdfs://127.0.0.1:<NameNode RPC port>``."""
        return self.env["HDFS_URL"]

    @property
    def http_port(self) -> int:
        return int(self.env["NN_HTTP_PORT"])

    @property
    def conf_dir(self) -> Path:
        """The cluster's HADOOP_CONF_DIR (also a valid client configuration)."""
        return Path(self.env["HADOOP_CONF_DIR"])

    @property
    def superuser(self) -> str:
        return self.env["HDFS_SUPERUSER"]

    def url(self, path: str) -> str:
        return f"{self.webhdfs_url}/{path.lstrip('/')}"

    def script(self, *args: str, timeout: float = 150) -> str:
        result = subprocess.run(
            [str(SCRIPT), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"hdfs-test-cluster.sh {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result.stdout

    def kill_namenode(self) -> None:
        self.script("kill-namenode", str(self.directory))

    def kill_datanode(self) -> None:
        self.script("kill-datanode", str(self.directory))

    def start_namenode(self) -> None:
        """Start it again (same ports, same data); returns once WebHDFS answers."""
        self.script("start-namenode", str(self.directory))

    def start_datanode(self) -> None:
        self.script("start-datanode", str(self.directory))

    def safemode(self, action: str) -> str:
        """``enter``, ``leave`` or ``get``, through DFSAdmin as the superuser."""
        return self.script("safemode", action, str(self.directory))

    def wait_healthy(self, timeout: float = 120) -> None:
        """Wait until a small write commits (both daemons up, safe mode off)."""
        self.script("wait-healthy", str(self.directory), str(int(timeout)), timeout=timeout + 30)

    def restore(self) -> None:
        """Bring the cluster back to healthy after a fault test, whatever it left behind."""
        self.script("start-namenode", str(self.directory))
        self.script("start-datanode", str(self.directory))
        self.safemode("leave")
        self.wait_healthy()


def _ensure_installed() -> None:
    if shutil.which(os.environ.get("JAVA", "java")) is None:
        _unavailable("no 'java' on PATH (Hadoop 2.7.3 needs Java 8-17)")
    cache = Path(
        os.environ.get(
            "TRAJTRACK_HADOOP_CACHE", Path.home() / ".cache" / "trajtrack" / "hadoop-2.7.3"
        )
    )
    jersey = Path("/usr/share/java/jersey1-servlet.jar")
    if (cache / "jars" / ".complete").is_file() and jersey.is_file():
        return
    try:  # a fresh machine: download the jars (~220 MB, once) and Jersey 1
        result = subprocess.run(
            [str(SCRIPT), "install"], capture_output=True, text=True, timeout=900, check=False
        )
    except subprocess.TimeoutExpired:
        _unavailable("'scripts/hdfs-test-cluster.sh install' timed out")
        return
    if result.returncode != 0:
        _unavailable(f"'scripts/hdfs-test-cluster.sh install' failed:\n{result.stderr[-3000:]}")


@pytest.fixture(scope="session")
def hdfs_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HdfsCluster]:
    """A real NameNode + DataNode with WebHDFS on 127.0.0.1, for the whole session."""
    _ensure_installed()
    directory = tmp_path_factory.mktemp("hdfs-cluster")
    result = subprocess.run(
        [str(SCRIPT), "start", str(directory)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    if result.returncode != 0:
        _unavailable(f"the cluster did not start:\n{result.stderr[-3000:]}")
    cluster = HdfsCluster(directory)
    try:
        yield cluster
    finally:
        subprocess.run(
            [str(SCRIPT), "stop", str(directory)], capture_output=True, timeout=60, check=False
        )


@pytest.fixture
def hdfs_url(hdfs_cluster: HdfsCluster, request: pytest.FixtureRequest) -> str:
    """A fresh, not yet existing destination URL on the cluster, one per test."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:80]
    return hdfs_cluster.url(f"/tests/{name}-{uuid.uuid4().hex[:8]}")
