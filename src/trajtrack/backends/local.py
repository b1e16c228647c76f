"""The local filesystem backend: a plain path or ``file://`` URL.

A dump is written to a hidden temporary file in its final directory (so the rename stays on one
filesystem), optionally fsynced, then published with ``os.replace`` (or ``os.link`` when the
existing-name policy forbids overwriting, which fails atomically if the name exists). A reader
never sees a partial file under a final name, even after ``kill -9``.

Each write is one worker-thread hop that serializes straight into the temporary file: no
intermediate copy of the bytes, and the GIL is released during every ``write`` syscall. A batch
(:meth:`LocalStorage.write_atomic_many`) is one hop for all its files, keeping the directory of
the last file open for the next (the dumps of one step share it).
A read is one worker-thread hop too: open, read the whole file (sized by ``fstat``, one
allocation), close.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import operator
import os
import stat
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final
from urllib.parse import unquote, urlsplit

import anyio.to_thread

from trajtrack._exceptions import (
    ConfigurationError,
    StoragePermissionError,
)
from trajtrack.backends._local_errors import exists_error, translate, translated
from trajtrack.backends._local_paths import (
    DirectoryReader,
    is_inside,
    open_directory,
    resolve_inside,
)
from trajtrack.backends._protocol import (
    BytesPayload,
    FileInfo,
    ItemDone,
    Payload,
    WriteResult,
    check_range,
    check_relative,
    write_all,
    write_each,
    write_payload_unbuffered,
)
from trajtrack.layouts.names import RECORDS_DIR, WriterIdentity, temp_path_for

__all__ = ["DirectoryReader", "LocalStorage", "resolve_inside", "translate", "translated"]

_WRITE_BUFFER = 1 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


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
        writer_process: Deprecated and ignored: every file is written by a worker thread
            (the helper process it switched is gone: ``benchmarks/bench_core.py`` measures the
            thread against inline and thread-pool writers side by side).
    """

    def __init__(
        self,
        url: str,
        *,
        fsync: bool = False,
        file_mode: int = 0o644,
        dir_mode: int = 0o755,
        writer_process: bool | None = None,
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
        if writer_process is not None:
            warnings.warn(
                "LocalStorage(writer_process=...) is ignored: files are written by a thread",
                DeprecationWarning,
                stacklevel=2,
            )

    @property
    def url(self) -> str:
        return self._url

    @property
    def root(self) -> Path:
        """The destination directory."""
        return self._root

    @property
    def spool_dir(self) -> str:
        """Where the tracker spools large snapshots: on this filesystem, so they move by rename."""
        return str(self._root / RECORDS_DIR / "spool")

    def local_path(self, path: str) -> str:
        return str(self._resolve(path)) if path else str(self._root)

    async def prepare(self) -> None:
        await anyio.to_thread.run_sync(self._prepare_sync)

    def _prepare_sync(self) -> None:
        if self._root.exists() and not self._root.is_dir():
            raise ConfigurationError(f"destination {self._root} exists and is not a directory")
        with translated(str(self._root)):
            self._root.mkdir(parents=True, exist_ok=True, mode=self._dir_mode)
            os.close(self._open_dir([RECORDS_DIR, "spool"]))
            if not os.access(self._root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "destination is not writable", str(self._root))
        self._real_root = os.path.realpath(self._root)

    def _resolve(self, path: str) -> Path:
        return self._root.joinpath(*check_relative(path).split("/"))

    def _open_dir(self, parts: builtins.list[str]) -> int:
        """A descriptor of the directory ``root/parts...``, creating what is missing, never
        through a link leading out of the destination (:func:`open_directory`)."""
        return open_directory(
            str(self._root),
            parts,
            real_root=self._real_root or os.path.realpath(self._root),
            create=self._dir_mode,
        )

    async def write_atomic(self, path: str, payload: Payload, *, overwrite: bool) -> WriteResult:
        return await anyio.to_thread.run_sync(self._write_sync, path, payload, overwrite)

    async def write_atomic_many(
        self,
        items: Sequence[tuple[str, Payload]],
        *,
        overwrite: bool,
        done: ItemDone | None = None,
    ) -> builtins.list[WriteResult | Exception]:
        return await anyio.to_thread.run_sync(self._write_many_sync, items, overwrite, done)

    def _write_many_sync(
        self, items: Sequence[tuple[str, Payload]], overwrite: bool, done: ItemDone | None
    ) -> builtins.list[WriteResult | Exception]:
        # The last file's directory, open for the next; only that one, however many a batch spans.
        directories: dict[tuple[str, ...], int] = {}
        try:
            return write_each(
                lambda path, payload: self._write_sync(path, payload, overwrite, directories),
                items,
                done,
            )
        finally:
            for fd in directories.values():
                os.close(fd)

    def _directory(self, key: tuple[str, ...], directories: dict[tuple[str, ...], int]) -> int:
        """The descriptor of directory *key*, the one kept in *directories* (at most one)."""
        directory = directories.get(key)
        if directory is None:
            directory = self._open_dir(list(key))
            for fd in directories.values():
                os.close(fd)
            directories.clear()
            directories[key] = directory
        return directory

    def _write_sync(
        self,
        path: str,
        payload: Payload,
        overwrite: bool,
        directories: dict[tuple[str, ...], int] | None = None,
    ) -> WriteResult:
        *parents, name = check_relative(path).split("/")
        temp = temp_path_for(name, self._who)
        with translated(f"{self._root}/{path}"):
            if directories is None:
                directory = self._open_dir(parents)
            else:
                directory = self._directory(tuple(parents), directories)
            try:
                return self._write_in(directory, temp, path, payload, overwrite)
            finally:
                if directories is None:
                    os.close(directory)

    def _write_in(
        self, directory: int, temp: str, path: str, payload: Payload, overwrite: bool
    ) -> WriteResult:
        """Write *payload* to *temp* in *directory*, then publish it as *path*'s last part."""
        try:
            result = self._move_spool(directory, temp, payload) or self._write_temp(
                directory, temp, payload
            )
            self._publish(directory, temp, path, overwrite)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=directory)
            raise
        if self._fsync:
            os.fsync(directory)
        return result

    def _move_spool(self, directory: int, temp: str, payload: Payload) -> WriteResult | None:
        # A payload already serialized into a spool file on this filesystem moves by rename.
        move_to = getattr(payload, "move_to", None)
        if move_to is None or not move_to(temp, directory):
            return None
        os.chmod(temp, self._file_mode & ~_UMASK, dir_fd=directory)
        return WriteResult(size=payload.size, checksum=payload.checksum)  # type: ignore[attr-defined]

    def _write_temp(self, directory: int, temp: str, payload: Payload) -> WriteResult:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _NOFOLLOW
        fd = os.open(temp, flags, self._file_mode, dir_fd=directory)
        if isinstance(payload, BytesPayload):  # bytes already: written as they are, unbuffered
            try:
                write_all(functools.partial(os.write, fd), payload.data)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return payload.counted()
        with os.fdopen(fd, "wb", buffering=0) as handle:
            result = write_payload_unbuffered(payload, handle, _WRITE_BUFFER)
            if self._fsync:
                os.fsync(handle.fileno())
        return result

    def _publish(self, directory: int, temp: str, path: str, overwrite: bool) -> None:
        name = path.rpartition("/")[2]
        if overwrite:
            os.replace(temp, name, src_dir_fd=directory, dst_dir_fd=directory)
            return
        try:
            # atomic: fails if `name` exists (a symbolic link included: never followed)
            os.link(temp, name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
        except FileExistsError:
            raise exists_error(path) from None  # the full name: the error names the dump
        os.unlink(temp, dir_fd=directory)

    async def read(self, path: str) -> bytes:
        return await anyio.to_thread.run_sync(self._read_sync, path, 0, None)

    async def read_range(self, path: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        return await anyio.to_thread.run_sync(self._read_sync, path, offset, length)

    def _read_sync(self, path: str, offset: int, length: int | None) -> bytes:
        relative = check_relative(path)
        root = str(self._root)
        with translated(os.path.join(root, relative)):
            if self._real_root is None:
                self._real_root = os.path.realpath(root)
            # A link planted in a run never leads a reader out.
            target = resolve_inside(root, self._real_root, relative)
            # O_NONBLOCK: a FIFO planted since the listing is opened without waiting for a
            # writer, then refused (no effect on a regular file's reads).
            fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise StoragePermissionError(f"refusing to read {target}: not a regular file")
                if length is None:
                    with open(fd, "rb", buffering=0, closefd=False) as handle:
                        return handle.read()  # FileIO.readall: sized by fstat
                return os.pread(fd, length, offset)
            finally:
                os.close(fd)

    async def list(
        self, prefix: str = "", *, known_sizes: Mapping[str, int] | None = None
    ) -> list[FileInfo]:
        """The files below *prefix*, sorted by path (see :class:`Storage`).

        Args:
            prefix: A folder relative to the destination (``""``: all of it).
            known_sizes: Sizes the caller already has, by path (a reader: the record's). A
                regular file at one of these paths (not a link: the directory entry's type
                says so) is listed with that size and no modification time, without an
                ``lstat``: one system call less per file. Its real size is then unchecked;
                reading it tells.
        """
        return await anyio.to_thread.run_sync(self._list_sync, prefix, known_sizes)

    def _list_sync(
        self, prefix: str, known_sizes: Mapping[str, int] | None = None
    ) -> builtins.list[FileInfo]:
        top = self._resolve(prefix.strip("/")) if prefix.strip("/") else self._root
        if top != self._root and not self._inside(str(top)):
            # A prefix through a link leading out: listed, it would show files outside the
            # destination as if they were in it (reading them is refused the same way).
            raise StoragePermissionError(
                f"refusing to list {top}: it resolves outside the destination, through a "
                "symbolic link"
            )
        found: list[FileInfo] = []
        rel_top = os.path.relpath(top, self._root).replace(os.sep, "/")
        pending = [(str(top), "" if rel_top == "." else rel_top + "/")]
        with translated(str(top)):
            while pending:  # os.walk(followlinks=False), with one lstat per file, no more
                directory, rel_dir = pending.pop()
                _list_directory(directory, rel_dir, self._inside, found, pending, known_sizes)
        found.sort(key=_BY_PATH)
        return found

    def _inside(self, target: str) -> bool:
        """Whether *target* (a symbolic link found by the listing) resolves inside the root."""
        return is_inside(os.path.realpath(target), self._real_root or os.path.realpath(self._root))

    async def stat(self, path: str) -> FileInfo | None:
        return await anyio.to_thread.run_sync(self._stat_sync, path)

    def _stat_sync(self, path: str) -> FileInfo | None:
        try:
            st = os.stat(self._resolve(path), follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise translate(exc, path) from exc
        return FileInfo(path, st.st_size, st.st_mtime)

    async def delete(self, path: str) -> None:
        await anyio.to_thread.run_sync(self._delete_sync, path)

    def _delete_sync(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError), translated(path):
            os.unlink(self._resolve(path))

    async def aclose(self) -> None:
        pass  # nothing held between calls

    def __repr__(self) -> str:
        return f"LocalStorage({str(self._root)!r})"


_BY_PATH: Final = operator.attrgetter("path")


def _list_directory(
    directory: str,
    rel_dir: str,
    inside: Callable[[str], bool],
    found: list[FileInfo],
    pending: list[tuple[str, str]],
    known_sizes: Mapping[str, int] | None = None,
) -> None:
    """One directory of :meth:`LocalStorage.list`: its files into *found*, its
    subdirectories (never a linked one) into *pending*; a regular file of *known_sizes*
    without an ``lstat``."""
    try:
        entries = list(os.scandir(directory))
    except OSError:  # gone or unreadable meanwhile: skipped, as os.walk skips it
        return
    for entry in entries:
        try:
            is_dir = entry.is_dir()  # follows a link, as os.walk classifies entries
        except OSError:
            is_dir = False
        if is_dir:
            if not entry.is_symlink():  # a linked directory is never entered
                pending.append((entry.path, f"{rel_dir}{entry.name}/"))
            continue
        path = rel_dir + entry.name
        if known_sizes is not None:
            size = known_sizes.get(path)
            # is_file without following links: the entry's type (d_type), no system call
            if size is not None and entry.is_file(follow_symlinks=False):
                found.append(FileInfo(path, size))
                continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # a temporary file renamed away while we listed
        outside = special = False
        if stat.S_ISLNK(st.st_mode):
            outside = not inside(entry.path)
            special = not outside and _special_target(entry.path)
        else:
            special = not stat.S_ISREG(st.st_mode)
        found.append(FileInfo(path, st.st_size, st.st_mtime, outside, special))


def _special_target(link: str) -> bool:
    """Whether the link *link* (leading inside the root) ends at a FIFO, socket or device
    (``stat``, never ``open``: opening a FIFO blocks)."""
    try:
        return not stat.S_ISREG(os.stat(link).st_mode)
    except OSError:  # dangling, or a loop: reading it will say so
        return False
