"""The in-memory backend: ``memory://<store>/<prefix>``, for tests, examples and benchmarks.

Stores with the same name are shared inside one process, so a reader opened on the same URL
sees what a tracker wrote. ``fault`` lets tests inject failures and hangs that a real storage
cannot produce on demand.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Sequence
from typing import ClassVar
from urllib.parse import urlsplit

import anyio
import anyio.to_thread

from trajtrack._exceptions import DumpExistsError, StorageNotFoundError
from trajtrack.backends._protocol import (
    FileInfo,
    ItemDone,
    Payload,
    WriteResult,
    check_range,
    check_relative,
    write_each,
    write_payload,
)

__all__ = ["MemoryStorage"]

#: ``fault(operation, path)`` is called before each operation, in the worker thread; it may
#: raise (a failure) or block (a hang). Operations: "write", "commit", "read", "list", "stat",
#: "delete", "prepare".
Fault = Callable[[str, str], None]


class MemoryStorage:
    """A dict of ``path -> bytes`` shared by name; thread-safe."""

    _stores: ClassVar[dict[str, dict[str, tuple[bytes, float]]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, url: str = "memory://default", *, fault: Fault | None = None) -> None:
        parts = urlsplit(url)
        self._url = url
        self._store_name = parts.netloc or "default"
        self._prefix = parts.path.strip("/")
        self.fault = fault
        with self._lock:
            self._files = self._stores.setdefault(self._store_name, {})

    @property
    def url(self) -> str:
        return self._url

    @property
    def spool_dir(self) -> None:
        return None

    def local_path(self, path: str) -> None:
        return None

    @classmethod
    def reset(cls, store: str | None = None) -> None:
        """Forget one store (or all of them)."""
        with cls._lock:
            if store is None:
                for files in cls._stores.values():
                    files.clear()
            else:
                cls._stores.get(store, {}).clear()

    def _key(self, path: str) -> str:
        check_relative(path)
        return f"{self._prefix}/{path}" if self._prefix else path

    def _check(self, operation: str, path: str) -> None:
        if self.fault is not None:
            self.fault(operation, path)

    async def prepare(self) -> None:
        await anyio.to_thread.run_sync(self._check, "prepare", "")

    async def write_atomic(self, path: str, payload: Payload, *, overwrite: bool) -> WriteResult:
        return await anyio.to_thread.run_sync(self._write_sync, path, payload, overwrite)

    async def write_atomic_many(
        self,
        items: Sequence[tuple[str, Payload]],
        *,
        overwrite: bool,
        done: ItemDone | None = None,
    ) -> list[WriteResult | Exception]:
        def write(path: str, payload: Payload) -> WriteResult:
            return self._write_sync(path, payload, overwrite)

        return await anyio.to_thread.run_sync(write_each, write, items, done)

    def _write_sync(self, path: str, payload: Payload, overwrite: bool) -> WriteResult:
        self._check("write", path)
        buffer = io.BytesIO()
        result = write_payload(payload, buffer)
        data = buffer.getvalue()
        self._check("commit", path)
        key = self._key(path)
        with self._lock:
            if not overwrite and key in self._files:
                raise DumpExistsError(f"{self._url}/{path} exists (existing-name policy 'error')")
            self._files[key] = (data, time.time())
        return result

    async def read(self, path: str) -> bytes:
        await anyio.to_thread.run_sync(self._check, "read", path)
        with self._lock:
            entry = self._files.get(self._key(path))
        if entry is None:
            raise StorageNotFoundError(f"{self._url}/{path} does not exist")
        return entry[0]

    async def read_range(self, path: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        return (await self.read(path))[offset : offset + length]

    async def list(self, prefix: str = "") -> list[FileInfo]:
        await anyio.to_thread.run_sync(self._check, "list", prefix)
        root = self._key(prefix.strip("/")) if prefix.strip("/") else self._prefix
        start = f"{root}/" if root else ""
        cut = len(f"{self._prefix}/") if self._prefix else 0
        with self._lock:
            items = list(self._files.items())
        return sorted(
            (
                FileInfo(key[cut:], len(data), mtime)
                for key, (data, mtime) in items
                if key.startswith(start)
            ),
            key=lambda info: info.path,
        )

    async def stat(self, path: str) -> FileInfo | None:
        await anyio.to_thread.run_sync(self._check, "stat", path)
        with self._lock:
            entry = self._files.get(self._key(path))
        return None if entry is None else FileInfo(path, len(entry[0]), entry[1])

    async def delete(self, path: str) -> None:
        await anyio.to_thread.run_sync(self._check, "delete", path)
        with self._lock:
            self._files.pop(self._key(path), None)

    def put_raw(self, path: str, data: bytes) -> None:
        """Place bytes directly (tests: plant temp files, corrupt dumps)."""
        with self._lock:
            self._files[self._key(path)] = (data, time.time())

    async def aclose(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"MemoryStorage({self._url!r})"
