"""Storage backends, chosen by URL scheme from a small registry.

``open_storage(url)`` returns a :class:`Storage`: a local path or ``file://`` URL gives the local
filesystem backend, ``memory://name`` the in-memory backend, and ``webhdfs://``, ``swebhdfs://``
and ``hdfs://`` the WebHDFS backend (extra ``trajtrack[hdfs]``). Third parties can add schemes
with :func:`register_backend`.
"""

from __future__ import annotations

from trajtrack.backends._protocol import (
    BytesPayload,
    ChecksumWriter,
    FileInfo,
    ItemDone,
    Payload,
    Storage,
    WriteResult,
    check_range,
    check_relative,
    checksum_of,
    write_each_concurrently,
    write_payload,
    write_payload_unbuffered,
)
from trajtrack.backends._registry import (
    StorageFactory,
    open_storage,
    register_backend,
    scheme_of,
)

__all__ = [
    "BytesPayload",
    "ChecksumWriter",
    "FileInfo",
    "ItemDone",
    "Payload",
    "Storage",
    "StorageFactory",
    "WriteResult",
    "check_range",
    "check_relative",
    "checksum_of",
    "open_storage",
    "register_backend",
    "scheme_of",
    "write_each_concurrently",
    "write_payload",
    "write_payload_unbuffered",
]
