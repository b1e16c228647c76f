"""Safe loading of dumps: one loader on the boundary, torch's decision, torch's public API only.

A dump directory is untrusted input: unpickling runs whatever code the pickle names. Dumps load
with PyTorch's restricted unpickler, which only builds tensors, containers, scalars and the
globals allow-listed for it, and nothing here touches torch's internals. trajtrack's own
allow-list (:func:`allowed_globals`: the rollout layer's :data:`trajtrack.rollout.SAFE_GLOBALS`
— ``RolloutSample``, ``RolloutBatch``, ``ValidateMetrics``, their rebuild functions and
stand-ins for the numpy types older dumps of them need — the stand-ins under verl's and
tensordict's names (:mod:`trajtrack.reader._standins`, whose
:func:`~trajtrack.reader._standins.finish` runs after each torch load), plus ``OrderedDict``
and ``Counter``) is never added to the caller's process-wide list behind its back. One
route, in this order:

1. The bytes of a torch archive go to the fast path (:mod:`trajtrack.reader._fast_load`): it
   builds what it can prove torch would build the same way — plain tensor data, and
   trajtrack's own records, which pickle as one call of an allow-listed rebuild over plain
   data — and declines everything else. Local files of up to 64 MiB are read and go this way.
2. ``torch.load(weights_only=True)`` with the process's own allow-list (torch's defaults and
   whatever the process added itself), after refusing an archive with a record marked as a
   directory (torch returns uninitialized memory for it).
3. If that refuses a global, the dump's pickle is scanned statically
   (``torch.serialization.get_unsafe_globals_in_checkpoint``; nothing is run). A global
   outside trajtrack's list: :class:`~trajtrack.UnsafeLoadError`, naming it.
4. Only trajtrack's list is missing (older rollout records with numpy arrays, a ``Counter``):
   the dump is loaded by trajtrack's worker process, which has that list
   (:mod:`trajtrack.reader._load_worker`). It stays because torch's allow-list is
   process-wide (``safe_globals()`` too, while entered, for every thread): there is no public
   way to widen it for one load only.

A process that may widen its own list (the ``trajtrack`` command) calls
:func:`allow_in_this_process` once; step 2 then loads everything in the process, in parallel
threads, with no lock. ``unsafe=True`` does a full unpickle, with a logged warning.
"""

from __future__ import annotations

import collections
import io
import logging
import os
import pickle
import re
import stat
import threading
import zipfile
from functools import lru_cache
from typing import Any, Final

import torch

from trajtrack._exceptions import DumpLoadError, UnsafeLoadError
from trajtrack.reader._fast_load import DECLINED, fast_load, only_default_globals
from trajtrack.reader._standins import finish

__all__ = [
    "allow_in_this_process",
    "allowed_globals",
    "check_loadable",
    "first_line",
    "load_dump_bytes",
    "load_dump_file",
    "refused_globals",
    "restricted_load",
    "sparse_checks_enabled",
]

logger = logging.getLogger(__name__)

_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL\s+([\w.]+)")
# torch validates loaded sparse tensors (when check_sparse_tensor_invariants is on) from one
# process-wide list that every load empties when it ends: such loads must not overlap.
_SPARSE_CHECK_LOCK = threading.Lock()

# What opening a file raises; torch raises other OSErrors (EINVAL...) on a truncated archive.
_CANNOT_OPEN = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


@lru_cache(maxsize=1)
def allowed_globals() -> tuple[Any, ...]:
    """The globals trajtrack allow-lists on top of PyTorch's own weights-only set."""
    extra: list[Any] = [collections.OrderedDict, collections.Counter]
    # verl's DataProto and RolloutSample, tensordict's reductions, numpy's reconstructors:
    # trajtrack's stand-ins under those names, which read them as data (finish() after a load).
    from trajtrack.reader._standins import STANDIN_GLOBALS

    try:
        from trajtrack.rollout import SAFE_GLOBALS
    except ImportError:  # pragma: no cover - the rollout layer ships with trajtrack
        logger.debug("trajtrack.rollout is not importable; loading without its allow-list")
        return (*STANDIN_GLOBALS, *extra)
    return tuple(dict.fromkeys((*SAFE_GLOBALS, *STANDIN_GLOBALS, *extra)))


