"""Storage backends, chosen by URL scheme from a small registry.

``open_storage(url)`` returns a :class:`Storage`: a local path or ``file://`` URL gives the local
filesystem backend, ``memory://name`` the in-memory backend, and ``webhdfs://``, ``swebhdfs://``
and ``hdfs://`` the WebHDFS backend (extra ``trajtrack[hdfs]``). Third parties can add schemes
with :func:`register_backend`.

Read the modules in this order::

    _protocol.py        Storage: the async primitives every backend implements; payloads,
                        ChecksumWriter, write_payload
    _registry.py        which backend opens which URL scheme (register_backend)
    local.py            the local filesystem backend: a path or file:// URL
    _local_paths.py     ... containment under its root: never through a link leading out
    _local_errors.py    ... an OSError as a typed StorageError
    memory.py           the in-memory backend (tests, examples, benchmarks)
    webhdfs.py          the WebHDFS backend: webhdfs://, swebhdfs://, hdfs://
    _hadoop_conf.py     ... a destination URL to endpoints, from the Hadoop configuration
    _webhdfs_io.py      ... spooled upload bodies and the HTTP session
    _webhdfs_errors.py  ... WebHDFS failures as typed exceptions
"""

from __future__ import annotations

from trajtrack.backends._protocol import (
    WRITE_PIECE,
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
    write_all,
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
    "WRITE_PIECE",
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
    "write_all",
    "write_each_concurrently",
    "write_payload",
    "write_payload_unbuffered",
]
