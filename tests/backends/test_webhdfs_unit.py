"""WebHDFS backend without a cluster: URL resolution, error translation, the missing extra."""

from __future__ import annotations

import io
import socket
import sys
from pathlib import Path
from typing import IO

import pytest
import requests
from hdfs.util import HdfsError

from trajtrack import (
    ConfigurationError,
    MissingDependencyError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
    StorageUnavailableError,
)
from trajtrack.backends import WriteResult, open_storage
from trajtrack.backends._hadoop_conf import resolve_target
from trajtrack.backends._registry import _FACTORIES
from trajtrack.backends._webhdfs_errors import translate
from trajtrack.backends._webhdfs_io import Spool
from trajtrack.backends.webhdfs import WebHdfsStorage


def _conf(directory: Path, core: dict[str, str], hdfs: dict[str, str]) -> Path:
    for name, props in (("core-site.xml", core), ("hdfs-site.xml", hdfs)):
        body = "".join(
            f"<property><name>{k}</name><value>{v}</value></property>" for k, v in props.items()
        )
        (directory / name).write_text(f'<?xml version="1.0"?><configuration>{body}</configuration>')
    return directory


# ------------------------------------------------------------------ URLs


@pytest.mark.parametrize(
    ("url", "namenodes", "root"),
    [
        ("webhdfs://nn:9870/runs/r1", ("http://nn:9870",), "/runs/r1"),
        ("webhdfs://nn/runs/", ("http://nn:9870",), "/runs"),
        ("swebhdfs://nn:9871/x", ("https://nn:9871",), "/x"),
        ("webhdfs://a:1,b:2/x", ("http://a:1", "http://b:2"), "/x"),
        ("webhdfs://a:1;b:2/x", ("http://a:1", "http://b:2"), "/x"),
        ("webhdfs://nn:9870", ("http://nn:9870",), "/"),
        ("webhdfs://nn:9870/with%20space", ("http://nn:9870",), "/with space"),
    ],
)
def test_webhdfs_urls(url: str, namenodes: tuple[str, ...], root: str) -> None:
    target = resolve_target(url, environ={})
    assert target.namenodes == namenodes
    assert target.root == root


def test_dotdot_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"\.\."):
        resolve_target("webhdfs://nn:1/a/../b", environ={})


def test_hdfs_url_from_environment_variable() -> None:
    env = {"TRAJTRACK_WEBHDFS_URL": "http://nn1:50070, nn2:50070"}
    target = resolve_target("hdfs://anything/p", environ=env)
    assert target.namenodes == ("http://nn1:50070", "http://nn2:50070")
    assert target.root == "/p"


def test_explicit_namenodes_option_wins() -> None:
    env = {"TRAJTRACK_WEBHDFS_URL": "http://ignored:1"}
    target = resolve_target("hdfs://ns/p", namenodes=["http://a:1", "b:2"], environ=env)
    assert target.namenodes == ("http://a:1", "http://b:2")


def test_hdfs_nameservice_from_hadoop_conf(tmp_path: Path) -> None:
    _conf(
        tmp_path,
        {"fs.defaultFS": "hdfs://prod"},
        {
            "dfs.nameservices": "prod,other",
            "dfs.ha.namenodes.prod": "nn1, nn2",
            "dfs.namenode.http-address.prod.nn1": "h1:9870",
            "dfs.namenode.http-address.prod.nn2": "h2:9870",
        },
    )
    env = {"HADOOP_CONF_DIR": str(tmp_path)}
    assert resolve_target("hdfs://prod/x", environ=env).namenodes == (
        "http://h1:9870",
        "http://h2:9870",
    )
    # No authority: fs.defaultFS names the nameservice.
    assert resolve_target("hdfs:///x", environ=env).namenodes == (
        "http://h1:9870",
        "http://h2:9870",
    )


def test_hdfs_rpc_address_maps_to_http_address(tmp_path: Path) -> None:
    _conf(
        tmp_path,
        {"fs.defaultFS": "hdfs://nn.example:8020"},
        {
            "dfs.namenode.rpc-address": "nn.example:8020",
            "dfs.namenode.http-address": "0.0.0.0:50070",
        },
    )
    target = resolve_target("hdfs://nn.example/data", hadoop_conf_dir=tmp_path, environ={})
    assert target.namenodes == ("http://nn.example:50070",)


def test_https_policy(tmp_path: Path) -> None:
    _conf(
        tmp_path,
        {},
        {
            "dfs.http.policy": "HTTPS_ONLY",
            "dfs.namenode.rpc-address": "nn:8020",
            "dfs.namenode.https-address": "nn:9871",
        },
    )
    assert resolve_target("hdfs://nn:8020/d", hadoop_conf_dir=tmp_path, environ={}).namenodes == (
        "https://nn:9871",
    )


def test_unresolvable_hdfs_url_says_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as no_conf:
        resolve_target("hdfs://cluster/x", environ={})
    for hint in ("TRAJTRACK_WEBHDFS_URL", "HADOOP_CONF_DIR", "webhdfs://", "namenodes"):
        assert hint in str(no_conf.value)
    _conf(tmp_path, {"fs.defaultFS": "hdfs://elsewhere"}, {})
    with pytest.raises(ConfigurationError, match=str(tmp_path)):
        resolve_target("hdfs://cluster/x", environ={"HADOOP_CONF_DIR": str(tmp_path)})


def test_bad_conf_xml(tmp_path: Path) -> None:
    (tmp_path / "hdfs-site.xml").write_text("<configuration><property>")
    with pytest.raises(ConfigurationError, match="cannot parse"):
        resolve_target("hdfs://x/y", hadoop_conf_dir=tmp_path, environ={})