@lru_cache(maxsize=1)
def _allowed_names() -> frozenset[str]:
    return frozenset(_name(g) for g in allowed_globals())


def allow_in_this_process() -> None:
    """Add trajtrack's allow-list to torch's process-wide one, for a process you own.

    Afterwards every ``torch.load(weights_only=True)`` in this process — trajtrack's and any
    other — accepts trajtrack's rollout records and the numpy types they need, and trajtrack
    loads them in the process (in parallel threads) instead of in its load worker. The
    ``trajtrack`` command calls it when it starts. Calling it again changes nothing.

    It survives ``torch.serialization.safe_globals(...)`` blocks entered and left afterwards,
    even with the same globals (``safe_globals(list(SAFE_GLOBALS))``): such a block removes
    on exit the entries it added, which compare equal to their own values, never to the
    entries added here (:class:`_ProcessEntry`).
    """
    torch.serialization.add_safe_globals(list(_process_entries()))


class _ProcessEntry(tuple[Any, str]):
    """A ``(global, "module.Name")`` allow-list pair equal only to itself.

    torch keeps its allow-list as a set and ``safe_globals`` removes what it added by equality;
    a plain entry for the same global would be equal to trajtrack's and removed with it.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    def __hash__(self) -> int:
        return id(self)


@lru_cache(maxsize=1)
def _process_entries() -> tuple[_ProcessEntry, ...]:
    return tuple(_ProcessEntry((_target(g), _name(g))) for g in allowed_globals())


def load_dump_bytes(data: bytes, *, unsafe: bool = False, where: str = "dump") -> Any:
    """Deserialize the bytes of one dump (blocking, thread-safe; call it in a worker thread).

    Args:
        data: The stored file's bytes (``torch.save`` format, or a plain pickle).
        unsafe: Unpickle anything, running whatever code the dump names. Only for dumps you
            trust; a warning is logged.
        where: The dump's name or URL, for messages.

    Returns:
        The object, with tensors on the CPU.

    Raises:
        UnsafeLoadError: The dump references a global outside the allow-list (and *unsafe*
            is false); the message names it.
        DumpLoadError: The bytes are not a loadable dump (corrupt, truncated, not torch).
    """
    if unsafe:
        return _unsafe_load(data, where)
    return _safe_load(data, where)


def load_dump_file(
    path: str | os.PathLike[str], *, unsafe: bool = False, where: str | None = None
) -> Any:
    """Deserialize one dump file from the local filesystem, as :func:`load_dump_bytes` does.

    A file of up to 64 MiB is read and loaded from its bytes (as :func:`load_dump_bytes`),
    a bigger one is read by torch itself.

    Args:
        path: The file.
        unsafe: As for :func:`load_dump_bytes`.
        where: The dump's name, for messages (default: the path).

    Returns:
        The object, with tensors on the CPU.

    Raises:
        UnsafeLoadError: As :func:`load_dump_bytes`.
        DumpLoadError: As :func:`load_dump_bytes`.
        FileNotFoundError: No such file (``PermissionError``, ``IsADirectoryError``... for the
            other reasons a file cannot be opened).
    """
    name = os.fspath(path)
    where = where or name
    if unsafe:
        return _unsafe_load(name, where)
    data = _small_file(name)  # read here: the fast path takes bytes
    return _safe_load(name if data is None else data, where)


_READ_WHOLE: Final = 64 << 20
"""Dumps up to this size are read into memory and loaded from their bytes (the fast path's
input); bigger ones, and what is not a regular file, are opened by torch itself."""


def _small_file(name: str) -> bytes | None:
    """The bytes of regular file *name* if it has at most :data:`_READ_WHOLE` of them."""
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO: no wait here
    with open(fd, "rb", closefd=True) as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _READ_WHOLE:
            return None
        data = file.read(_READ_WHOLE + 1)
    return data if len(data) <= _READ_WHOLE else None


def check_loadable(
    source: bytes | str | os.PathLike[str], *, unsafe: bool = False, where: str = "dump"
) -> None:
    """Refuse a dump that :func:`load_dump_bytes` would refuse as unsafe, loading nothing.

    For a ``torch.save`` zip (its bytes, or a local file), the globals its pickle names are
    scanned statically (nothing is run): bytes whose names are all of the fast loader's table
    pass at once (:func:`~trajtrack.reader._fast_load.only_default_globals`); otherwise torch's
    static check decides, against PyTorch's weights-only set, the process's own additions and
    trajtrack's allow-list. Other formats are loaded. Damage inside an archive (a truncated
    tensor) is not looked for: ``verify`` checks the bytes against the record. ``diff`` uses it
    for byte-identical pairs, which need no comparison.

    Raises:
        UnsafeLoadError: As :func:`load_dump_bytes`.
        DumpLoadError: Not a zip checkpoint, and not loadable either.
    """
    if unsafe:
        return
    if isinstance(source, bytes) and only_default_globals(source):
        return  # torch's default allow-list has every global it names
    loadable = source if isinstance(source, bytes) else os.fspath(source)
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(_file(loadable))
    except Exception:  # not a zip checkpoint: let the real loader decide
        _safe_load(loadable, where)
        return
    offending = sorted(name for name in found if name not in _allowed_names())
    if offending:
        raise UnsafeLoadError(_refusal(where, offending))


def refused_globals(source: Any, message: str) -> list[str]:
    """The globals a refused dump needs beyond this process's allow-list (nothing is run).

    Args:
        source: A path or a binary file positioned at the dump's start.
        message: torch's refusal, which names the first global it refused.
    """
    try:
        found = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # not a zip checkpoint (a plain pickle): rely on torch's message
        found = []
    match = _GLOBAL_IN_MESSAGE.search(message)
    if match and match.group(1) not in found:
        found.insert(0, match.group(1))
    return found


def first_line(exc: BaseException) -> str:
    """``TypeName: first line of the message``, for error messages.

    torch's weights-only refusals open with paragraphs of advice, one of them to re-run
    ``torch.load`` with ``weights_only=False`` (which runs whatever code the file names: the
    load this module exists to refuse), and bury the cause (``Unsupported operand 103``, the
    global refused) further down. Those paragraphs are dropped: the line kept is the cause.
    """
    lines = [_cause_in(line) for line in str(exc).strip().splitlines()]
    kept = [line for line in lines if line and not line.startswith(_TORCH_ADVICE)]
    text = kept[0] if kept else ""
    if "weights_only" in text:  # advice of a torch version not foreseen: never passed on
        text = "refused by torch's weights-only unpickler"
    return f"{type(exc).__name__}: {text}".rstrip(": ")


_TORCH_ADVICE: Final = (
    "Weights only load failed",
    "In PyTorch 2.6",
    "Re-running `torch.load`",
    "Please file an issue",
    "Check the documentation of torch.load",
)
"""How the paragraphs of torch's weights-only refusal that are advice, not its cause, start."""

