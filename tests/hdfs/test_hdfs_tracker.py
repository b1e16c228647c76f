"""The tracker and the sync shim writing to the real cluster, end to end."""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from blockbuster import BlockBuster, blockbuster_ctx
from hdfs import InsecureClient

import trajtrack
from _support.expect import assert_same
from _support.hdfs_cluster import HdfsCluster
from trajtrack import Tracker

pytestmark = pytest.mark.hdfs


def _load(cluster: HdfsCluster, hdfs_path: str) -> object:
    """Read a dump straight through HdfsCLI (independent of the backend) and torch.load it."""
    client = InsecureClient(f"http://127.0.0.1:{cluster.http_port}", user=cluster.superuser)
    with client.read(hdfs_path) as reader:
        return torch.load(io.BytesIO(reader.read()), weights_only=True)


def _path_of(url: str) -> str:
    return "/" + url.split("://", 1)[1].split("/", 1)[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_tracker_dumps_read_back_equal(hdfs_cluster: HdfsCluster, hdfs_url: str) -> None:
    dumps = {
        "step1/obs": {"obs": torch.randn(8, 16), "step": 1},
        "step1/big": {"w": torch.arange(300_000, dtype=torch.float32)},  # > 1 MB: thread copy
        "step2/tokens": [torch.ones(3, dtype=torch.int64), "text"],
    }
    async with Tracker(hdfs_url) as tracker:
        handles = [await tracker.dump(obj, name) for name, obj in dumps.items()]
        await tracker.flush(timeout=60)
        records = [await handle for handle in handles]
    assert [r.path for r in records] == [f"{name}.pth" for name in dumps]
    root = _path_of(hdfs_url)
    for name, expected in dumps.items():
        loaded = _load(hdfs_cluster, f"{root}/{name}.pth")
        assert_same(loaded, expected)  # element by element (repr() abbreviates big tensors)
    client = InsecureClient(f"http://127.0.0.1:{hdfs_cluster.http_port}")
    assert client.list(f"{root}/.trajtrack/records")  # the record of what was written


def _ha_conf(directory: Path, live_http_port: int) -> Path:
    """A client HADOOP_CONF_DIR naming an HA nameservice whose first NameNode is dead."""
    directory.mkdir()
    (directory / "core-site.xml").write_text(
        "<configuration><property><name>fs.defaultFS</name><value>hdfs://trajns</value>"
        "</property></configuration>"
    )
    props = {
        "dfs.nameservices": "trajns",
        "dfs.ha.namenodes.trajns": "nn1,nn2",
        "dfs.namenode.http-address.trajns.nn1": f"127.0.0.1:{_free_port()}",
        "dfs.namenode.http-address.trajns.nn2": f"127.0.0.1:{live_http_port}",
    }
    body = "".join(
        f"<property><name>{k}</name><value>{v}</value></property>" for k, v in props.items()
    )
    (directory / "hdfs-site.xml").write_text(f"<configuration>{body}</configuration>")
    return directory


@pytest.mark.parametrize("form", ["nameservice", "rpc-address"])
def test_sync_shim_with_verl_environment(
    hdfs_cluster: HdfsCluster,
    hdfs_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    form: str,
) -> None:
    root = _path_of(hdfs_url)
    if form == "nameservice":  # hdfs://trajns/..., failing over from a dead NameNode
        conf = _ha_conf(tmp_path / "conf", hdfs_cluster.http_port)
        destination = f"hdfs://trajns{root}"
    else:  # hdfs://127.0.0.1:<rpc port>/..., as in the cluster's own configuration
        conf = hdfs_cluster.conf_dir
        destination = f"{hdfs_cluster.hdfs_url}{root}"
    monkeypatch.setenv("HADOOP_CONF_DIR", str(conf))
    monkeypatch.setenv("VERL_ENABLE_TRACKER", "1")
    monkeypatch.setenv("VERL_TRACKER_HDFS_DIR", destination)
    batch = {"input_ids": torch.arange(12).reshape(3, 4), "reward": torch.tensor([0.5, 1.0, 0.0])}
    handle = trajtrack.dump_data(batch, "rollout/step7")
    assert handle is not None
    trajtrack.get_tracker().flush(timeout=60)
    assert handle.result(timeout=1).size > 0
    loaded = _load(hdfs_cluster, f"{root}/rollout/step7.pth")
    assert isinstance(loaded, dict)
    assert torch.equal(loaded["input_ids"], batch["input_ids"])
    assert torch.equal(loaded["reward"], batch["reward"])


@pytest.fixture
def blockbuster() -> Iterator[BlockBuster]:
    # Blocking calls (socket waits, sleeps, file I/O) on the event loop thread raise.
    with blockbuster_ctx("trajtrack") as bb:
        yield bb


async def test_eight_workers_upload_concurrently_without_blocking_the_loop(
    hdfs_cluster: HdfsCluster, hdfs_url: str, blockbuster: BlockBuster
) -> None:
    count = 48
    async with Tracker(hdfs_url, workers=8, storage_options={"threads": 8}) as tracker:
        handles = [
            await tracker.dump({"i": i, "x": torch.full((64 * 1024,), float(i))}, f"w/{i}")
            for i in range(count)
        ]
        await tracker.flush(timeout=120)
        records = [await handle for handle in handles]
        stats = tracker.statistics()
    assert stats.failed == 0
    assert stats.committed == count
    assert len({r.path for r in records}) == count
    loaded = _load(hdfs_cluster, f"{_path_of(hdfs_url)}/w/{count - 1}.pth")
    assert isinstance(loaded, dict)
    assert loaded["i"] == count - 1
    assert torch.equal(loaded["x"], torch.full((64 * 1024,), float(count - 1)))
