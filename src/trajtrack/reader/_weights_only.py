"""PyTorch's weights-only unpickler with trajtrack's allow-list, without process-wide state.

``torch.load(weights_only=True)`` consults torch's default allow-list plus a process-wide set
that ``torch.serialization.safe_globals`` / ``add_safe_globals`` mutate
(``torch._weights_only_unpickler._marked_safe_globals_set``). Using that set for trajtrack's
allow-list would either widen ``torch.load`` for the whole process or, entered per load, make
loads in different threads corrupt each other's set (hence a lock, serializing every load).

Here the allow-list belongs to the loader instead. :class:`RestrictedLoader` runs *torch's own*
unpickling code (``_weights_only_unpickler.Unpickler.load``, the same bytecode, so every check
and fix of the installed torch applies) with its two allow-list lookups,
``_get_allowed_globals`` and ``_get_user_allowed_globals``, bound to the loader's dictionaries;
the archive is read by ``torch.serialization._load`` / ``_legacy_load``, which is what
``torch.load(weights_only=True)`` calls. What is accepted is exactly what ``torch.load`` with
``safe_globals(trajtrack's list)`` accepts: torch's defaults, plus the process-wide set as it is
at the time, plus trajtrack's list. Nothing process-wide is modified, and loads run in parallel.

One piece of torch state is still shared: sparse tensors are validated after unpickling from a
process-wide list (``torch._utils._sparse_tensors_to_validate``) that every load clears at its
end. So loads run first with an allow-list *without* the sparse-tensor builders, concurrently
(a shared lock); a dump refused that way is loaded again with the full allow-list, alone (an
exclusive lock), which is also where a refusal gets its final answer.

:func:`restricted_loader` returns ``None`` when the installed torch does not have the internals
this relies on; callers then fall back to ``torch.load`` under ``safe_globals`` and a lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import pickle
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch._weights_only_unpickler as _wou

__all__ = ["RestrictedLoader", "restricted_loader"]

logger = logging.getLogger(__name__)

# torch.serialization.add_safe_globals() / safe_globals(), as torch's unpickler reads them.
_process_wide_globals: Callable[[], dict[str, Any]] = _wou._get_user_allowed_globals

_TORCHSCRIPT_REFUSAL = (
    "Cannot use ``weights_only=True`` with TorchScript archives passed to ``torch.load``."
)


class RestrictedLoader:
    """Loads ``torch.save`` bytes with torch's weights-only unpickler and a given allow-list.

    Args:
        extra_globals: Globals allowed on top of torch's defaults and the process-wide set.
    """

    def __init__(self, extra_globals: tuple[Any, ...]) -> None:
        extra = {_full_name(g): g for g in extra_globals}
        defaults: dict[str, Any] = _wou._get_allowed_globals()
        self._concurrent = _pickle_module(
            {k: v for k, v in defaults.items() if not _builds_sparse(v)},
            {k: v for k, v in extra.items() if not _builds_sparse(v)},
            drop_sparse=True,
        )
        self._alone = _pickle_module(defaults, extra, drop_sparse=False)
        self._lock = _SharedExclusiveLock()

    def load(self, data: bytes, *, share_memory: bool = False) -> Any:
        """Unpickle *data* (blocking; thread-safe).

        Args:
            data: A ``torch.save`` archive (or a legacy-format file).
            share_memory: Let the tensors use *data*'s memory instead of copies (no copy, no
                new pages). They must then be treated as read-only, and must not outlive the
                caller's use of *data*. Applies to zip archives in native byte order.

        Raises:
            pickle.UnpicklingError: The dump needs something outside the allow-list.
            RuntimeError: A TorchScript archive (refused, as ``torch.load`` refuses it).
            Exception: Whatever torch raises for bytes that are not a loadable dump.
        """
        self._lock.acquire_shared()
        try:
            return _load(data, self._concurrent, share_memory)
        except pickle.UnpicklingError:
            pass  # a sparse tensor (or a refused global): again with everything, alone
        finally:
            self._lock.release_shared()
        with self._lock.exclusive():
            return _load(data, self._alone, share_memory)


@lru_cache(maxsize=4)
def restricted_loader(extra_globals: tuple[Any, ...]) -> RestrictedLoader | None:
    """The loader for an allow-list, or ``None`` when this torch lacks the internals it uses."""
    names = set(_wou.Unpickler.load.__code__.co_names)
    needed = {"_get_allowed_globals", "_get_user_allowed_globals"}
    helpers = (
        "_load",
        "_legacy_load",
        "_open_zipfile_reader",
        "_is_zipfile",
        "_is_torchscript_zip",
    )
    if not needed <= names or not all(hasattr(torch.serialization, h) for h in helpers):
        logger.debug("torch %s: no per-loader allow-list; loads take a lock", torch.__version__)
        return None
    return RestrictedLoader(extra_globals)


def _pickle_module(
    defaults: Mapping[str, Any], extra: Mapping[str, Any], *, drop_sparse: bool
) -> types.SimpleNamespace:
    """A ``pickle_module`` for ``torch.serialization._load`` whose unpickler sees our lists."""
    default_globals = dict(defaults)
    extra_globals = dict(extra)

    def allowed_globals() -> dict[str, Any]:
        return default_globals

    def user_allowed_globals() -> dict[str, Any]:
        process_wide = _process_wide_globals()  # read, never written
        if drop_sparse:
            process_wide = {k: v for k, v in process_wide.items() if not _builds_sparse(v)}
        return {**extra_globals, **process_wide} if process_wide else extra_globals

    # torch's Unpickler.load, the same code object, resolving its globals in a namespace where
    # the two allow-list lookups are ours (everything else is the torch module's own).
    namespace = dict(vars(_wou))
    namespace["_get_allowed_globals"] = allowed_globals
    namespace["_get_user_allowed_globals"] = user_allowed_globals
    torch_load = _wou.Unpickler.load
    restricted_load: Callable[[Any], Any] = types.FunctionType(
        torch_load.__code__, namespace, torch_load.__name__, torch_load.__defaults__
    )
    unpickler = type("Unpickler", (_wou.Unpickler,), {"load": restricted_load})

    def load(file: Any, *, encoding: str = "ASCII") -> Any:
        return unpickler(file, encoding=encoding).load()

    return types.SimpleNamespace(
        __name__=f"{__name__}.pickle_module", Unpickler=unpickler, load=load
    )


def _load(data: bytes, module: types.SimpleNamespace, share_memory: bool) -> Any:
    # What torch.load(BytesIO(data), map_location="cpu", weights_only=True) does, with our
    # pickle module: a zip archive (TorchScript refused), else the legacy format.
    serialization: Any = torch.serialization
    buffer = io.BytesIO(data)
    if not serialization._is_zipfile(buffer):
        return serialization._legacy_load(buffer, "cpu", module, encoding="utf-8")
    with serialization._open_zipfile_reader(buffer) as archive:
        if serialization._is_torchscript_zip(archive):
            raise RuntimeError(_TORCHSCRIPT_REFUSAL)
        share = share_memory and type(data) is bytes and _native_order(archive)
        shared = _storage_of(data) if share else None
        return serialization._load(archive, "cpu", module, overall_storage=shared, encoding="utf-8")


def _native_order(archive: Any) -> bool:
    # A byte-swapped archive is swapped in place after reading: never in shared memory.
    return bool(
        archive.has_record("byteorder")
        and archive.get_record("byteorder") == sys.byteorder.encode()
    )


def _storage_of(data: bytes) -> torch.UntypedStorage:
    """An untyped storage over *data*'s own memory (kept alive by the storage)."""
    # torch.frombuffer wants a writable buffer (it warns otherwise), so the memory is exposed
    # through a writable array interface at the bytes' address. Nothing writes to it: the
    # loader only slices it into tensors (what torch.load(mmap=True) does with a file
    # mapping), byte-swapped archives are excluded above, and the caller treats the tensors
    # as read-only.
    return torch.from_numpy(np.asarray(_Memory(data))).untyped_storage()


class _Memory:
    """The memory of a bytes object as a numpy array interface; the array keeps it alive."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, data: bytes) -> None:
        self.owner = data
        address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (len(data),),
            "typestr": "|u1",
            "version": 3,
        }


def _builds_sparse(value: Any) -> bool:
    """Whether the unpickler registers what *value* builds for sparse validation."""
    if value is torch._utils._rebuild_sparse_tensor:
        return True
    try:
        return value in torch._tensor_classes and "sparse" in value.__module__
    except TypeError:  # unhashable
        return False


def _full_name(value: Any) -> str:
    if isinstance(value, tuple):  # (global, "module.name"), as safe_globals accepts
        return str(value[1])
    return f"{value.__module__}.{value.__qualname__}"


class _SharedExclusiveLock:
    """Many holders in shared mode, or one in exclusive mode; exclusive waiters go first."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if not self._shared and self._waiting:
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
