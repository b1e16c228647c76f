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
   plain RENAME answers ``{"boolean": false}`` when the name exists (a ``DumpExistsError``);
5. on any failure the temp file is deleted (best effort; the tracker's sweep catches the rest).
"""

from __future__ import annotations

import builtins
import contextlib
import getpass
import io
import logging
import os
import queue
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import anyio
import anyio.to_thread
import requests
from hdfs import InsecureClient
from hdfs.client import Client
from hdfs.util import HdfsError

from trajtrack._exceptions import (
    ConfigurationError,
    DumpExistsError,
    MissingDependencyError,
    StorageError,
    StorageNotFoundError,
    StorageUnavailableError,
)
from trajtrack.backends._hadoop_conf import WebHdfsTarget, resolve_target
from trajtrack.backends._protocol import ChecksumWriter, FileInfo, Payload, WriteResult
from trajtrack.backends._webhdfs_errors import translate
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


@dataclass(slots=True)
class _Spool:
    """A payload's bytes, kept for retries, with what the checksum writer computed."""

    file: IO[bytes]
    result: WriteResult

    def body(self) -> _Body:
        self.file.seek(0)
        return _Body(self.file, self.result.size)


class _Body:
    """The upload body: a spool read in 1 MiB pieces, with a length (so requests sends a
    Content-Length, not chunked) and, for an in-memory spool, no copy of the bytes."""

    def __init__(self, file: IO[bytes], size: int) -> None:
        self._file = file
        self._size = size
        self._view = file.getbuffer() if isinstance(file, io.BytesIO) else None
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def read(self, _hint: int = -1) -> bytes | memoryview:
        if self._view is not None:
            piece = self._view[self._pos : self._pos + _SPOOL_CHUNK]
            self._pos += len(piece)
            return piece
        return self._file.read(_SPOOL_CHUNK)

    def close(self) -> None:
        if self._view is not None:
            self._view.release()


class _Session(requests.Session):
    """A session that remembers the HTTP status of its last response (HdfsCLI drops it)."""

    last_status: int | None = None

    def request(self, method: str | bytes, url: str | bytes, *args: Any, **kwargs: Any) -> Any:
        self.last_status = None
        response = super().request(method, url, *args, **kwargs)
        self.last_status = response.status_code
        return response


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
        self._user = user or os.environ.get("HADOOP_USER_NAME") or getpass.getuser()
        self._timeout = _timeout(timeout)
        self._kerberos = kerberos
        self._trust_env = trust_env
        self._verify = verify
        self._prepare_timeout = prepare_timeout
        self._spool_memory = spool_memory
        self._spool_dir = spool_dir
        self._permission = permission
        self._limiter = anyio.CapacityLimiter(threads)
        self._idle: queue.SimpleQueue[Client] = queue.SimpleQueue()
        self._closed = False
        self._who = WriterIdentity.current()
        # Spools of payloads whose write failed, so a retry does not serialize again; keyed
        # weakly: once the tracker drops the payload (committed or given up) the spool goes.
        self._spools: weakref.WeakKeyDictionary[Any, _Spool] = weakref.WeakKeyDictionary()
        self._spools_lock = threading.Lock()
        if kerberos:
            _kerberos_client_class()  # fail now, with the install hint, not at first write

    @property
    def url(self) -> str:
        return self._url

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

    def _new_client(self) -> Client:
        session = _Session()
        session.trust_env = self._trust_env
        session.verify = self._verify
        url = ";".join(self._target.namenodes)
        if self._kerberos:
            return _kerberos_client_class()(url, timeout=self._timeout, session=session)
        return InsecureClient(url, user=self._user, timeout=self._timeout, session=session)

    @contextlib.contextmanager
    def _client(self) -> Iterator[Client]:
        try:
            client = self._idle.get_nowait()
        except queue.Empty:
            client = self._new_client()
        try:
            yield client
        finally:
            if self._closed:
                client._session.close()
            else:
                self._idle.put(client)

    def _abs(self, path: str) -> str:
        path = path.strip("/")
        if not path:
            return self._target.root
        return self._target.root.rstrip("/") + "/" + path

    def _call(self, client: Client, what: str, func: Callable[[], T]) -> T:
        try:
            return func()
        except StorageError:
            raise
        except Exception as exc:
            status = getattr(client._session, "last_status", None)
            known = isinstance(exc, (requests.RequestException, HdfsError))
            if not known and (status is None or status < 400):
                raise  # not a WebHDFS failure: a bug, or the payload's own error
            raise translate(exc, what, status) from exc

    def _status(self, client: Client, path: str) -> dict[str, Any] | None:
        """GETFILESTATUS, ``None`` when missing (HdfsCLI's ``strict=False`` also hides 403s)."""
        try:
            return self._call(client, f"GETFILESTATUS {path}", lambda: client.status(path))  # type: ignore[no-any-return]
        except StorageNotFoundError:
            return None

    # ------------------------------------------------------------------ prepare

    async def prepare(self) -> None:
        await self._run(self._prepare_sync)

    def _prepare_sync(self) -> None:
        root = self._target.root
        deadline = time.monotonic() + self._prepare_timeout
        delay = 0.2
        while True:
            try:
                with self._client() as client:
                    status = self._status(client, root)
                    if status is not None and status.get("type") != "DIRECTORY":
                        raise ConfigurationError(
                            f"destination {self._url} exists and is not a directory"
                        )
                    if status is None:
                        self._call(client, f"MKDIRS {root}", lambda: client.makedirs(root))
                return
            except StorageUnavailableError as exc:
                if time.monotonic() + delay > deadline:
                    raise StorageUnavailableError(
                        f"HDFS at {', '.join(self._target.namenodes)} is unreachable or not "
                        f"ready (gave up preparing {self._url} after {self._prepare_timeout:.0f} "
                        f"s): {exc}",
                        remote_exception=exc.remote_exception,
                    ) from exc
                logger.debug("preparing %s: %s; retrying in %.1f s", self._url, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    # ------------------------------------------------------------------ write

    async def write_atomic(self, path: str, payload: Payload, *, overwrite: bool) -> WriteResult:
        return await self._run(self._write_sync, path, payload, overwrite)

    def _write_sync(self, path: str, payload: Payload, overwrite: bool) -> WriteResult:
        spool = self._spool_for(payload)
        final = self._abs(path)
        temp = self._abs(temp_path_for(path, self._who))
        with self._client() as client:
            try:
                self._upload(client, temp, spool)
                self._publish(client, temp, final, overwrite)
            except BaseException as exc:
                self._remove_quietly(client, temp)
                if isinstance(exc, StorageError) and exc.retryable:
                    self._keep_spool(payload, spool)
                else:
                    spool.file.close()
                raise
        self._forget_spool(payload)
        spool.file.close()
        return spool.result

    def _spool_for(self, payload: Payload) -> _Spool:
        with self._spools_lock:
            kept = self._spools.get(payload)
        if kept is not None:
            return kept
        small = payload.nbytes <= self._spool_memory
        file: IO[bytes] = (
            io.BytesIO()
            if small
            # Not a `with`: on a retryable failure the spool outlives this call.
            else tempfile.TemporaryFile(dir=self._spool_dir, prefix="trajtrack-webhdfs-")  # noqa: SIM115
        )
        try:
            writer = ChecksumWriter(file)  # type: ignore[arg-type]  # any binary file
            payload.write_to(writer)  # type: ignore[arg-type]  # a minimal BinaryIO
            file.flush()
        except BaseException:
            file.close()
            raise
        return _Spool(file, writer.result())

    def _keep_spool(self, payload: Payload, spool: _Spool) -> None:
        with self._spools_lock, contextlib.suppress(TypeError):  # not weak-referenceable
            self._spools[payload] = spool

    def _forget_spool(self, payload: Payload) -> None:
        with self._spools_lock, contextlib.suppress(TypeError):
            self._spools.pop(payload, None)

    def _upload(self, client: Client, temp: str, spool: _Spool) -> None:
        body = spool.body()
        try:
            self._call(
                client,
                f"CREATE {temp}",
                lambda: client.write(temp, data=body, overwrite=True, permission=self._permission),
            )
        finally:
            body.close()
        status = self._call(client, f"GETFILESTATUS {temp}", lambda: client.status(temp))
        if status.get("length") != spool.result.size:
            raise StorageUnavailableError(
                f"CREATE {temp}: wrote {status.get('length')} bytes, expected "
                f"{spool.result.size}; the upload was cut short"
            )

    def _publish(self, client: Client, temp: str, final: str, overwrite: bool) -> None:
        what = f"RENAME {temp} -> {final}"
        if overwrite:
            # rename2 with OVERWRITE replaces atomically and answers an empty 200.
            self._call(
                client,
                what,
                lambda: client._rename(temp, destination=final, renameoptions="OVERWRITE"),
            )
            return
        response = self._call(client, what, lambda: client._rename(temp, destination=final))
        if _json_boolean(response):
            return
        # `false` gives no cause: the destination exists, or the temp file vanished.
        if self._status(client, final) is not None:
            raise DumpExistsError(
                f"{self._url}: {final} exists (existing-name policy 'error'); nothing was "
                f"overwritten"
            )
        raise StorageError(f"{what}: the NameNode refused the rename (temp file gone?)")

    def _remove_quietly(self, client: Client, temp: str) -> None:
        try:
            client.delete(temp)
        except Exception as exc:  # best effort: the tracker's sweep removes what is left
            logger.debug("could not remove the temporary file %s: %s", temp, exc)

    # ------------------------------------------------------------------ read, list, stat

    async def read(self, path: str) -> bytes:
        return await self._run(self._read_sync, path)

    def _read_sync(self, path: str) -> bytes:
        target = self._abs(path)

        def read() -> bytes:
            with client.read(target) as reader:
                return reader.read()  # type: ignore[no-any-return]

        with self._client() as client:
            return self._call(client, f"OPEN {target}", read)

    def local_path(self, path: str) -> str | None:
        """``None``: HDFS files are read through WebHDFS, never from the local filesystem."""
        return None

    async def list(self, prefix: str = "") -> list[FileInfo]:
        return await self._run(self._list_sync, prefix)

    def _list_sync(self, prefix: str) -> builtins.list[FileInfo]:
        base = self._target.root.rstrip("/")
        found: list[FileInfo] = []
        pending = [self._abs(prefix)]
        with self._client() as client:
            while pending:
                directory = pending.pop()
                try:
                    entries = self._call(
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
        with self._client() as client:
            status = self._status(client, target)
        return None if status is None else _info(path, status)

    async def delete(self, path: str) -> None:
        target = self._abs(path)
        await self._run(self._delete_sync, target)

    def _delete_sync(self, target: str) -> None:
        with self._client() as client:
            self._call(client, f"DELETE {target}", lambda: client.delete(target))

    async def aclose(self) -> None:
        self._closed = True
        while True:
            try:
                client = self._idle.get_nowait()
            except queue.Empty:
                break
            client._session.close()
        with self._spools_lock:
            for spool in self._spools.values():
                spool.file.close()
            self._spools.clear()

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


def _kerberos_client_class() -> type[Client]:
    try:
        from hdfs.ext.kerberos import KerberosClient
    except ImportError as exc:
        raise MissingDependencyError(
            "kerberos=True needs requests-kerberos: pip install 'trajtrack[kerberos]'"
        ) from exc
    return KerberosClient  # type: ignore[no-any-return]