def test_open_storage_and_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HADOOP_USER_NAME", "alice")
    storage = open_storage("webhdfs://nn:1/r")
    assert isinstance(storage, WebHdfsStorage)
    assert storage.root == "/r"
    assert storage.user == "alice"
    assert open_storage("webhdfs://nn:1/r", user="bob").user == "bob"  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match="timeout"):
        open_storage("webhdfs://nn:1/r", timeout=(1, -1))
    with pytest.raises(ConfigurationError, match="threads"):
        open_storage("webhdfs://nn:1/r", threads=0)


# ------------------------------------------------------------------ errors


def _hdfs_error(exception: str | None, message: str | bytes) -> HdfsError:
    return HdfsError(message, exception=exception)


@pytest.mark.parametrize(
    ("exc", "status", "kind", "remote"),
    [
        (requests.ConnectionError("refused"), None, StorageUnavailableError, None),
        (requests.ReadTimeout("slow"), None, StorageUnavailableError, None),
        (_hdfs_error("SafeModeException", "Name node is in safe mode."), 403,
         StorageUnavailableError, "SafeModeException"),
        (_hdfs_error("RemoteException", "org.apache.hadoop.ipc.RemoteException(org.apache."
                     "hadoop.hdfs.server.namenode.SafeModeException): Cannot create file. Name "
                     "node is in safe mode.\n\tat org.apache.Foo"), 403,
         StorageUnavailableError, "SafeModeException"),
        (_hdfs_error("RetriableException", "NameNode still not started"), 403,
         StorageUnavailableError, "RetriableException"),
        (_hdfs_error("StandbyException", "Operation category READ is not supported"), 403,
         StorageUnavailableError, "StandbyException"),
        (_hdfs_error("IOException", "Failed to find datanode, suggest to check cluster health."),
         403, StorageUnavailableError, "IOException"),
        (_hdfs_error("EOFException", "End of File Exception between local host"), 403,
         StorageUnavailableError, "EOFException"),
        (_hdfs_error("IOException", "Failed on local exception: Connection reset by peer"), 403,
         StorageUnavailableError, "IOException"),
        (_hdfs_error(None, b""), 500, StorageUnavailableError, None),
        (_hdfs_error("NullPointerException", "oops"), 500, StorageUnavailableError,
         "NullPointerException"),
        (_hdfs_error("AccessControlException", "Permission denied: user=x"), 403,
         StoragePermissionError, "AccessControlException"),
        (_hdfs_error(None, "Authentication failure. Check your credentials."), 401,
         StoragePermissionError, None),
        (_hdfs_error("FileNotFoundException", "File /x does not exist."), 404,
         StorageNotFoundError, "FileNotFoundException"),
        (_hdfs_error("FileAlreadyExistsException", "Path is not a directory: /x"), 403,
         StorageError, "FileAlreadyExistsException"),
        (_hdfs_error("IllegalArgumentException", "Invalid path name"), 400, StorageError,
         "IllegalArgumentException"),
        (KeyError("RemoteException"), 502, StorageUnavailableError, None),
    ],
)  # fmt: skip
def test_translate(
    exc: BaseException, status: int | None, kind: type[StorageError], remote: str | None
) -> None:
    translated = translate(exc, "CREATE /x", status)
    assert type(translated) is kind
    assert translated.remote_exception == remote
    assert str(translated).startswith("CREATE /x")
    assert "\tat " not in str(translated)  # Java stack traces are cut


# ------------------------------------------------------------------ behaviour without a cluster


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_unreachable_cluster_fails_prepare_with_a_clear_error() -> None:
    storage = open_storage(f"webhdfs://127.0.0.1:{_dead_port()}/x", prepare_timeout=0.5)
    with pytest.raises(StorageUnavailableError, match="unreachable"):
        await storage.prepare()
    await storage.aclose()


async def test_write_to_a_dead_namenode_is_retryable() -> None:
    from trajtrack.tracker._payloads import BytesPayload

    storage = open_storage(f"webhdfs://127.0.0.1:{_dead_port()}/x", timeout=2)
    with pytest.raises(StorageUnavailableError) as caught:
        await storage.write_atomic("a.pth", BytesPayload(b"x"), overwrite=True)
    assert caught.value.retryable
    await storage.aclose()


def test_missing_hdfs_package_gives_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "hdfs" or m.startswith("hdfs.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in [m for m in sys.modules if m.startswith("trajtrack.backends.webhdfs")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hdfs", None)  # makes `import hdfs` raise ImportError
    for scheme in ("webhdfs", "hdfs"):
        monkeypatch.delitem(_FACTORIES, scheme, raising=False)
    with pytest.raises(MissingDependencyError, match=r"pip install 'trajtrack\[hdfs\]'"):
        open_storage("webhdfs://nn:1/x")
    with pytest.raises(MissingDependencyError, match=r"dependency 'hdfs(\.\w+)?'"):
        open_storage("hdfs://nn/x")


@pytest.mark.parametrize("in_memory", [False, True])
def test_an_upload_body_never_reads_past_its_length(tmp_path: Path, in_memory: bool) -> None:
    # The length is the Content-Length sent: a longer file (a spool with bytes after the
    # payload's end) must not send more.
    data = bytes(range(256)) * 8195  # two chunks and a bit
    size = len(data) - 1000
    file: IO[bytes] = io.BytesIO(data) if in_memory else (tmp_path / "spool").open("w+b")
    if not in_memory:
        file.write(data)
    with file:
        body = Spool(file, WriteResult(size, "")).body()
        assert len(body) == size
        sent = b"".join(iter(lambda: bytes(body.read()), b""))
        body.close()
    assert sent == data[:size]
