"""The pipelined mode's sender: a bounded per-process send buffer and one background thread.

``dump_data(..., wait=False)`` puts a snapshot (:data:`Snapshot`) into this process's
:class:`Sender` and returns; the sender thread ships the buffer to the tracker actor in
batches -- frames back to back on the actor's channel, else one ``dump_many`` Ray call per
batch -- and settles each batch when its replies (or Ray's completion callback) come back.
The errors are kept until :meth:`Sender.wait` raises them. A ``fork()``ed child gets a fresh,
empty sender (the thread is not inherited, nor are the parent's dumps); a normal interpreter
exit waits for the dumps still in flight (``TRAJTRACK_EXIT_TIMEOUT``).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import io
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions

from trajtrack._exceptions import ConfigurationError
from trajtrack.ray._config import FULL_TIMEOUT_VAR, limits
from trajtrack.ray._discovery import Cached, channel_failed, current, current_actor, forget
from trajtrack.ray._protocol import ChannelBrokenError, Payload, Who, payload_size
from trajtrack.ray._wire_decode import decode
from trajtrack.ray._wire_encode import Captured, encode
from trajtrack.tracker import NotPlainError, ObjectPayload, add_note, exit_timeout_from_env

__all__ = [
    "BATCH_MAX_BYTES",
    "BATCH_MAX_ITEMS",
    "MAX_BATCHES_IN_FLIGHT",
    "Sender",
    "Snapshot",
    "on_the_wire",
    "sender",
    "serialized",
]

logger = logging.getLogger(__name__)

BATCH_MAX_ITEMS = 256
"""At most this many dumps go to the actor in one ``dump_many`` call."""
BATCH_MAX_BYTES = 16 << 20
"""At most this many payload bytes in one call (a larger single dump goes alone)."""
MAX_BATCHES_IN_FLIGHT = 1
"""Batches sent and not yet acknowledged, per process; the buffer fills meanwhile.

