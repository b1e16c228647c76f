"""The exceptions trajtrack raises, in one place.

The tree::

    TrajtrackError
    ├── InvalidNameError            (also ValueError)      a dump name that cannot be stored safely
    ├── ConfigurationError          (also ValueError)      bad option, URL or missing environment
    ├── MissingDependencyError      (also ImportError)     an optional extra is not installed
    ├── TrackerStateError           (also RuntimeError)    the tracker is not in a state to do that
    │   ├── TrackerClosedError                             dump/flush after close
    │   └── TrackerFailedError                             its background task died (``__cause__``)
    ├── QueueFullError                                     full queue under the ``raise`` policy
    ├── DumpDroppedError                                   a dump discarded by a drop policy
    ├── SerializationError          (also TypeError)       the object cannot be serialized
    ├── UnsafeLoadError                                    the reader refused to unpickle code
    ├── DumpLoadError                                      a stored dump cannot be deserialized
    └── StorageError                (also OSError)         the storage failed
        ├── StorageUnavailableError                        transient: retried under a deadline
        ├── StoragePermissionError  (also PermissionError)
        ├── StorageNotFoundError    (also FileNotFoundError)
        └── DumpExistsError         (also FileExistsError) the ``error`` existing-name policy

Third-party errors (``OSError`` from the local disk, ``requests``/``HdfsError`` from WebHDFS) are
translated into these at the backend boundary with ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "DumpDroppedError",
    "DumpExistsError",
    "DumpLoadError",
    "InvalidNameError",
    "MissingDependencyError",
    "QueueFullError",
    "SerializationError",
    "StorageError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "StorageUnavailableError",
    "TrackerClosedError",
    "TrackerFailedError",
    "TrackerStateError",
    "TrajtrackError",
    "UnsafeLoadError",
]


class TrajtrackError(Exception):
    """Root of every error trajtrack raises on purpose."""


class InvalidNameError(TrajtrackError, ValueError):
    """A dump name that cannot be stored safely (absolute, ``..``, control characters, ...)."""


class ConfigurationError(TrajtrackError, ValueError):
    """A bad option, an unusable URL, or a missing environment variable."""


class MissingDependencyError(TrajtrackError, ImportError):
    """An optional dependency is missing; the message says which extra to install."""


class TrackerStateError(TrajtrackError, RuntimeError):
    """The tracker is not in a state that allows the operation (not started, closing, ...)."""


class TrackerClosedError(TrackerStateError):
    """The tracker is closed (or closing) and accepts no more dumps."""


class TrackerFailedError(TrackerStateError):
    """The tracker's background task failed; it accepts no more dumps.

    Raised by every dump, ``flush`` and ``close`` after the failure, and set on every dump that
    was pending then. The original error is the ``__cause__``.
    """


class QueueFullError(TrajtrackError):
    """The pending queue is full and the full-policy is ``raise`` (or a non-blocking dump)."""


class DumpDroppedError(TrajtrackError):
    """The dump was discarded by a ``drop_newest``/``drop_oldest`` policy; never written."""


class SerializationError(TrajtrackError, TypeError):
    """The object could not be snapshotted or serialized; nothing was queued."""


class UnsafeLoadError(TrajtrackError):
    """A dump needs arbitrary unpickling, which the reader refuses unless ``unsafe=True``."""


class DumpLoadError(TrajtrackError):
    """A stored dump could not be deserialized (corrupt, truncated, or not a torch file)."""


class StorageError(TrajtrackError, OSError):
    """The storage failed.

    Attributes:
        retryable: Whether the tracker retries the operation (with backoff, under a deadline).
        remote_exception: The remote (e.g. Java) exception name when the storage reported one.
    """

    retryable: bool = False

    def __init__(self, message: str, *, remote_exception: str | None = None) -> None:
        super().__init__(message)
        self.remote_exception = remote_exception

    def __str__(self) -> str:
        # OSError.__str__ formats errno/filename pairs; we only ever pass one message.
        return str(self.args[0]) if self.args else ""


class StorageUnavailableError(StorageError):
    """A transient storage failure (connection refused, timeout, safe mode, HTTP 5xx, ...)."""

    retryable = True


class StoragePermissionError(StorageError, PermissionError):
    """The storage refused access; never retried."""


class StorageNotFoundError(StorageError, FileNotFoundError):
    """A file or directory the operation needs does not exist."""


class DumpExistsError(StorageError, FileExistsError):
    """The final name exists and the existing-name policy is ``error``."""
