"""The WebHDFS backend: ``webhdfs://``, ``swebhdfs://`` and ``hdfs://`` destinations.

Built on HdfsCLI (the ``hdfs`` package, extra ``trajtrack[hdfs]``), whose calls block: every
operation runs in a worker thread (``anyio.to_thread.run_sync`` under a ``CapacityLimiter``),
with one HdfsCLI client (and so one ``requests`` session) per concurrent call, taken from a
pool, and a ``(connect, read)`` timeout on every HTTP request.

A write is one attempt (the tracker retries what is transient):

1. the payload is spooled once (memory, or a local temp file when large) while its size and
   CRC-32 are computed; a retried payload reuses the spool instead of serializing again;
2. the spool is uploaded to a hidden temp name next to the final path (two-step CREATE);
3. GETFILESTATUS checks the temp file has the spooled length;
4. RENAME publishes it: ``renameoptions=OVERWRITE`` replaces atomically; without overwrite a
   plain RENAME answers ``{"boolean": false}`` when the name exists (a ``DumpExistsError``),
   except on a retry after a RENAME whose answer was lost: when the existing file has this
   payload's length and CRC-32 (read back), that RENAME took effect; the write is done;
5. on any failure the temp file is deleted (best effort; the tracker's sweep catches the rest).
"""

from __future__ import annotations

import builtins
import getpass
import logging
import os
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import requests
from hdfs.client import Client

from trajtrack._exceptions import (
    ConfigurationError,
    DumpExistsError,
    StorageError,
    StorageNotFoundError,
    StorageUnavailableError,
)
from trajtrack._retry import RetryPolicy, retry_sync
from trajtrack.backends._hadoop_conf import WebHdfsTarget, resolve_target
from trajtrack.backends._protocol import (
    FileInfo,
    ItemDone,
    Payload,
    WriteResult,
    check_range,
    check_relative,
    write_each_concurrently,
)
from trajtrack.backends._webhdfs_io import ClientPool, Spool, Spools, call, file_status
from trajtrack.layouts.names import WriterIdentity, temp_path_for

