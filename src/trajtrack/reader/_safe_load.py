"""Safe loading of dumps: ``torch.load(weights_only=True)`` with trajtrack's allow-list.

A dump directory is untrusted input: unpickling runs whatever code the pickle names. By default
dumps load with PyTorch's restricted unpickler, which only builds tensors, containers, scalars
and the globals allow-listed here (the rollout layer's :data:`trajtrack.rollout.SAFE_GLOBALS`:
``RolloutSample``, ``RolloutBatch``, ``ValidateMetrics`` and the numpy reconstructors they
need). A dump that needs anything else raises :class:`~trajtrack.UnsafeLoadError` naming the
offending global; ``unsafe=True`` does a full unpickle, with a logged warning.
"""

from __future__ import annotations

import collections
import io
import logging
import pickle
import re
import threading
from functools import lru_cache
from typing import Any

import torch

from trajtrack._exceptions import DumpLoadError, UnsafeLoadError
from trajtrack.reader._weights_only import RestrictedLoader, restricted_loader

__all__ = ["allowed_globals", "check_loadable", "load_dump_bytes"]

logger = logging.getLogger(__name__)

_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL\s+([\w.]+)")
_SAFE_LOAD_LOCK = threading.Lock()


@lru_cache(maxsize=1)
def allowed_globals() -> tuple[Any, ...]:
    """The globals trajtrack allow-lists on top of PyTorch's own weights-only set."""
    extra: list[Any] = [collections.OrderedDict, collections.Counter]
    try:
        from trajtrack.rollout import SAFE_GLOBALS
    except ImportError:  # pragma: no cover - the rollout layer ships with trajtrack
        logger.debug("trajtrack.rollout is not importable; loading without its allow-list")
        return tuple(extra)
    return (*SAFE_GLOBALS, *extra)


def load_dump_bytes(
    data: bytes, *, unsafe: bool = False, where: str = "dump", share_memory: bool = False
) -> Any:
    """Deserialize the bytes of one dump (blocking, thread-safe; call it in a worker thread).

    Args:
        data: The stored file's bytes (``torch.save`` format, or a plain pickle).
        unsafe: Unpickle anything, running whatever code the dump names. Only for dumps you
            trust; a warning is logged.
        where: The dump's name or URL, for messages.
        share_memory: Tensors may use *data*'s memory instead of copies: faster, but they
            must be treated as read-only and not kept beyond *data* (``diff`` uses it for
            objects it only compares). Safe loads only.

    Returns:
        The object, with tensors on the CPU.

    Raises:
        UnsafeLoadError: The dump references a global outside the allow-list (and *unsafe*
            is false); the message names it.
        DumpLoadError: The bytes are not a loadable dump (corrupt, truncated, not torch).
    """
    if unsafe:
        logger.warning("loading %s with a full unpickle (unsafe=True): it can run code", where)
        return _load(data, where, weights_only=False)
    try:
        loader = restricted_loader(allowed_globals())
        if loader is not None:  # torch's unpickler with our allow-list: no shared state
            return _restricted_load(loader, data, where, share_memory)
        # Fallback for a torch without the internals the loader uses. safe_globals() swaps a
        # process-wide list on enter and restores it on exit, so two threads inside it at
        # once corrupt each other's allow-list: one load at a time. (add_safe_globals() would
        # avoid the lock but widen torch.load for the whole process.)
        with _SAFE_LOAD_LOCK, torch.serialization.safe_globals(list(allowed_globals())):
            return _load(data, where, weights_only=True)
    except pickle.UnpicklingError as exc:
        offending = _offending_globals(data, str(exc))
        if offending:
            raise UnsafeLoadError(_refusal(where, offending)) from exc
        raise DumpLoadError(f"{where}: cannot be loaded: {_first_line(exc)}") from exc


def check_loadable(data: bytes, *, unsafe: bool = False, where: str = "dump") -> None:
    """Refuse what :func:`load_dump_bytes` would refuse, without loading the tensors.

    For a ``torch.save`` zip, the pickle's globals are scanned statically (nothing is run)
    against PyTorch's weights-only set and trajtrack's allow-list; other formats are loaded.
    ``diff`` uses it for byte-identical pairs, which need no comparison.

    Raises:
        UnsafeLoadError: As :func:`load_dump_bytes`.
        DumpLoadError: Not a zip checkpoint, and not loadable either.
    """
    if unsafe:
        return
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # not a zip checkpoint: let the real loader decide
        load_dump_bytes(data, unsafe=False, where=where)
        return
    allowed = {f"{g.__module__}.{getattr(g, '__qualname__', '')}" for g in allowed_globals()}
    offending = [name for name in found if name not in allowed]
    if offending:
        raise UnsafeLoadError(_refusal(where, offending))


def _refusal(where: str, offending: list[str]) -> str:
    return (
        f"{where}: refusing to load: it references {', '.join(offending)}, which is not "
        "on trajtrack's allow-list (a pickle can run arbitrary code); load it with "
        "unsafe=True / --unsafe only if you trust its source"
    )


def _restricted_load(loader: RestrictedLoader, data: bytes, where: str, share: bool) -> Any:
    try:
        return loader.load(data, share_memory=share)
    except (pickle.UnpicklingError, DumpLoadError):
        raise  # the caller tells a refused global from corruption
    except Exception as exc:  # torch raises RuntimeError, EOFError, KeyError... on bad bytes
        raise DumpLoadError(f"{where}: cannot be loaded: {_first_line(exc)}") from exc


def _load(data: bytes, where: str, *, weights_only: bool) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError:
        if weights_only:
            raise  # the caller tells a refused global from corruption
        raise DumpLoadError(f"{where}: cannot be unpickled") from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, KeyError... on bad bytes
        raise DumpLoadError(f"{where}: cannot be loaded: {_first_line(exc)}") from exc


def _offending_globals(data: bytes, message: str) -> list[str]:
    """The globals a refused dump needs, found by scanning it (nothing is executed)."""
    names: list[str] = []
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # not a zip checkpoint (plain pickle): rely on torch's message
        found = []
    allowed = {f"{g.__module__}.{getattr(g, '__qualname__', '')}" for g in allowed_globals()}
    names.extend(name for name in found if name not in allowed)
    match = _GLOBAL_IN_MESSAGE.search(message)
    if match and match.group(1) not in names:
        names.insert(0, match.group(1))
    return names


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
