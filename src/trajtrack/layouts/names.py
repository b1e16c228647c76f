"""Dump names: validation, the distributed name template, and trajtrack's reserved paths.

A dump name is a relative, ``/``-separated path such as ``"step3/rank0_obs"``; the stored file is
``<destination>/<name><suffix>`` (``.pth`` by default, the original tracker's layout). Names are
checked before anything is queued, so a bad name can never write outside the destination.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import socket
import string
from dataclasses import dataclass
from functools import lru_cache

from trajtrack._exceptions import ConfigurationError, InvalidNameError

__all__ = [
    "RECORDS_DIR",
    "WriterIdentity",
    "is_internal_path",
    "parse_temp_path",
    "plainly_valid",
    "plainly_valid_all",
    "render_name",
    "temp_path_for",
    "validate_name",
]

#: Hidden folder (below the destination) that holds the record of what was written.
RECORDS_DIR = ".trajtrack"
_TEMP_MARK = ".tmp~"
MAX_COMPONENT_BYTES = 255  # HDFS's default dfs.namenode.fs-limits.max-component-length
MAX_NAME_BYTES = 4096
TEMPLATE_FIELDS = frozenset({"name", "rank", "local_rank", "world_size", "pid", "host"})


def validate_name(name: object, *, new: bool = False) -> str:
    """Return *name* if it is a safe relative dump name, else raise :class:`InvalidNameError`.

    Rejected: non-strings, empty names, absolute paths, backslashes, empty, ``.`` or ``..``
    segments, NUL and other control characters, segments starting with ``.`` (reserved for
    trajtrack's temporary files and records), segments over 255 bytes, names over 4096 bytes.
    With *new* (a name about to be written), also a name that is not valid Unicode text (a
    lone surrogate): no storage can store it, and a reader lists what an operating system
    gives, undecodable bytes included, which is why only writers ask.
    """
    # Checked before the cache: an unhashable name (a list) must not escape as a TypeError.
    # A str subclass (numpy.str_) is validated and returned as the plain str it holds.
    if not isinstance(name, str):
        raise InvalidNameError(f"dump name must be a str, not {type(name).__name__}")
    name = str.__str__(name)
    # The common case in one C call: a short ASCII name that breaks no rule. Every other name
    # takes the full check (which also words the error).
    if plainly_valid(name):
        return name
    return _validate_str(name, new)


def plainly_valid(name: str) -> bool:
    """Whether *name* (a plain ``str``) is valid by :func:`validate_name`'s common case: a
    short ASCII name that breaks no rule. ``False`` says nothing: :func:`validate_name` it."""
    return len(name) <= MAX_COMPONENT_BYTES and name.isascii() and _PLAINLY_SAFE(name) is not None


def plainly_valid_all(names: list[str]) -> bool:
    """:func:`plainly_valid` of every one of *names* (plain ``str``), by C calls over the
    list (no Python code per name). ``False`` says nothing about any one name."""
    return not names or (
        max(map(len, names)) <= MAX_COMPONENT_BYTES
        and all(map(str.isascii, names))
        and all(map(_PLAINLY_SAFE, names))
    )


_SEGMENT = r"[^./\\\x00-\x1f\x7f][^/\\\x00-\x1f\x7f]*"
_PLAINLY_SAFE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*").fullmatch
"""Non-empty segments that do not start with ``.``, no backslash, no control character."""


@lru_cache(maxsize=4096)
def _validate_str(name: str, new: bool) -> str:
    if not name:
        raise InvalidNameError("dump name must not be empty")
    if new and not _is_text(name):
        raise InvalidNameError(
            f"dump name {name!r} is not valid Unicode text (it holds a lone surrogate)"
        )
    encoded = name.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_NAME_BYTES:
        raise InvalidNameError(f"dump name is {len(encoded)} bytes long; the limit is 4096")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        raise InvalidNameError(f"dump name {name!r} contains a NUL or control character")
    if name.startswith("/"):
        raise InvalidNameError(f"dump name {name!r} is absolute; use a relative path")
    if "\\" in name:
        raise InvalidNameError(f"dump name {name!r} contains a backslash; use '/' between parts")
    for part in name.split("/"):
        _check_component(name, part)
    return name


def _is_text(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_component(name: str, part: str) -> None:
    if part == "":
        raise InvalidNameError(f"dump name {name!r} has an empty path segment")
    if part in (".", ".."):
        raise InvalidNameError(f"dump name {name!r} contains a {part!r} segment")
    if part.startswith("."):
        raise InvalidNameError(
            f"dump name {name!r}: segments starting with '.' are reserved for trajtrack"
        )
    if len(part.encode("utf-8", "surrogatepass")) > MAX_COMPONENT_BYTES:
        raise InvalidNameError(f"dump name {name!r} has a segment longer than 255 bytes")


@dataclass(frozen=True, slots=True)
class WriterIdentity:
    """Who writes: the values a name template and the record can use."""

    host: str
    pid: int
    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def current(cls) -> WriterIdentity:
        """The identity of this process, ranks from torchrun-style environment variables."""
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            rank=_env_int("RANK", 0),
            local_rank=_env_int("LOCAL_RANK", 0),
            world_size=_env_int("WORLD_SIZE", 1),
        )


def _env_int(var: str, default: int) -> int:
    raw = os.environ.get(var, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        return default


def check_template(template: str) -> str:
    """Validate a name template: only known ``{fields}`` and a ``{name}`` somewhere."""
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ConfigurationError(f"bad name template {template!r}: {exc}") from exc
    unknown = fields - TEMPLATE_FIELDS
    if unknown:
        raise ConfigurationError(
            f"name template {template!r} uses unknown fields {sorted(unknown)}; "
            f"known: {sorted(TEMPLATE_FIELDS)}"
        )
    if "name" not in fields:
        raise ConfigurationError(f"name template {template!r} must contain {{name}}")
    return template


def render_name(template: str, name: str, who: WriterIdentity) -> str:
    """Apply the name template; the result is validated as a whole."""
    validate_name(name)
    if template == "{name}":
        return name
    return validate_name(
        template.format(
            name=name,
            rank=who.rank,
            local_rank=who.local_rank,
            world_size=who.world_size,
            pid=who.pid,
            host=who.host,
        )
    )


def temp_path_for(path: str, who: WriterIdentity) -> str:
    """A hidden temporary path next to *path*, naming the writing host and pid."""
    head, _, base = path.rpartition("/")
    # A long final name would make the temporary name exceed 255 bytes: keep a prefix of it
    # (the temporary name only has to be unique and to say who wrote it).
    short = base.encode("utf-8", "surrogatepass")[:100].decode("utf-8", "ignore")
    temp = f".{short}{_TEMP_MARK}{who.host}~{who.pid}~{_unique()}"
    return f"{head}/{temp}" if head else temp


class _Unique:
    """Tokens unique within a process (a counter) and across its lifetimes (a random salt).

    Cheaper than ``secrets.token_hex`` per temporary file (no random bytes), and as unique:
    the host and pid name the process, the salt tells a reused pid apart, the counter the
    files of one process. A forked child (another pid) salts anew.
    """

    def __init__(self) -> None:
        self._pid = -1

    def __call__(self) -> str:
        if self._pid != os.getpid():
            self._salt = secrets.token_hex(3)
            self._counter = itertools.count()
            self._pid = os.getpid()
        return f"{self._salt}{next(self._counter):x}"


_unique = _Unique()


def parse_temp_path(path: str) -> tuple[str, int] | None:
    """``(host, pid)`` of the writer of a temporary file made by :func:`temp_path_for`."""
    base = path.rpartition("/")[2]
    if not base.startswith(".") or _TEMP_MARK not in base:
        return None
    parts = base.rpartition(_TEMP_MARK)[2].split("~")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def is_internal_path(path: str) -> bool:
    """True for trajtrack's own files (temporary files, records): never a dump.

    That is, some ``/``-separated part of *path* starts with ``.``: the first part, or one
    after a ``/`` (two string searches instead of a split; a listing asks it of every file)."""
    return path.startswith(".") or "/." in path