One: Ray does not promise to start an async actor's calls in submission order, so two batches
of one process in flight at once could be admitted out of order (seen once in CI as a
reordered record). The next batch accumulates while one is in flight, so little is lost."""

Snapshot = bytes | ObjectPayload | Captured
"""A pipelined dump in the send buffer: serialized, copied objects, or captured plain data."""


def serialized(payload: Snapshot) -> bytes:
    """A pipelined snapshot as a Ray call carries it: ``torch.save`` bytes."""
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, Captured):  # captured for a channel that has failed since
        encoded = bytearray().join(payload.encoded().parts)  # decode wants it writable
        payload = ObjectPayload(decode(encoded)[0], payload.nbytes)
    buffer = io.BytesIO()
    payload.write_to(buffer)
    return buffer.getvalue()


def on_the_wire(payload: Snapshot) -> Payload:
    """A pipelined snapshot as the channel sends it: plain data encoded, else serialized."""
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, Captured):
        return payload.encoded()
    try:
        return encode(payload.materialize())
    except NotPlainError:
        return serialized(payload)


@dataclass(slots=True)
class _Item:
    seq: int
    payload: Snapshot
    nbytes: int
    name: str
    who: Who
    actor: tuple[str, str]  # (name, namespace), as configured when dump_data was called


@dataclass
class _Batch:
    first_seq: int
    items: int
    nbytes: int


class Sender:
    """This process's pipelined dumps: a bounded send buffer and one background sender thread.

    Callers append serialized dumps to the buffer (waiting while this process has
    ``max_items`` dumps or ``max_bytes`` bytes unacknowledged, buffered or sent). The sender
    thread, started on first use, ships the buffer in batches (bounded by
    :data:`BATCH_MAX_ITEMS` and :data:`BATCH_MAX_BYTES`) with one ``dump_many`` call each, at
    most :data:`MAX_BATCHES_IN_FLIGHT` unacknowledged at a time; Ray's completion callbacks
    settle them. Errors are kept (first one, and a count) until :meth:`wait` raises them.

    Every dump has a sequence number; :meth:`wait` waits until all those made before it are
    settled, so writers that keep dumping from other threads cannot starve it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # callers and waiters wait here
        # The idle sender thread blocks on this queue; whoever gives it work while it sleeps
        # puts one token (a C call: cheaper for the caller than ``Condition.notify``).
        self._wakeup: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._sleeping = False
        self._buffer: collections.deque[_Item] = collections.deque()
        self._batches: dict[int, _Batch] = {}
        self._next_seq = 0
        self._next_batch = 0
        self._items = 0  # buffered + sent, not yet acknowledged
        self._bytes = 0
        self._error: BaseException | None = None
        self._errors = 0
        self._thread: threading.Thread | None = None
        self._exit_hook = False

    # ------------------------------------------------------------------ callers

    def in_flight(self) -> int:
        return self._items

    def put(
        self,
        payload: Snapshot,
        nbytes: int,
        name: str,
        who: Who,
        actor: tuple[str, str],
    ) -> None:
        with self._lock:
            if self._items:  # with nothing in flight, the bound cannot hold a dump back
                self._wait_for_room_locked(nbytes, name)
            self._buffer.append(_Item(self._next_seq, payload, nbytes, name, who, actor))
            self._next_seq += 1
            self._items += 1
            self._bytes += nbytes
            if self._thread is None:
                self._start_locked()
            self._wake_locked()

    def _wait_for_room_locked(self, nbytes: int, name: str) -> None:
        max_items, max_bytes, timeout = limits()  # as the environment says now
        if self._fits(nbytes, max_items, max_bytes):
            return
        deadline = time.monotonic() + timeout
        while self._items and not self._fits(nbytes, max_items, max_bytes):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"trajtrack.ray: {self._items} pipelined dumps ({self._bytes} bytes) "
                    f"of this process are still unacknowledged after {timeout:g} s "
                    f"(limits: {max_items} dumps, {max_bytes} bytes; set "
                    f"{FULL_TIMEOUT_VAR} to wait longer); {name!r} was not sent"
                )
            self._settled.wait(left)

    def _fits(self, nbytes: int, max_items: int, max_bytes: int) -> bool:
        return self._items < max_items and self._bytes + nbytes <= max_bytes

    def _start_locked(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trajtrack-ray-sender", daemon=True)
        self._thread.start()
        if not self._exit_hook:
            self._exit_hook = True
            atexit.register(_drain_at_exit)

    def wait_settled(self, timeout: float | None) -> None:
        """Wait until every dump made before the call is settled; errors stay kept."""
        with self._lock:
            self._wait_settled_locked(timeout)

    def _wait_settled_locked(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        target = self._next_seq  # everything made before this call
        while self._oldest_unsettled_locked() < target:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(
                    f"{self._items} pipelined dumps of this process were not "
                    f"acknowledged by the tracker actor within {timeout} s"
                )
            self._settled.wait(left)

    def wait(self, timeout: float | None) -> None:
        with self._lock:
            self._wait_settled_locked(timeout)
            error, count = self._error, self._errors
            self._error, self._errors = None, 0
        if error is not None:
            if count > 1:
                add_note(error, f"trajtrack: {count - 1} more pipelined dumps failed")
            raise error

    def _oldest_unsettled_locked(self) -> int:
        oldest = self._buffer[0].seq if self._buffer else self._next_seq
        for batch in self._batches.values():
            oldest = min(oldest, batch.first_seq)
        return oldest

    # ------------------------------------------------------------------ the sender thread

    def _wake_locked(self) -> None:
        if self._sleeping:
            self._sleeping = False
            self._wakeup.put(None)

    def _run(self) -> None:
        while True:
            with self._lock:
                idle = not self._buffer or len(self._batches) >= MAX_BATCHES_IN_FLIGHT
                if idle:
                    self._sleeping = True
                else:
                    batch_id, items = self._take_locked()
            if idle:
                self._wakeup.get()
                continue
            try:
                self._send(batch_id, items)
            except BaseException as exc:  # the thread must survive anything: report it
                self._settle(batch_id, [(i, exc) for i in range(len(items))])

    def _take_locked(self) -> tuple[int, list[_Item]]:
        items = [self._buffer.popleft()]
        nbytes = items[0].nbytes
        while (
            self._buffer
            and len(items) < BATCH_MAX_ITEMS
            and nbytes + self._buffer[0].nbytes <= BATCH_MAX_BYTES
            and self._buffer[0].who == items[0].who
            and self._buffer[0].actor == items[0].actor
        ):
            item = self._buffer.popleft()
            items.append(item)
            nbytes += item.nbytes
        batch_id = self._next_batch
        self._next_batch += 1
        self._batches[batch_id] = _Batch(items[0].seq, len(items), nbytes)
        return batch_id, items

    def _send(self, batch_id: int, items: list[_Item]) -> None:
        if not ray.is_initialized():  # never start a Ray instance from this thread
            raise ConfigurationError("Ray was shut down with pipelined trajtrack dumps unsent")
        failures: list[tuple[int, BaseException]] = []
        actor = items[0].actor  # a batch holds the dumps of one writer for one actor
        cached = current(*actor)
        if cached.channel is not None:
            items, failures = self._over_channel(cached, items)
            if not items:
                self._settle(batch_id, failures)
                return
        payloads: list[bytes] = []
        names: list[str] = []
        for index, item in enumerate(items):
            try:
                payloads.append(serialized(item.payload))
            except Exception as exc:
                failures.append((index, exc))
            else:
                names.append(item.name)
            item.payload = b""  # the batch holds the bytes now; drop the copy early
        if not payloads:
            self._settle(batch_id, failures)
            return
        who = items[0].who
        try:
            ref = current_actor(*actor).dump_many.remote(payloads, names, who)
        except ray.exceptions.RayActorError as exc:
            logger.warning("the trajtrack tracker actor is unavailable (%s); looking it up", exc)
            forget(*actor)
            ref = current_actor(*actor).dump_many.remote(payloads, names, who)
        ref.future().add_done_callback(
            lambda done: self._on_done(batch_id, actor, len(payloads), failures, done)
        )

    @staticmethod
    def _over_channel(
        cached: Cached, items: list[_Item]
    ) -> tuple[list[_Item], list[tuple[int, BaseException]]]:
        """Send a batch on the channel, in order; return what is left for Ray, and failures.

        From the first payload over the channel's limit on, the batch goes as a Ray call
        (after the replies of those before it: the order is kept).
        """
        channel = cached.channel
        assert channel is not None
        frames: list[tuple[Payload, str]] = []
        sent: list[_Item] = []
        failures: list[tuple[int, BaseException]] = []
        for index, item in enumerate(items):
            try:
                frame = on_the_wire(item.payload)
            except Exception as exc:
                failures.append((index, exc))
                continue
            if not channel.carries(payload_size(frame)):
                break
            frames.append((frame, item.name))
            sent.append(item)
        rest = items[len(sent) + len(failures) :]
        try:
            refused = channel.dump_many(frames)
        except ChannelBrokenError as exc:  # the unanswered rest goes as Ray calls
            channel_failed(cached, exc)
            return [*sent[exc.replies :], *rest], [*failures, *exc.failures]
        for item in sent:
            item.payload = b""
        return rest, [*failures, *refused]

    def _on_done(
        self,
        batch_id: int,
        actor: tuple[str, str],
        count: int,
        failures: list[tuple[int, BaseException]],
        done: concurrent.futures.Future[Any],
    ) -> None:
        # Runs on a Ray thread: no Ray calls here, only bookkeeping.
        try:
            failures = failures + list(done.result())
        except Exception as exc:  # the whole batch failed
            if isinstance(exc, ray.exceptions.RayActorError):
                forget(*actor)
            failures = failures + [(i, exc) for i in range(count)]
        self._settle(batch_id, failures)

    def _settle(self, batch_id: int, failures: list[tuple[int, BaseException]]) -> None:
        if failures:
            logger.warning("%d pipelined trajtrack dumps failed: %s", len(failures), failures[0][1])
        with self._lock:
            batch = self._batches.pop(batch_id, None)
            if batch is None:
                return
            self._items -= batch.items
            self._bytes -= batch.nbytes
            if failures:
                self._errors += len(failures)
                if self._error is None:
                    self._error = failures[0][1]
            self._settled.notify_all()
            self._wake_locked()


_sender = Sender()
_sender_pid = os.getpid()


def sender() -> Sender:
    """This process's sender (a ``fork()``ed child has a new one: call this, do not keep it)."""
    global _sender, _sender_pid
    if _sender_pid != os.getpid():
        # The sender thread is not inherited; nor are the parent's dumps.
        _sender, _sender_pid = Sender(), os.getpid()
    return _sender


def _drain_at_exit() -> None:
    if not sender().in_flight() or not ray.is_initialized():
        return
    try:
        sender().wait(exit_timeout_from_env())
    except Exception as exc:
        logger.error("trajtrack: pipelined dumps not delivered before exit: %s", exc)
