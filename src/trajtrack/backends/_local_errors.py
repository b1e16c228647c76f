"""How a local filesystem's ``OSError`` becomes a typed :class:`StorageError`."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

from trajtrack._exceptions import (
    DumpExistsError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)

__all__ = ["exists_error", "translate", "translated"]


def translate(exc: OSError, where: str) -> StorageError:
    """The :class:`StorageError` matching *exc* (missing, permission...), naming *where*."""
    message = f"{where}: {exc.strerror or exc}"
    if isinstance(exc, PermissionError) or exc.errno == errno.EROFS:
        return StoragePermissionError(message)
    if isinstance(exc, FileNotFoundError):
        return StorageNotFoundError(message)
    if exc.errno == errno.ENOSPC:
        return StorageError(f"{where}: no space left on the device")
    return StorageError(message)


@contextlib.contextmanager
def translated(where: str) -> Iterator[None]:
    """Any ``OSError`` raised inside as the matching :class:`StorageError` naming *where*."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise translate(exc, where) from exc


def exists_error(name: str) -> DumpExistsError:
    """A file published without overwriting found *name* taken."""
    return DumpExistsError(f"{name} exists (existing-name policy 'error'); nothing was overwritten")
