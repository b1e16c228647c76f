"""The local filesystem backend: a plain path or ``file://`` URL.

A dump is written to a hidden temporary file in its final directory (so the rename stays on one
filesystem), optionally fsynced, then published with ``os.replace`` (or ``os.link`` when the
existing-name policy forbids overwriting, which fails atomically if the name exists). A reader
never sees a partial file under a final name, even after ``kill -9``.

Each write is one worker-thread hop that serializes straight into the temporary file: no
intermediate copy of the bytes, and the GIL is released during every ``write`` syscall.
A read is one worker-thread hop too: open, read the whole file (sized by ``fstat``, one
allocation), close.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import anyio.to_thread

from trajtrack._exceptions import (
    ConfigurationError,
    DumpExistsError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)
from trajtrack.backends._protocol import ChecksumWriter, FileInfo, Payload, WriteResult
from trajtrack.layouts.names import RECORDS_DIR, WriterIdentity, temp_path_for

__all__ = ["LocalStorage"]

_WRITE_BUFFER = 1 << 20


def _read_umask() -> int:
    # os.umask() can only be read by setting it, which races with other threads creating files.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


_UMASK = _read_umask()


class LocalStorage:
    """Dumps under a local directory.

    Args:
        url: A path (``~`` is expanded) or a ``file://`` URL.
        fsync: fsync each file and its directory before publishing (durable across power loss;
            slower).
        file_mode: Permission bits of created files (before the umask).
        dir_mode: Permission bits of created directories (before the umask).
    """

    def __init__(
        self, url: str, *, fsync: bool = False, file_mode: int = 0o644, dir_mode: int = 0o755
    ) -> None:
        if url.startswith("file://"):
            parts = urlsplit(url)
            if parts.netloc not in ("", "localhost"):
                raise ConfigurationError(f"file:// URL with a remote host is not supported: {url}")
            raw = unquote(parts.path)
        else:
            raw = url
        self._root = Path(os.path.abspath(os.path.expanduser(raw)))
        self._url = url
        self._fsync = fsync
        self._file_mode = file_mode
        self._dir_mode = dir_mode
        self._who = WriterIdentity.current()
        self._real_root: str | None = None

    @property
    def url(self) -> str:
        return self._url

    @property
    def root(self) -> Path:
        """The destination directory."""
        return self._root

    @property
    def spool_dir(self) -> Path:
        """Where the tracker spools large snapshots: on this filesystem, so they move by rename."""
        return self._root / RECORDS_DIR / "spool"

    async def prepare(self) -> None:
        await anyio.to_thread.run_sync(self._prepare_sync)

    def _prepare_sync(self) -> None:
        if self._root.exists() and not self._root.is_dir():
            raise ConfigurationError(f"destination {self._root} exists and is not a directory")
        with _translated(str(self._root)):
            self._root.mkdir(parents=True, exist_ok=True, mode=self._dir_mode)
            self.spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not os.access(self._root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "destination is not writable", str(self._root))
        self._real_root = os.path.realpath(self._root)

    def _resolve(self, path: str) -> Path:
        return self._root.joinpath(*path.split("/"))

    def _check_inside(self, directory: Path) -> None:
        # Names cannot contain "..", but a symlink planted inside the destination could still
        # lead outside it: refuse to write through one.
        real_root = self._real_root or os.path.realpath(self._root)
        real = os.path.realpath(directory)
        if real != real_root and not real.startswith(real_root + os.sep):
            raise StoragePermissionError(
                f"refusing to write to {directory}: it resolves outside the destination "
                f"({real}), through a symbolic link"
            )

    async def write_atomic(self, path: str, payload: Payload, *, overwrite: bool) -> WriteResult:
        return await anyio.to_thread.run_sync(self._write_sync, path, payload, overwrite)

    def _write_sync(self, path: str, payload: Payload, overwrite: bool) -> WriteResult:
        final = self._resolve(path)
        temp = self._resolve(temp_path_for(path, self._who))
        with _translated(str(final)):
            final.parent.mkdir(parents=True, exist_ok=True, mode=self._dir_mode)
            self._check_inside(final.parent)
            try:
                result = self._move_spool(temp, payload) or self._write_temp(temp, payload)
                self._publish(temp, final, overwrite)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
            if self._fsync:
                _fsync_dir(final.parent)
        return result

    def _move_spool(self, temp: Path, payload: Payload) -> WriteResult | None:
        # A payload already serialized into a spool file on this filesystem moves by rename.
        move_to = getattr(payload, "move_to", None)
        if move_to is None or not move_to(str(temp)):
            return None
        os.chmod(temp, self._file_mode & ~_UMASK)
        return WriteResult(size=payload.size, checksum=payload.checksum)  # type: ignore[attr-defined]

    def _write_temp(self, temp: Path, payload: Payload) -> WriteResult:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(temp, flags, self._file_mode)
        with os.fdopen(fd, "wb", buffering=_WRITE_BUFFER) as handle:
            writer = ChecksumWriter(handle)
            payload.write_to(writer)  # type: ignore[arg-type]  # a minimal BinaryIO
            handle.flush()
            if self._fsync:
                os.fsync(handle.fileno())
        return writer.result()

    def _publish(self, temp: Path, final: Path, overwrite: bool) -> None:
        if overwrite:
            os.replace(temp, final)
            return
        try:
            os.link(temp, final)  # atomic: fails if `final` exists
        except FileExistsError:
            raise DumpExistsError(
                f"{final} exists (existing-name policy 'error'); nothing was overwritten"
            ) from None
        os.unlink(temp)

    async def read(self, path: str) -> bytes:
        target = self._resolve(path)
        return await anyio.to_thread.run_sync(_read_file, target)

    def local_path(self, path: str) -> str | None:
        """The file :meth:`read` reads for *path*, as a local path (readers may open it)."""
        return str(self._resolve(path))

    async def list(self, prefix: str = "") -> list[FileInfo]:
        return await anyio.to_thread.run_sync(self._list_sync, prefix)

    def _list_sync(self, prefix: str) -> builtins.list[FileInfo]:
        top = self._resolve(prefix.strip("/")) if prefix.strip("/") else self._root
        found: list[FileInfo] = []
        with _translated(str(top)):
            for directory, _dirs, files in os.walk(top, followlinks=False):
                rel_dir = os.path.relpath(directory, self._root)
                for name in files:
                    rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                    try:
                        st = os.stat(os.path.join(directory, name), follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # a temporary file renamed away while we listed
                    found.append(FileInfo(rel, st.st_size, st.st_mtime))
        found.sort(key=lambda info: info.path)
        return found

    async def stat(self, path: str) -> FileInfo | None:
        return await anyio.to_thread.run_sync(self._stat_sync, path)

    def _stat_sync(self, path: str) -> FileInfo | None:
        try:
            st = os.stat(self._resolve(path), follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _translate(exc, path) from exc
        return FileInfo(path, st.st_size, st.st_mtime)

    async def delete(self, path: str) -> None:
        await anyio.to_thread.run_sync(self._delete_sync, path)

    def _delete_sync(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError), _translated(path):
            os.unlink(self._resolve(path))

    async def aclose(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"LocalStorage({str(self._root)!r})"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _translate(exc: OSError, where: str) -> StorageError:
    message = f"{where}: {exc.strerror or exc}"
    if isinstance(exc, PermissionError) or exc.errno == errno.EROFS:
        return StoragePermissionError(message)
    if isinstance(exc, FileNotFoundError):
        return StorageNotFoundError(message)
    if exc.errno == errno.ENOSPC:
        return StorageError(f"{where}: no space left on the device")
    return StorageError(message)


def _read_file(target: Path) -> bytes:
    with _translated(str(target)), open(target, "rb", buffering=0) as handle:
        return handle.read()  # FileIO.readall: sized by fstat, grows if the file does


@contextlib.contextmanager
def _translated(where: str) -> Iterator[None]:
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise _translate(exc, where) from exc