_UNPICKLER_ERROR: Final = "WeightsUnpickler error:"


def _cause_in(line: str) -> str:
    """*line* stripped; from torch's ``... WeightsUnpickler error: CAUSE``, the cause."""
    before, found, after = line.partition(_UNPICKLER_ERROR)
    return after.strip() if found else before.strip()


_NOT_A_DUMP: Final = " (not what torch.save writes: damaged, truncated, or another format)"


def _safe_load(source: bytes | str, where: str) -> Any:
    try:
        return restricted_load(source)
    except pickle.UnpicklingError as exc:
        refusal = exc
    except _CANNOT_OPEN:
        raise  # the file could not be opened: the caller's error, not the dump's
    except (UnsafeLoadError, DumpLoadError) as exc:  # a stand-in refused its data (finish)
        raise type(exc)(f"{where}: {exc}") from exc
    except Exception as exc:  # RuntimeError, EOFError, OSError(EINVAL)... on bad bytes
        raise DumpLoadError(f"{where}: cannot be loaded: {first_line(exc)}") from exc
    needed = refused_globals(_file(source), str(refusal))
    offending = [name for name in needed if name not in _allowed_names()]
    if offending:
        raise UnsafeLoadError(_refusal(where, offending)) from refusal
    if not needed:  # no global refused: the bytes are not a pickle torch can read
        raise DumpLoadError(
            f"{where}: cannot be loaded: {first_line(refusal)}{_NOT_A_DUMP}"
        ) from refusal
    return _load_in_worker(source, where, needed)


