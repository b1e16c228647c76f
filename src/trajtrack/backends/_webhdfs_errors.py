"""WebHDFS failures to trajtrack exceptions, at the backend boundary.

What is transient (``StorageUnavailableError``, retried by the tracker) was observed on a real
Hadoop 2.7.3 cluster (see docs/hdfs.md): transport errors from ``requests`` (a dead NameNode or
DataNode), safe mode (which a DataNode relays during CREATE as a ``RemoteException`` whose
message names ``SafeModeException``), ``RetriableException``/``StandbyException``, "Failed to
find datanode" just after a restart, NameNode-down errors the DataNode relays
(``EOFException``, "Connection reset", "Connection refused"), and HTTP 5xx. Everything else is
permanent and fails fast; the Java exception's simple name is kept in ``remote_exception``.
"""

from __future__ import annotations

import re

import requests
from hdfs.util import HdfsError

from trajtrack._exceptions import (
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
    StorageUnavailableError,
)

__all__ = ["translate"]

_TRANSIENT_EXCEPTIONS = frozenset(
    {
        "SafeModeException",
        "RetriableException",
        "StandbyException",
        "ObserverRetryOnActiveException",
        "EOFException",
        "ConnectException",
        "SocketTimeoutException",
        "NoRouteToHostException",
        "NotReplicatedYetException",
        "LeaseExpiredException",  # the NameNode restarted under an open temp file
    }
)
_TRANSIENT_MESSAGES = (
    "safe mode",
    "failed to find datanode",
    "connection reset",
    "connection refused",
    "connectexception",
    "sockettimeoutexception",
    "eofexception",
    "end of file exception",
    "could only be replicated to 0 nodes",
    "does not have enough number of replicas",
    "retriableexception",
    "standbyexception",
)
_PERMISSION_EXCEPTIONS = frozenset({"AccessControlException", "SecurityException"})
_NOT_FOUND_EXCEPTIONS = frozenset({"FileNotFoundException"})
# "org.apache.hadoop.ipc.RemoteException(org.apache.hadoop...SafeModeException): ..."
_WRAPPED = re.compile(r"RemoteException\(([\w.$]+)\)")


def translate(exc: BaseException, what: str, status: int | None = None) -> StorageError:
    """The trajtrack exception for a failure of the WebHDFS operation described by *what*.

    Args:
        exc: What HdfsCLI or requests raised.
        what: The operation and path, for the message (``"CREATE /runs/x.pth"``).
        status: The HTTP status of the last response, when there was one.
    """
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
        kind = "timed out" if isinstance(exc, requests.Timeout) else "connection failed"
        return StorageUnavailableError(f"{what}: {kind}: {_short(str(exc))}")
    if isinstance(exc, (requests.exceptions.ChunkedEncodingError, requests.exceptions.SSLError)):
        return StorageUnavailableError(f"{what}: {_short(str(exc))}")
    if isinstance(exc, HdfsError):
        return _from_hdfs_error(exc, what, status)
    if isinstance(exc, requests.RequestException):
        return StorageError(f"{what}: {_short(str(exc))}")
    if status is not None and status >= 400:  # e.g. HdfsCLI's KeyError on an odd error body
        return _by_status(status, f"{what}: HTTP {status} ({type(exc).__name__}: {exc})", None)
    return StorageError(f"{what}: {type(exc).__name__}: {exc}")


def _from_hdfs_error(exc: HdfsError, what: str, status: int | None) -> StorageError:
    raw = exc.message
    message = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    name: str | None = exc.exception
    wrapped = _WRAPPED.search(message)
    if wrapped and name in (None, "RemoteException", "IOException"):
        name = wrapped.group(1).rpartition(".")[2]
    text = f"{what}: {name + ': ' if name else ''}{_short(message) or 'no message'}"
    refused = status == 401 or message.startswith("Authentication failure")
    if refused or name in _PERMISSION_EXCEPTIONS:
        return StoragePermissionError(text, remote_exception=name)
    lowered = message.lower()
    if name in _TRANSIENT_EXCEPTIONS or any(marker in lowered for marker in _TRANSIENT_MESSAGES):
        return StorageUnavailableError(text, remote_exception=name)
    if name in _NOT_FOUND_EXCEPTIONS:
        return StorageNotFoundError(text, remote_exception=name)
    if status is not None:
        return _by_status(status, text, name)
    return StorageError(text, remote_exception=name)


def _by_status(status: int, text: str, name: str | None) -> StorageError:
    if status >= 500 or status in (408, 429):
        return StorageUnavailableError(text, remote_exception=name)
    if status == 404:
        return StorageNotFoundError(text, remote_exception=name)
    if status == 401:
        return StoragePermissionError(text, remote_exception=name)
    return StorageError(text, remote_exception=name)


def _short(message: str, limit: int = 500) -> str:
    # DataNode-relayed messages carry whole Java stack traces: keep the first lines.
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    head = " | ".join(line for line in lines[:3] if not line.startswith("at "))
    return head if len(head) <= limit else head[: limit - 3] + "..."
