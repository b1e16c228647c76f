"""A small in-memory WebHDFS server on 127.0.0.1, for running the storage contract without Java.

It speaks the part of the REST API the WebHDFS backend uses, as Hadoop 2.7.3 answers it:
``GETFILESTATUS``, ``LISTSTATUS``, ``MKDIRS``, two-step ``CREATE`` (a 307 to a "DataNode" URL
on the same server, then the body), ``OPEN`` with ``offset``/``length`` (a 307, then the
bytes), ``RENAME`` (``{"boolean": false}`` when the target exists, ``renameoptions=OVERWRITE``
replaces) and ``DELETE``; errors as ``RemoteException`` JSON. The real cluster
(tests/_support/hdfs_cluster.py) stays the reference: this one only lets the contract run
everywhere.
"""

from __future__ import annotations

import json
import posixpath
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

PREFIX = "/webhdfs/v1"


class _Namespace:
    """Files and directories, behind one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: dict[str, tuple[bytes, float]] = {}
        self.dirs: set[str] = {"/"}

    def status(self, path: str) -> dict[str, Any] | None:
        if path in self.files:
            data, mtime = self.files[path]
            return _status("FILE", len(data), mtime, posixpath.basename(path))
        if path in self.dirs:
            return _status("DIRECTORY", 0, time.time(), posixpath.basename(path))
        return None

    def makedirs(self, path: str) -> None:
        while path not in self.dirs:
            self.dirs.add(path)
            path = posixpath.dirname(path)

    def children(self, path: str) -> list[dict[str, Any]]:
        prefix = path.rstrip("/") + "/"
        names = {p[len(prefix) :].split("/")[0] for p in [*self.files, *self.dirs]}
        names.discard("")
        found = []
        for name in sorted(names):
            child = prefix + name
            if child in self.files or child in self.dirs:
                status = self.status(child)
                assert status is not None
                found.append(status)
        return found


def _status(kind: str, length: int, mtime: float, name: str) -> dict[str, Any]:
    return {
        "type": kind,
        "length": length,
        "modificationTime": int(mtime * 1000),
        "pathSuffix": name,
        "permission": "644",
    }


class _Handler(BaseHTTPRequestHandler):
    namespace: _Namespace
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return None  # quiet

    # ------------------------------------------------------------------ plumbing

    def _parsed(self) -> tuple[str, dict[str, str]]:
        parts = urlsplit(self.path)
        path = unquote(parts.path[len(PREFIX) :]) or "/"
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        return posixpath.normpath(path), query

    def _reply(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, code: int, data: Any) -> None:
        self._reply(code, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def _error(self, code: int, exception: str, message: str) -> None:
        java = f"java.io.{exception}" if exception == "FileNotFoundException" else exception
        remote = {"exception": exception, "javaClassName": java, "message": message}
        self._json(code, {"RemoteException": remote})

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _redirect(self, query: dict[str, str]) -> None:
        location = self.path + ("&" if "?" in self.path else "?") + "datanode=true"
        host = self.headers.get("Host", "127.0.0.1")
        self._body()  # a client may send the body with the first request: drop it
        self._reply(307, headers={"Location": f"http://{host}{location}"})

    # ------------------------------------------------------------------ verbs

    def do_GET(self) -> None:
        path, query = self._parsed()
        op = query.get("op", "").upper()
        ns = self.namespace
        with ns.lock:
            status = ns.status(path)
            if op == "GETFILESTATUS":
                if status is None:
                    return self._error(404, "FileNotFoundException", f"File does not exist: {path}")
                return self._json(200, {"FileStatus": status})
            if op == "LISTSTATUS":
                if status is None:
                    return self._error(404, "FileNotFoundException", f"File {path} does not exist.")
                listing = ns.children(path) if status["type"] == "DIRECTORY" else [status]
                return self._json(200, {"FileStatuses": {"FileStatus": listing}})
            if op == "OPEN":
                if status is None or status["type"] != "FILE":
                    return self._error(404, "FileNotFoundException", f"File does not exist: {path}")
                if "datanode" not in query:
                    return self._redirect(query)
                data = ns.files[path][0]
        if op != "OPEN":
            return self._error(400, "IllegalArgumentException", f"Invalid value for op: {op}")
        offset = int(query.get("offset", 0))
        length = int(query["length"]) if "length" in query else len(data)
        if offset and offset >= len(data):  # what a 2.7.3 NameNode answers at or past the end
            message = f"Offset={offset} out of the range [0, {len(data)}); OPEN, path={path}"
            return self._error(403, "IOException", message)
        return self._reply(200, data[offset : offset + length])

    def do_PUT(self) -> None:
        path, query = self._parsed()
        op = query.get("op", "").upper()
        if op == "CREATE":
            return self._create(path, query)
        ns = self.namespace
        self._body()
        with ns.lock:
            if op == "MKDIRS":
                ns.makedirs(path)
                return self._json(200, {"boolean": True})
            if op == "RENAME":
                return self._rename(path, query)
        return self._error(400, "IllegalArgumentException", f"Invalid value for op: {op}")

    def _create(self, path: str, query: dict[str, str]) -> None:
        if "datanode" not in query:
            return self._redirect(query)
        data = self._body()
        ns = self.namespace
        with ns.lock:
            if path in ns.files and query.get("overwrite", "false") != "true":
                return self._error(403, "FileAlreadyExistsException", f"{path} already exists")
            ns.makedirs(posixpath.dirname(path))
            ns.files[path] = (data, time.time())
        return self._reply(201, headers={"Location": f"hdfs://fake{path}"})

    def _rename(self, path: str, query: dict[str, str]) -> None:
        ns = self.namespace
        target = posixpath.normpath(query.get("destination", ""))
        if path not in ns.files:
            if query.get("renameoptions"):
                return self._error(404, "FileNotFoundException", f"{path} does not exist")
            return self._json(200, {"boolean": False})
        if target in ns.files and query.get("renameoptions", "").upper() != "OVERWRITE":
            return self._json(200, {"boolean": False})
        ns.makedirs(posixpath.dirname(target))
        ns.files[target] = ns.files.pop(path)
        if query.get("renameoptions"):
            return self._reply(200)
        return self._json(200, {"boolean": True})

    def do_DELETE(self) -> None:
        path, _query = self._parsed()
        ns = self.namespace
        with ns.lock:
            existed = ns.files.pop(path, None) is not None
        return self._json(200, {"boolean": existed})


@contextmanager
def fake_webhdfs() -> Iterator[str]:
    """Serve a fresh empty namespace; yields its ``webhdfs://127.0.0.1:<port>`` base URL."""
    handler = type("Handler", (_Handler,), {"namespace": _Namespace()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="fake-webhdfs", daemon=True)
    thread.start()
    try:
        yield f"webhdfs://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