def restricted_load(source: Any) -> Any:
    """``torch.load(source, weights_only=True)`` onto the CPU, with the process's allow-list.

    *source* is bytes, a path or a binary file. Bytes go first to
    :func:`~trajtrack.reader._fast_load.fast_load`, which loads what it proves torch would
    load the same way (plain tensor data, and trajtrack's records as if trajtrack's
    allow-list were added); what it declines goes to torch, unless a record of the archive is
    marked as a directory (refused: :class:`DumpLoadError`). While torch checks sparse
    tensors as it loads them, loads run one at a time: torch validates them at the end of a
    load from one process-wide list, which every load empties, and which a load that fails
    half-way leaves filled (the next load would validate, and blame, the failed dump's
    tensors).
    """
    if isinstance(source, bytes):
        loaded = fast_load(source)  # without torch.load's pure-Python unpickler
        if loaded is not DECLINED:
            return loaded
    _refuse_unsafe_records(source)
    file = _file(source) if isinstance(source, bytes) else source
    if not sparse_checks_enabled():
        return finish(torch.load(file, map_location="cpu", weights_only=True, mmap=False))
    with _SPARSE_CHECK_LOCK:
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=False)
        except BaseException:
            _empty_sparse_validation_list()
            raise
    return finish(loaded)


def _refuse_unsafe_records(source: Any) -> None:
    """Refuse a zip archive with a record marked as a directory, or a compressed record.

    torch's zip reader (miniz) takes a record marked as a directory (name or DOS attribute) for
    a directory and extracts nothing into the buffer it allocated for it: ``torch.load``
    returns a tensor of uninitialized memory (what the process freed before). A compressed
    record is inflated by torch in the loading process, to whatever size it inflates to (a
    megabyte can hold a gigabyte of zeros); ``torch.save`` never compresses a record, so one
    that is compressed was not written by it. Such archives never reach torch. Not a zip
    archive: torch decides (its legacy format, or its own error).

    Raises:
        DumpLoadError: A record is marked as a directory, or compressed.
    """
    if not isinstance(source, (bytes, str)):
        return  # a file object: the worker's reply, which torch.save wrote
    try:
        with zipfile.ZipFile(_file(source)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return
    if any("/code/__torch__/" in entry.filename for entry in entries):
        raise DumpLoadError(  # torch.jit.save compresses its code records: say what it is
            "cannot be loaded: a TorchScript archive (torch.jit.save), not a torch.save dump; "
            "torch.jit.load runs its code: only for a file you trust"
        )
    for entry in entries:
        if entry.filename.endswith("/") or entry.external_attr & _DOS_DIRECTORY:
            raise DumpLoadError(
                f"cannot be loaded: its record {entry.filename!r} is marked as a directory "
                "(torch would return uninitialized memory for it)"
            )
        if entry.compress_type != zipfile.ZIP_STORED:
            raise DumpLoadError(
                f"cannot be loaded: its record {entry.filename!r} is compressed (torch.save "
                "never compresses; inflating it would cost this process its inflated size)"
            )


_DOS_DIRECTORY: Final = 0x10


def _empty_sparse_validation_list() -> None:
    # A successful load ends by validating and emptying torch's list: load an empty archive.
    try:
        torch.load(io.BytesIO(_empty_archive()), weights_only=True)
    except Exception:  # a stale invalid tensor is reported here, and dropped
        logger.debug("dropped sparse tensors left by a failed load", exc_info=True)


@lru_cache(maxsize=1)
def _empty_archive() -> bytes:
    buffer = io.BytesIO()
    torch.save(None, buffer)
    return buffer.getvalue()


def sparse_checks_enabled() -> bool:
    """Whether torch validates sparse tensors as it loads them (sparse invariant checks)."""
    checks: Any = torch.sparse.check_sparse_tensor_invariants  # untyped in torch's stubs
    return bool(checks.is_enabled())


def _load_in_worker(source: bytes | str, where: str, needed: list[str]) -> Any:
    """A dump that needs trajtrack's allow-list and nothing else, loaded by the load worker."""
    from trajtrack.reader import _load_worker

    try:
        if isinstance(source, bytes):
            reply = _load_worker.request_load(data=source)
        else:
            reply = _load_worker.request_load(path=source)
    except _load_worker.MainModuleError as exc:
        raise UnsafeLoadError(
            f"{where}: it needs trajtrack's allow-list ({', '.join(needed)}), which trajtrack "
            "adds to its own load worker's process, never to yours; but a new process would "
            f"re-run this program: {exc}. Call trajtrack.reader.allow_in_this_process() first "
            "to load such dumps here (it widens torch.load(weights_only=True) in this process "
            "for trajtrack's types), or move the script's code under "
            "`if __name__ == '__main__':`"
        ) from None
    except Exception as exc:  # the worker died, or sent what torch's defaults refuse
        raise DumpLoadError(f"{where}: cannot be loaded: {first_line(exc)}") from exc
    if reply.status == "ok":
        return reply.obj
    if reply.status == "refused" and reply.offending:
        raise UnsafeLoadError(_refusal(where, list(reply.offending)))
    raise DumpLoadError(f"{where}: cannot be loaded: {reply.message}")


def _unsafe_load(source: bytes | str, where: str) -> Any:
    logger.warning("loading %s with a full unpickle (unsafe=True): it can run code", where)
    try:
        return torch.load(_file(source), map_location="cpu", weights_only=False, mmap=False)
    except _CANNOT_OPEN:
        raise
    except pickle.UnpicklingError:
        raise DumpLoadError(f"{where}: cannot be unpickled") from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, KeyError... on bad bytes
        raise DumpLoadError(f"{where}: cannot be loaded: {first_line(exc)}") from exc


def _refusal(where: str, offending: list[str]) -> str:
    process_wide = {_name(g) for g in torch.serialization.get_safe_globals()}
    text = (
        f"{where}: refusing to load: it references {', '.join(offending)}, which is not "
        "on trajtrack's allow-list (a pickle can run arbitrary code); load it with "
        "unsafe=True / --unsafe only if you trust its source"
    )
    advice = []
    if any(name in process_wide for name in offending):
        advice.append(
            "this process allows some of them, but a dump that also needs trajtrack's "
            "allow-list is loaded by trajtrack's worker with that list only; call "
            "trajtrack.reader.allow_in_this_process() to load it in this process"
        )
    return "; ".join([text, *advice])


def _file(source: bytes | str) -> Any:
    return io.BytesIO(source) if isinstance(source, bytes) else source


def _target(value: Any) -> Any:
    return value[0] if isinstance(value, tuple) else value


def _name(value: Any) -> str:
    if isinstance(value, tuple):  # (global, "module.name"), as add_safe_globals accepts
        return str(value[1])
    return f"{value.__module__}.{getattr(value, '__qualname__', '')}"
