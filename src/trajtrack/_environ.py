"""Reading environment variables in the per-dump path.

``os.environ.get`` runs four Python-level calls (key encoding, lookup, value decoding), and a
dump call reads up to five variables (the enable switch, the actor's name and namespace): a
pipelined Ray dump is itself only a few Python calls, so those lookups are a visible share of it
(``benchmarks/bench_ray.py`` measures the dump's latency). :func:`getenv` reads the same
mapping ``os.environ`` reads and writes (on CPython for POSIX, the ``bytes`` dict behind it)
with one dict lookup, so a value set through ``os.environ`` (or ``monkeypatch.setenv``) is seen
at once, exactly as ``os.environ.get`` would see it. Elsewhere it is ``os.environ.get``.
"""

from __future__ import annotations

import os
import sys
from typing import Final

__all__ = ["getenv"]

_ENCODING: Final = sys.getfilesystemencoding()


def _raw_environ() -> dict[bytes, bytes] | None:
    data = getattr(os.environ, "_data", None)
    if os.name != "posix" or not isinstance(data, dict):
        return None
    # Checked by reading only (setting a variable here could race a C library's getenv).
    for key, value in list(data.items())[:1]:
        if not (isinstance(key, bytes) and isinstance(value, bytes)):
            return None
        if os.environ.get(key.decode(_ENCODING, "surrogateescape")) is None:
            return None
    return data


_RAW: Final = _raw_environ()
_KEYS: dict[str, bytes] = {}


def getenv(name: str) -> str | None:
    """``os.environ.get(name)``, cheaper."""
    raw = _RAW
    if raw is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = name.encode(_ENCODING, "surrogateescape")
    value = raw.get(key)
    return None if value is None else value.decode(_ENCODING, "surrogateescape")