__all__ = ["WebHdfsStorage", "open_webhdfs"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TIMEOUT = (10.0, 120.0)
_SPOOL_CHUNK = 1 << 20


def open_webhdfs(url: str, **options: Any) -> WebHdfsStorage:
    """Open a WebHDFS destination (the registry's factory for its three schemes).

    Args:
        url: ``webhdfs://host:port[,host2:port]/path``, ``swebhdfs://...`` or
            ``hdfs://nameservice-or-host[:port]/path``.
        **options: See :class:`WebHdfsStorage`.
    """
    return WebHdfsStorage(url, **options)


class WebHdfsStorage:
    """Dumps under a directory of HDFS, through WebHDFS.

    Args:
        url: See :func:`open_webhdfs`.
        user: The HDFS user (simple authentication); default ``HADOOP_USER_NAME``, else the
            login name. Ignored with ``kerberos=True``.
        namenodes: WebHDFS endpoints (``http://host:port``, several for HA) overriding what
            the URL or the Hadoop configuration say.
        hadoop_conf_dir: Where ``core-site.xml``/``hdfs-site.xml`` are, for ``hdfs://`` URLs
            (default ``HADOOP_CONF_DIR``, else ``$HADOOP_HOME/etc/hadoop``).
        timeout: Seconds per HTTP request: a number or ``(connect, read)``.
        threads: Concurrent blocking calls (worker threads, HTTP clients); at least the
            tracker's ``workers``.
        prepare_timeout: How long :meth:`prepare` keeps retrying an unreachable cluster.
        spool_memory: Payloads up to this many bytes are spooled in memory, larger ones in a
            local temporary file.
        spool_dir: Directory for those temporary files (default: the system's).
        permission: Octal permission of created files (e.g. ``"640"``; default the server's).
        kerberos: Authenticate with Kerberos (SPNEGO; extra ``trajtrack[kerberos]``).
        trust_env: Let ``requests`` use proxy settings from the environment.
        verify: TLS verification for ``swebhdfs``/``https`` (a CA bundle path or a bool).
    """

    def __init__(
        self,
        url: str,
        *,
        user: str | None = None,
        namenodes: str | Sequence[str] | None = None,
        hadoop_conf_dir: str | os.PathLike[str] | None = None,
        timeout: float | tuple[float, float] = DEFAULT_TIMEOUT,
        threads: int = 8,
        prepare_timeout: float = 30.0,
        spool_memory: int = 256 << 20,
        spool_dir: str | None = None,
        permission: str | None = None,
        kerberos: bool = False,
        trust_env: bool = True,
        verify: bool | str = True,
    ) -> None:
        if threads < 1:
            raise ConfigurationError("threads must be >= 1")
        self._url = url
        self._target: WebHdfsTarget = resolve_target(
            url, namenodes=namenodes, hadoop_conf_dir=hadoop_conf_dir
        )
        self._prepare_timeout = prepare_timeout
        self._permission = permission
        self._limiter = anyio.CapacityLimiter(threads)
        self._clients = ClientPool(
            ";".join(self._target.namenodes),
            user=user or os.environ.get("HADOOP_USER_NAME") or getpass.getuser(),
            timeout=_timeout(timeout),
            kerberos=kerberos,
            trust_env=trust_env,
            verify=verify,
        )
        self._closed = False
        self._who = WriterIdentity.current()
        self._spools = Spools(spool_memory, spool_dir)

    @property
    def url(self) -> str:
        return self._url

    @property
    def spool_dir(self) -> None:
        return None  # remote: large snapshots spool in the local temporary directory

    def local_path(self, path: str) -> None:
        return None

    @property
    def user(self) -> str:
        """The HDFS user of simple authentication."""
        return self._clients.user

    @property
    def namenodes(self) -> tuple[str, ...]:
        """The WebHDFS endpoints in use."""
        return self._target.namenodes

    @property
    def root(self) -> str:
        """The absolute HDFS path of the destination directory."""
        return self._target.root

    # ------------------------------------------------------------------ plumbing

    async def _run(self, func: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise StorageError(f"{self._url}: the storage is closed")
        return await anyio.to_thread.run_sync(
            func, *args, limiter=self._limiter, abandon_on_cancel=True
        )

    def _abs(self, path: str) -> str:
        path = path.strip("/")
        if not path:
            return self._target.root
        return self._target.root.rstrip("/") + "/" + check_relative(path)

    # ------------------------------------------------------------------ prepare

    async def prepare(self) -> None:
        await self._run(self._prepare_sync)

    def _prepare_sync(self) -> None:
        policy = RetryPolicy(
            initial_backoff=0.2, max_backoff=5.0, deadline=self._prepare_timeout, jitter=0.0
        )
        nodes = ", ".join(self._target.namenodes)
        try:
            retry_sync(
                policy,
                self._make_root,
                what=f"preparing {self._url}",
                on_retry=lambda _n, delay, exc: logger.debug(
                    "preparing %s: %s; retrying in %.1f s", self._url, exc, delay
                ),
            )
        except StorageUnavailableError as exc:
            raise StorageUnavailableError(
                f"HDFS at {nodes} is unreachable or not ready: {exc}",
                remote_exception=exc.remote_exception,
            ) from exc

    def _make_root(self) -> None:
        root = self._target.root
        with self._clients.client() as client:
            status = file_status(client, root)
            if status is not None and status.get("type") != "DIRECTORY":
                raise ConfigurationError(f"destination {self._url} exists and is not a directory")
            if status is None:
                call(client, f"MKDIRS {root}", lambda: client.makedirs(root))

    # ------------------------------------------------------------------ write

    async def write_atomic(self, path: str, payload: Payload, *, overwrite: bool) -> WriteResult:
        return await self._run(self._write_sync, path, payload, overwrite)

    async def write_atomic_many(
        self,
        items: Sequence[tuple[str, Payload]],
        *,
        overwrite: bool,
        done: ItemDone | None = None,
    ) -> builtins.list[WriteResult | Exception]:
        # Each file is several requests of its own: concurrently, as many as the limiter lets.
        return await write_each_concurrently(self, items, overwrite=overwrite, done=done)

    def _write_sync(self, path: str, payload: Payload, overwrite: bool) -> WriteResult:
        spool = self._spools.get(payload)
        final = self._abs(path)
        temp = self._abs(temp_path_for(path, self._who))
        with self._clients.client() as client:
            try:
                self._upload(client, temp, spool)
                self._publish(client, temp, final, spool, overwrite)
            except BaseException as exc:
                self._remove_quietly(client, temp)
                if isinstance(exc, StorageError) and exc.retryable:
                    self._spools.keep(payload, spool)
                else:
                    spool.file.close()
                raise
        self._spools.forget(payload)
        spool.file.close()
        return spool.result

    def _upload(self, client: Client, temp: str, spool: Spool) -> None:
        body = spool.body()
        try:
            call(
                client,
                f"CREATE {temp}",
                lambda: client.write(temp, data=body, overwrite=True, permission=self._permission),
            )
        finally:
            body.close()
        status = call(client, f"GETFILESTATUS {temp}", lambda: client.status(temp))
        if status.get("length") != spool.result.size:
            raise StorageUnavailableError(
                f"CREATE {temp}: wrote {status.get('length')} bytes, expected "
                f"{spool.result.size}; the upload was cut short"
            )

    def _publish(
        self, client: Client, temp: str, final: str, spool: Spool, overwrite: bool
    ) -> None:
        what = f"RENAME {temp} -> {final}"
        if overwrite:
            # rename2 with OVERWRITE replaces atomically and answers an empty 200.
            call(
                client,
                what,
                lambda: client._rename(temp, destination=final, renameoptions="OVERWRITE"),
            )
            return
        # Marked before sending: an attempt failing from here on may have renamed.
        sent_before, spool.rename_sent = spool.rename_sent, True
        response = call(client, what, lambda: client._rename(temp, destination=final))
        if _json_boolean(response):
            return
        # `false` gives no cause: the destination exists, or the temp file vanished.
        status = file_status(client, final)
        if status is None:
            raise StorageError(f"{what}: the NameNode refused the rename (temp file gone?)")
        # Only an earlier attempt's RENAME, its answer lost, can have made the final this
        # write's own. Without one the name is someone else's, refused even with the same
        # bytes (two records would claim one file), and refusing needs no read.
        if sent_before and self._holds(client, final, status, spool):
            self._remove_quietly(client, temp)
            return
        raise DumpExistsError(
            f"{self._url}: {final} exists (existing-name policy 'error'); nothing was overwritten"
        )

    def _holds(self, client: Client, final: str, status: dict[str, Any], spool: Spool) -> bool:
        """Whether *final* (GETFILESTATUS *status*) has the spooled bytes: length, CRC-32."""
        if status.get("type") != "FILE" or status.get("length") != spool.result.size:
            return False

        def crc32() -> int:
            crc = 0
            with client.read(final, chunk_size=_SPOOL_CHUNK) as chunks:
                for chunk in chunks:
                    crc = zlib.crc32(chunk, crc)
            return crc

        return f"crc32:{call(client, f'OPEN {final}', crc32):08x}" == spool.result.checksum

    def _remove_quietly(self, client: Client, temp: str) -> None:
        try:
            client.delete(temp)
        except Exception as exc:  # best effort: the tracker's sweep removes what is left
            logger.debug("could not remove the temporary file %s: %s", temp, exc)

    # ------------------------------------------------------------------ read, list, stat

    async def read(self, path: str) -> bytes:
        return await self._run(self._read_sync, path)

    def _read_sync(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        target = self._abs(path)

        def read() -> bytes:
            # OPEN with offset/length: one request, the DataNode sends only that range.
            with client.read(target, offset=offset, length=length) as reader:
                return reader.read()  # type: ignore[no-any-return]

        with self._clients.client() as client:
            return call(client, f"OPEN {target}", read)

    async def read_range(self, path: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        if length == 0:
            return b""
        try:
            return await self._run(self._read_sync, path, offset, length)
        except StorageError as exc:
            # The NameNode refuses an offset at or past the end ("Offset=N out of the range
            # [0, N)") where a file read gives nothing: answer as the other backends do.
            if offset and "out of the range" in str(exc):
                return b""
            raise

    async def list(self, prefix: str = "") -> list[FileInfo]:
        return await self._run(self._list_sync, prefix)

    def _list_sync(self, prefix: str) -> builtins.list[FileInfo]:
        base = self._target.root.rstrip("/")
        found: list[FileInfo] = []
        pending = [self._abs(prefix)]
        with self._clients.client() as client:
            while pending:
                directory = pending.pop()
                try:
                    entries = call(
                        client,
                        f"LISTSTATUS {directory}",
                        lambda d=directory: client.list(d, status=True),  # type: ignore[misc]
                    )
                except StorageNotFoundError:
                    continue  # a missing prefix (or a directory removed while walking)
                for name, status in entries:
                    full = f"{directory.rstrip('/')}/{name}"
                    if status.get("type") == "DIRECTORY":
                        pending.append(full)
                    else:
                        found.append(_info(full[len(base) + 1 :], status))
        found.sort(key=lambda info: info.path)
        return found

    async def stat(self, path: str) -> FileInfo | None:
        return await self._run(self._stat_sync, path)

    def _stat_sync(self, path: str) -> FileInfo | None:
        target = self._abs(path)
        with self._clients.client() as client:
            status = file_status(client, target)
        return None if status is None else _info(path, status)

    async def delete(self, path: str) -> None:
        target = self._abs(path)
        await self._run(self._delete_sync, target)

    def _delete_sync(self, target: str) -> None:
        with self._clients.client() as client:
            call(client, f"DELETE {target}", lambda: client.delete(target))

    async def aclose(self) -> None:
        self._closed = True
        self._clients.close()
        self._spools.close_all()

    def __repr__(self) -> str:
        return f"WebHdfsStorage({self._url!r}, namenodes={list(self._target.namenodes)})"


def _info(path: str, status: dict[str, Any]) -> FileInfo:
    mtime = status.get("modificationTime")
    return FileInfo(path, int(status.get("length", 0)), mtime / 1000 if mtime else None)


def _json_boolean(response: requests.Response) -> bool:
    try:
        return bool(response.json()["boolean"])
    except (ValueError, KeyError, TypeError):
        return False


def _timeout(value: float | tuple[float, float]) -> tuple[float, float]:
    pair = (value, value) if isinstance(value, (int, float)) else tuple(value)
    if len(pair) != 2 or any(not isinstance(v, (int, float)) or v <= 0 for v in pair):
        raise ConfigurationError(f"timeout must be seconds > 0 or (connect, read), got {value!r}")
    return float(pair[0]), float(pair[1])
