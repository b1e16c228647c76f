"""The WebHDFS backend's plumbing: spooled upload bodies and the HTTP session.

A payload is spooled once (memory, or a local temporary file when large) while its size and
CRC-32 are computed; the spool of a write that failed transiently is kept, keyed weakly by its
payload, so that the tracker's retry re-sends the same bytes without serializing again.
"""

from __future__ import annotations

import contextlib
import io
import queue
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import requests
from hdfs import InsecureClient
from hdfs.client import Client
from hdfs.util import HdfsError

from trajtrack._exceptions import MissingDependencyError, StorageError, StorageNotFoundError
from trajtrack.backends._protocol import Payload, WriteResult, write_payload
from trajtrack.backends._webhdfs_errors import translate

__all__ = ["Body", "ClientPool", "Session", "Spool", "Spools", "call", "file_status"]

_SPOOL_CHUNK = 1 << 20
T = TypeVar("T")


@dataclass(slots=True)
class Spool:
    """A payload's bytes, kept for retries, with what the checksum writer computed.

    ``rename_sent``: an attempt sent the publishing RENAME; when that attempt failed, the
    RENAME may have taken effect with its answer lost (the retry looks at the final file).
    """

    file: IO[bytes]
    result: WriteResult
    rename_sent: bool = False

    def body(self) -> Body:
        self.file.seek(0)
        return Body(self.file, self.result.size)


class Body:
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
        want = min(_SPOOL_CHUNK, self._size - self._pos)  # never past the length sent
        piece = (
            self._view[self._pos : self._pos + want]
            if self._view is not None
            else self._file.read(want)
        )
        self._pos += len(piece)
        return piece

    def close(self) -> None:
        if self._view is not None:
            self._view.release()


class Session(requests.Session):
    """A session that remembers the HTTP status of its last response (HdfsCLI drops it)."""

    last_status: int | None = None

    def request(self, method: str | bytes, url: str | bytes, *args: Any, **kwargs: Any) -> Any:
        self.last_status = None
        response = super().request(method, url, *args, **kwargs)
        self.last_status = response.status_code
        return response


class Spools:
    """The spools of payloads being written, kept across a retry of the same payload.

    Args:
        memory_limit: Payloads up to this many bytes are spooled in memory.
        directory: Where larger ones spool (a local temporary file; default: the system's).
    """

    def __init__(self, memory_limit: int, directory: str | None) -> None:
        self._memory_limit = memory_limit
        self._directory = directory
        # Keyed weakly: once the tracker drops the payload (committed or given up) it goes.
        self._kept: weakref.WeakKeyDictionary[Any, Spool] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, payload: Payload) -> Spool:
        """The kept spool of *payload*, or a new one with its bytes (blocking)."""
        with self._lock:
            kept = self._kept.get(payload)
        if kept is not None:
            return kept
        opener = getattr(payload, "open_for_reading", None)  # a file of its own: no copy
        opened = None if opener is None else opener()
        if opened is not None:
            return Spool(*opened)
        small = payload.nbytes <= self._memory_limit
        file: IO[bytes] = (
            io.BytesIO()
            if small
            # Not a `with`: on a retryable failure the spool outlives this call.
            else tempfile.TemporaryFile(dir=self._directory, prefix="trajtrack-webhdfs-")  # noqa: SIM115
        )
        try:
            result = write_payload(payload, file)  # type: ignore[arg-type]  # any binary file
            file.flush()
        except BaseException:
            file.close()
            raise
        return Spool(file, result)

    def keep(self, payload: Payload, spool: Spool) -> None:
        """Keep *spool* for a retry of *payload*."""
        with self._lock, contextlib.suppress(TypeError):  # not weak-referenceable
            self._kept[payload] = spool

    def forget(self, payload: Payload) -> None:
        with self._lock, contextlib.suppress(TypeError):
            self._kept.pop(payload, None)

    def close_all(self) -> None:
        with self._lock:
            for spool in self._kept.values():
                spool.file.close()
            self._kept.clear()


class ClientPool:
    """HdfsCLI clients, one per concurrent call (each with its own ``requests`` session).

    Args:
        url: The NameNode URLs, ``;``-separated (HdfsCLI tries them in turn: HA).
        user: The HDFS user (simple authentication).
        timeout: ``(connect, read)`` seconds for every HTTP request.
        kerberos: Authenticate with Kerberos (SPNEGO) instead.
        trust_env: Let ``requests`` use proxy settings from the environment.
        verify: TLS verification (a CA bundle path or a bool).
    """

    def __init__(
        self,
        url: str,
        *,
        user: str,
        timeout: tuple[float, float],
        kerberos: bool,
        trust_env: bool,
        verify: bool | str,
    ) -> None:
        self._url = url
        self.user = user
        self._timeout = timeout
        self._kerberos = kerberos
        self._trust_env = trust_env
        self._verify = verify
        self._idle: queue.SimpleQueue[Client] = queue.SimpleQueue()
        self._closed = False
        if kerberos:
            kerberos_client_class()  # fail now, with the install hint, not at first write

    def _new(self) -> Client:
        session = Session()
        session.trust_env = self._trust_env
        session.verify = self._verify
        if self._kerberos:
            return kerberos_client_class()(self._url, timeout=self._timeout, session=session)
        return InsecureClient(self._url, user=self.user, timeout=self._timeout, session=session)

    @contextlib.contextmanager
    def client(self) -> Iterator[Client]:
        """An idle client (or a new one) for one blocking call."""
        try:
            client = self._idle.get_nowait()
        except queue.Empty:
            client = self._new()
        try:
            yield client
        finally:
            if self._closed:
                client._session.close()
            else:
                self._idle.put(client)

    def close(self) -> None:
        """Close every idle client's session; clients in use close when they come back."""
        self._closed = True
        while True:
            try:
                client = self._idle.get_nowait()
            except queue.Empty:
                break
            client._session.close()


def kerberos_client_class() -> type[Client]:
    """HdfsCLI's Kerberos client, or an install hint."""
    try:
        from hdfs.ext.kerberos import KerberosClient
    except ImportError as exc:
        raise MissingDependencyError(
            "kerberos=True needs requests-kerberos: pip install 'trajtrack[kerberos]'"
        ) from exc
    return KerberosClient  # type: ignore[no-any-return]


def call(client: Client, what: str, func: Callable[[], T]) -> T:
    """``func()``, with WebHDFS failures translated into trajtrack's exceptions.

    *what* names the operation and path for the message (``"CREATE /runs/x.pth"``).
    """
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


def file_status(client: Client, path: str) -> dict[str, Any] | None:
    """GETFILESTATUS, ``None`` when missing (HdfsCLI's ``strict=False`` also hides 403s)."""
    try:
        found: dict[str, Any] = call(client, f"GETFILESTATUS {path}", lambda: client.status(path))
    except StorageNotFoundError:
        return None
    return found
