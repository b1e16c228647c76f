"""Loading a dump with trajtrack's allow-list in a process of trajtrack's own.

torch's weights-only allow-list is process-wide (``torch.serialization.add_safe_globals``;
``safe_globals()`` changes the same list while it is entered, for every thread). A library may
not widen it behind its caller's back, and there is no public way to widen it for one load only,
so a dump that needs trajtrack's allow-list beyond what the fast path proves it can load
(rollout records written before they pickled as one rebuild call, numpy arrays as values, a
``Counter``) and is refused by the caller's own list is loaded here instead. It is the one
route for those dumps (see :mod:`trajtrack.reader._safe_load`):

* One worker process, started with the ``spawn`` method on first use (a fresh interpreter:
  nothing inherited from the caller but ``sys.path``), then reused; one request at a time. Its
  allow-list is set once, at start: ``add_safe_globals(trajtrack's list)``. It is trajtrack's
  process, so that is its own business. Like any spawned process it first imports the caller's
  main module: it is not started when that would run more than definitions
  (:mod:`trajtrack.reader._main_module`).
* The worker loads with ``torch.load(weights_only=True)``: the same restricted unpickler, with
  torch's defaults plus trajtrack's list. It encodes the object so that torch's defaults alone
  can load it (:mod:`trajtrack.reader._portable`), saves it with ``torch.save`` and sends the
  bytes back; the caller loads them with ``torch.load(weights_only=True)`` and its own,
  unchanged, allow-list, and rebuilds trajtrack's types from a fixed table.
* Messages are raw bytes over a pipe: a JSON header, then a payload. The caller never
  unpickles anything the worker sends except through torch's weights-only loader.
* Sparse tensors are validated where the caller's process says so: by the caller's own load
  of the reply (``torch.sparse.check_sparse_tensor_invariants``).
* A worker that dies (a crash in torch's C++ code on a hostile file, the kernel's OOM killer)
  fails that one load with :class:`~trajtrack.DumpLoadError`; the next load starts a new one.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
from dataclasses import dataclass
from typing import Any

import torch

from trajtrack.reader import _portable
from trajtrack.reader._main_module import main_module_problem

__all__ = ["MainModuleError", "Reply", "WorkerError", "request_load"]

logger = logging.getLogger(__name__)

_CONTEXT = multiprocessing.get_context("spawn")
_MAX_HEADER = 1 << 20


class WorkerError(RuntimeError):
    """The worker could not be started, or exited before it answered."""


class MainModuleError(WorkerError):
    """Starting the worker would re-run code of this program's main module."""


@dataclass(frozen=True, slots=True)
class Reply:
    """The worker's answer: ``status`` is ``ok`` (``obj`` set), ``refused`` or ``corrupt``."""

    status: str
    obj: Any = None
    message: str = ""
    offending: tuple[str, ...] = ()


def request_load(*, data: bytes | None = None, path: str | None = None) -> Reply:
    """Load one dump (its bytes, or a local file) in the worker; blocking, thread-safe.

    Raises:
        MainModuleError: The worker would re-run the main module's code (not started).
        WorkerError: The worker could not be started or died while loading.
        UnportableError: The reply could not be decoded.
        pickle.UnpicklingError: The reply needs more than torch's defaults (it never should).
    """
    header = {"path": path}
    state = _this_process_state()
    with state.lock:
        worker = state.worker
        if worker is None or not worker.is_alive():
            problem = main_module_problem()
            if problem is not None:
                raise MainModuleError(problem)
            worker = state.worker = _Worker()
        try:
            raw_header, payload = worker.exchange(header, data or b"")
        except (OSError, EOFError) as exc:  # the worker died, or its pipe broke
            state.worker = None
            raise WorkerError(f"the load worker exited ({worker.describe_exit()})") from exc
    answer = json.loads(raw_header)
    status = answer.get("status") if isinstance(answer, dict) else None
    if status in ("refused", "corrupt"):
        offending = answer.get("offending") or []
        names = tuple(str(name) for name in offending) if isinstance(offending, list) else ()
        return Reply(status, message=str(answer.get("message", "")), offending=names)
    if status != "ok":
        raise _portable.UnportableError(f"malformed reply from the load worker: {answer!r:.200}")
    tree = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    return Reply("ok", obj=_portable.decode(tree))


class _State:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.worker: _Worker | None = None


_state = _State()


def _this_process_state() -> _State:
    """The state of this process: a forked child shares the parent's pipe to the worker (and
    perhaps its lock, held), so it starts afresh."""
    global _state
    if _state.pid != os.getpid():
        _state = _State()
    return _state


class _Worker:
    """The worker process and the caller's end of its pipe."""

    def __init__(self) -> None:
        ours, theirs = _CONTEXT.Pipe(duplex=True)
        self._process = _CONTEXT.Process(
            target=serve, args=(theirs,), name="trajtrack-load-worker", daemon=True
        )
        try:
            self._process.start()
        except Exception as exc:  # e.g. started from a daemonic process, which may not fork
            ours.close()
            raise WorkerError(f"cannot start the load worker: {exc}") from exc
        finally:
            theirs.close()
        self._conn = ours
        logger.debug("started the load worker (pid %s)", self._process.pid)

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def exchange(self, header: dict[str, Any], payload: bytes) -> tuple[bytes, bytes]:
        self._conn.send_bytes(json.dumps(header).encode())
        self._conn.send_bytes(payload)
        raw_header = self._conn.recv_bytes(_MAX_HEADER)
        return raw_header, self._conn.recv_bytes()

    def describe_exit(self) -> str:
        self._conn.close()
        self._process.join(5)
        code = self._process.exitcode
        if code is None:
            self._process.kill()
            return "pipe broken"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


# --------------------------------------------------------------------------- in the worker


def serve(conn: multiprocessing.connection.Connection) -> None:
    """The worker's loop: answer load requests until the caller closes the pipe."""
    from trajtrack.reader._safe_load import allowed_globals

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the caller; EOF stops us
    torch.set_num_threads(1)
    torch.serialization.add_safe_globals(list(allowed_globals()))  # this process is ours
    while True:
        try:
            header = json.loads(conn.recv_bytes(_MAX_HEADER))
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        answer, payload = _answer(header, data)
        conn.send_bytes(json.dumps(answer).encode())
        conn.send_bytes(payload)


def _answer(header: dict[str, Any], data: bytes) -> tuple[dict[str, Any], bytes]:
    from trajtrack.reader._safe_load import first_line, refused_globals, restricted_load

    path = header.get("path")
    source: Any = path if isinstance(path, str) else io.BytesIO(data)
    try:
        obj = restricted_load(source)
    except pickle.UnpicklingError as exc:
        source = path if isinstance(path, str) else io.BytesIO(data)
        offending = refused_globals(source, str(exc))
        return {"status": "refused", "message": first_line(exc), "offending": offending}, b""
    except Exception as exc:  # torch raises RuntimeError, EOFError, KeyError... on bad bytes
        return {"status": "corrupt", "message": first_line(exc)}, b""
    try:
        buffer = io.BytesIO()
        torch.save(_portable.encode(obj), buffer)
    except Exception as exc:  # e.g. too deeply nested to encode or to pickle
        return {"status": "corrupt", "message": f"cannot be passed back: {first_line(exc)}"}, b""
    return {"status": "ok"}, buffer.getvalue()
