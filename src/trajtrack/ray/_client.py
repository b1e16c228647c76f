"""The caller's side: find (or create) the named actor, snapshot, send, and wait as asked.

Two ways to send a dump:

* **acknowledged** (default): ``dump_data`` returns once the actor has admitted the dump, so a
  ``flush`` from *any* process afterwards covers it (Ray orders the calls of one caller, not
  those of different callers). One round trip per dump, the bytes shipped once.
* **pipelined** (``wait=False`` or ``TRAJTRACK_RAY_PIPELINED=1``): the caller only serializes
  and appends to a per-process send buffer; a background thread ships the buffer to the actor
  in batches. At most ``max_in_flight`` dumps (and bytes) per process unacknowledged, buffered
  or sent, beyond which callers wait; :func:`wait_for_own_dumps` waits for this process's own.
  A flush from *another* process does not cover dumps still in flight here.

Both send through the actor's direct channel (:mod:`trajtrack.ray._channel`: a Unix socket on
the actor's node, TCP from other nodes) whose address and secret the process learns with one
Ray call; ``TRAJTRACK_RAY_CHANNEL=off`` sends every dump as a Ray call instead (``dump`` /
``dump_many``), and so does a process whose channel fails (it logs why, once).

The actor handle is cached per process (no named-actor lookup per call), forgotten after
``fork()``, when Ray is re-initialized, and when the actor turns out to be dead.
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

from trajtrack._environ import getenv
from trajtrack._exceptions import ConfigurationError, SerializationError
from trajtrack.backends import scheme_of
from trajtrack.layouts.names import WriterIdentity, validate_name
from trajtrack.ray._actor import TrackerActor
from trajtrack.ray._channel import ChannelBrokenError, ChannelClient, Endpoints, Payload, Who
from trajtrack.ray._wire import Captured, capture, decode, encode
from trajtrack.tracker import (
    NotPlainError,
    ObjectPayload,
    add_note,
    destination_from_env,
    exit_timeout_from_env,
    is_enabled,
    measure_plain,
    snapshot_plain,
    torch_save,
    tracker_options_from_env,
)

__all__ = [
    "DEFAULT_ACTOR_NAME",
    "DEFAULT_NAMESPACE",
    "dump_data",
    "flush",
    "get_trajectory_tracker",
    "own_dumps_in_flight",
    "shutdown",
    "wait_for_own_dumps",
]

logger = logging.getLogger("trajtrack")

DEFAULT_ACTOR_NAME = "global_tracker"
DEFAULT_NAMESPACE = "trajtrack"
ACTOR_NAME_VAR = "TRAJTRACK_RAY_ACTOR"
NAMESPACE_VAR = "TRAJTRACK_RAY_NAMESPACE"
PIPELINED_VAR = "TRAJTRACK_RAY_PIPELINED"
MAX_IN_FLIGHT_VAR = "TRAJTRACK_RAY_MAX_IN_FLIGHT"
DEFAULT_MAX_IN_FLIGHT = 64
MAX_IN_FLIGHT_BYTES_VAR = "TRAJTRACK_RAY_MAX_IN_FLIGHT_BYTES"
DEFAULT_MAX_IN_FLIGHT_BYTES = 256 << 20
CHANNEL_VAR = "TRAJTRACK_RAY_CHANNEL"
CHANNEL_MODES = ("auto", "tcp", "off")
"""``auto``: the Unix socket on the actor's node, TCP elsewhere; ``tcp``: always TCP;
``off``: no channel (every dump is a Ray call; also keeps a new actor from listening)."""
FULL_TIMEOUT_VAR = "TRAJTRACK_RAY_FULL_TIMEOUT"
DEFAULT_FULL_TIMEOUT = 300.0
BATCH_MAX_ITEMS = 256
"""At most this many dumps go to the actor in one ``dump_many`` call."""
BATCH_MAX_BYTES = 16 << 20
"""At most this many payload bytes in one call (a larger single dump goes alone)."""
MAX_BATCHES_IN_FLIGHT = 1
"""Batches sent and not yet acknowledged, per process; the buffer fills meanwhile.

One: Ray does not promise to start an async actor's calls in submission order, so two batches
of one process in flight at once could be admitted out of order (seen once in CI as a
reordered record). The next batch accumulates while one is in flight, so little is lost."""
SEND_NOW_MIN_BYTES = 64 << 20
"""A pipelined dump of CPU plain data over this size is not copied: after this process's earlier
pipelined dumps are acknowledged it is sent like an acknowledged one, before ``dump_data``
returns. Copying that much costs the caller as much as sending it (fresh memory: page faults),
and would double the memory it holds."""
PLAIN_COPY_MAX_BYTES = 8 << 20
"""Pipelined plain data up to this size is copied by the caller and serialized by the sender
thread; larger objects are serialized by the caller (no second in-memory copy)."""

# Dumps blocked on the actor's full queue hold a concurrency slot each; flush/statistics calls
# need free ones, so the limit is far above any sane number of concurrent writers.
_ACTOR_DEFAULTS: dict[str, Any] = {"max_concurrency": 1000, "num_cpus": 0, "max_restarts": 0}

_RemoteTrackerActor = ray.remote(TrackerActor)


# --------------------------------------------------------------------------- finding the actor


def _actor_name(name: str | None) -> str:
    return name or getenv(ACTOR_NAME_VAR) or DEFAULT_ACTOR_NAME


def _namespace(namespace: str | None) -> str:
    return namespace or getenv(NAMESPACE_VAR) or DEFAULT_NAMESPACE


def _absolute(destination: str) -> str:
    # The actor's working directory is not the caller's: pin relative paths (and ~) here.
    if scheme_of(destination) == "file" and "://" not in destination:
        return os.path.abspath(os.path.expanduser(destination))
    return destination


def get_trajectory_tracker(
    destination: str | os.PathLike[str] | None = None,
    *,
    name: str | None = None,
    namespace: str | None = None,
    actor_options: dict[str, Any] | None = None,
    **tracker_options: Any,
) -> Any:
    """The named, detached tracker actor of this Ray cluster; created if it does not exist.

    Like verl's original (``name="global_tracker"``, ``get_if_exists=True``,
    ``lifetime="detached"``), but in a fixed namespace, so that every job of the cluster finds
    the same actor. When the actor exists, *destination* and the options are ignored (the
    first creator's win; a differing destination is logged by :func:`dump_data`).

    Args:
        destination: Where to write; default ``TRAJTRACK_DIR`` or ``VERL_TRACKER_HDFS_DIR``.
            Local paths are made absolute in the caller. Without a destination (argument or
            environment) the actor is only looked up, never created.
        name: Actor name; default ``TRAJTRACK_RAY_ACTOR`` or ``"global_tracker"``.
        namespace: Ray namespace; default ``TRAJTRACK_RAY_NAMESPACE`` or ``"trajtrack"``.
        actor_options: Extra ``ActorClass.options`` (e.g. ``num_cpus``, a scheduling strategy).
        **tracker_options: Keyword arguments for :class:`trajtrack.Tracker` in the actor
            (``name_template``, ``workers``, ``layout``, ...); the environment's
            (``TRAJTRACK_LAYOUT``, ``TRAJTRACK_SHARD_MAX_BYTES``, ``TRAJTRACK_SHARD_MAX_AGE``)
            apply where these do not say.

    Returns:
        The actor handle: call ``dump``, ``flush`` (``wait_for_hdfs``), ``statistics`` and
        ``close`` with ``.remote()``; ``ray.get`` or ``await`` the result.

    Raises:
        ConfigurationError: No destination is configured and no such actor exists.
    """
    actor_name, space = _actor_name(name), _namespace(namespace)
    if destination is None:
        try:
            destination = destination_from_env()
        except ConfigurationError:
            try:
                return ray.get_actor(actor_name, namespace=space)
            except ValueError:
                raise ConfigurationError(
                    f"no trajtrack tracker actor {actor_name!r} in Ray namespace {space!r}, and "
                    "no destination to create one: set TRAJTRACK_DIR or VERL_TRACKER_HDFS_DIR"
                ) from None
    options = {
        **_ACTOR_DEFAULTS,
        **(actor_options or {}),
        "name": actor_name,
        "namespace": space,
        "get_if_exists": True,
        "lifetime": "detached",
    }
    return _RemoteTrackerActor.options(**options).remote(
        _absolute(os.fspath(destination)),
        {**tracker_options_from_env(), **tracker_options},
        _channel_mode() != "off",
    )


def _channel_mode() -> str:
    mode = os.environ.get(CHANNEL_VAR, "auto").strip().lower() or "auto"
    if mode not in CHANNEL_MODES:
        raise ConfigurationError(
            f"{CHANNEL_VAR}={mode!r}: expected one of {', '.join(CHANNEL_MODES)}"
        )
    return mode


@dataclass
class _Cached:
    handle: Any
    job_id: str
    channel: ChannelClient | None = None


_cache: dict[tuple[str, str], _Cached] = {}
_cache_lock = threading.Lock()
_identity: Who | None = None


def _current_actor(name: str | None = None, namespace: str | None = None) -> Any:
    return _current(name, namespace).handle


def _current(name: str | None = None, namespace: str | None = None) -> _Cached:
    key = (_actor_name(name), _namespace(namespace))
    cached = _cache.get(key)
    if (
        cached is not None
        and ray.is_initialized()
        and cached.job_id == ray.get_runtime_context().get_job_id()
    ):
        return cached
    with _cache_lock:
        cached = _cache.get(key)
        if cached is not None and cached.job_id == ray.get_runtime_context().get_job_id():
            return cached  # another thread looked it up meanwhile
        _limits()  # a bad setting fails the first dump, not only the first one that waits
        handle = get_trajectory_tracker(name=key[0], namespace=key[1])
        info = ray.get(handle.ready.remote())  # once per process: surfaces a bad destination
        _warn_if_other_destination(info, key)
        fresh = _Cached(handle, ray.get_runtime_context().get_job_id(), _open_channel(info))
        old = _cache.get(key)
        if old is not None and old.channel is not None:
            old.channel.close()
        _cache[key] = fresh
        return fresh


def _open_channel(info: dict[str, Any]) -> ChannelClient | None:
    """The client for the actor's channel, or ``None`` (off, or the actor has none)."""
    mode = _channel_mode()
    if mode == "off" or not info.get("channel"):
        return None
    endpoints = Endpoints.from_dict(info["channel"])
    local = mode == "auto" and endpoints.node_id == ray.get_runtime_context().get_node_id()
    try:
        return ChannelClient(endpoints, _who(), local=local, reply_timeout=_limits()[2])
    except ChannelBrokenError as exc:
        logger.warning("trajtrack.ray: %s; sending dumps as Ray calls", exc)
        return None


def _channel_failed(cached: _Cached, exc: ChannelBrokenError) -> None:
    """Stop using a failed channel in this process; the dump goes as a Ray call instead."""
    channel, cached.channel = cached.channel, None
    if channel is not None:
        logger.warning(
            "trajtrack.ray: the channel to the tracker actor failed (%s); this process sends "
            "its dumps to that actor as Ray calls from now on (a replacement actor, or Ray "
            "initialized again, gets a new channel)",
            exc,
        )
        channel.close()


def _warn_if_other_destination(info: dict[str, Any], key: tuple[str, str]) -> None:
    try:
        wanted = _absolute(destination_from_env())
    except ConfigurationError:
        return
    if info["destination"] != wanted:
        logger.warning(
            "the trajtrack tracker actor %r (namespace %r) already writes to %s; "
            "this process asked for %s, which is ignored",
            key[0],
            key[1],
            info["destination"],
            wanted,
        )


def _forget(name: str | None = None, namespace: str | None = None) -> None:
    with _cache_lock:
        cached = _cache.pop((_actor_name(name), _namespace(namespace)), None)
    if cached is not None and cached.channel is not None:
        cached.channel.close()


def _who() -> Who:
    """This process's identity as the actor wants it (a tuple: cheaper to pickle per call)."""
    global _identity
    identity = _identity
    if identity is None:  # reset in a forked child (_forget_after_fork)
        me = WriterIdentity.current()
        identity = _identity = (me.host, me.pid, me.rank, me.local_rank, me.world_size)
    return identity


# --------------------------------------------------------------------------- dumping


_Snapshot = bytes | ObjectPayload | Captured
"""A pipelined dump in the send buffer: serialized, copied objects, or captured plain data."""


def _serialized(payload: _Snapshot) -> bytes:
    """A pipelined snapshot as a Ray call carries it: ``torch.save`` bytes."""
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, Captured):  # captured for a channel that has failed since
        encoded = bytearray().join(payload.encoded().parts)  # decode wants it writable
        payload = ObjectPayload(decode(encoded)[0], payload.nbytes)
    buffer = io.BytesIO()
    payload.write_to(buffer)
    return buffer.getvalue()


def _on_the_wire(payload: _Snapshot) -> Payload:
    """A pipelined snapshot as the channel sends it: plain data encoded, else serialized."""
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, Captured):
        return payload.encoded()
    try:
        return encode(payload.materialize())
    except NotPlainError:
        return _serialized(payload)


def _payload_for_channel(data: Any) -> Payload:
    """An acknowledged dump for the channel: plain data encoded in place, else serialized."""
    try:
        return encode(data)
    except NotPlainError:
        return _serialize(data)
    except RuntimeError as exc:  # e.g. a tensor on a device that is gone
        raise SerializationError(f"could not read a tensor for the dump: {exc}") from exc


def _serialize(obj: Any) -> bytes:
    """The snapshot, taken in the caller's process with the core's serializer."""
    buffer = io.BytesIO()
    try:
        torch_save(obj, buffer)
    except Exception as exc:
        raise SerializationError(
            f"could not serialize {type(obj).__name__} for the dump: {exc}"
        ) from exc
    return buffer.getvalue()


def _pipelined_by_default() -> bool:
    return getenv(PIPELINED_VAR) == "1"


def _positive_from_env(var: str, default: float, kind: type[int] | type[float]) -> Any:
    raw = getenv(var)
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigurationError(f"{var}={raw!r} must be a positive number")
    return value


def _limits() -> tuple[int, int, float]:
    return (
        _positive_from_env(MAX_IN_FLIGHT_VAR, DEFAULT_MAX_IN_FLIGHT, int),
        _positive_from_env(MAX_IN_FLIGHT_BYTES_VAR, DEFAULT_MAX_IN_FLIGHT_BYTES, int),
        _positive_from_env(FULL_TIMEOUT_VAR, DEFAULT_FULL_TIMEOUT, float),
    )


def dump_data(data: Any, name: str, *, wait: bool | None = None) -> None:
    """Dump *data* as *name* through the cluster's tracker actor; a no-op unless enabled.

    The original's signature and switch: enabled by ``VERL_ENABLE_TRACKER=1`` (or
    ``TRAJTRACK_ENABLE=1``); destination from ``TRAJTRACK_DIR``/``VERL_TRACKER_HDFS_DIR``
    (used when this call creates the actor). *data* is serialized here, so changing it after
    the call returns does not change what is stored.

    Args:
        data: Anything ``torch.save`` accepts.
        name: A relative dump name such as ``"step3/rank0_obs"``.
        wait: ``True``: return when the actor has the dump (acknowledged); ``False``: return
            once the bytes are in this process's send buffer (pipelined, see
            :func:`wait_for_own_dumps`). Default: pipelined when ``TRAJTRACK_RAY_PIPELINED=1``,
            else acknowledged. A pipelined dump of CPU plain data over 64 MiB going over the
            channel is sent as an acknowledged one instead (after this process's earlier
            pipelined dumps): copying it would cost the caller as much.

    Raises:
        InvalidNameError: *name* is not a safe relative dump name (nothing was sent).
        SerializationError: *data* cannot be serialized.
        TimeoutError: Pipelined: this process's in-flight bound stayed full for
            ``TRAJTRACK_RAY_FULL_TIMEOUT`` seconds (nothing was buffered).
        Exception: Acknowledged (and a pipelined dump sent as one): the actor's error (e.g.
            ``TrackerClosedError``).
    """
    if not is_enabled():
        return
    validate_name(name)
    if wait is None:
        wait = not _pipelined_by_default()
    if wait:
        _send_acknowledged(data, name)
        return
    actor = (_actor_name(None), _namespace(None))  # bound now, not when the sender sends
    cached = _cache.get(actor)
    if cached is None:
        cached = _current(*actor)  # look up / create in the caller: a bad setup raises here
    snapshot, nbytes = _snapshot(data, channel=cached.channel is not None)
    if snapshot is None:  # too big to copy: sending it costs the caller less
        _sender.wait_settled(_limits()[2])  # this process's earlier dumps go first
        _send_acknowledged(data, name)
        return
    _sender.put(snapshot, nbytes, name, _who(), actor)


def _snapshot(data: Any, *, channel: bool) -> tuple[_Snapshot | None, int]:
    """Pipelined: a copy of *data* that later mutation cannot reach.

    * Plain data (nested dicts/lists/tuples of tensors, arrays and scalars) on the CPU, for
      the channel, is taken apart for the wire right here with its tensors' bytes copied (no
      serializer, nothing laid out): the sender thread encodes and writes it. Over
      :data:`SEND_NOW_MIN_BYTES` nothing is copied and ``(None, 0)`` is returned: the caller
      sends it now instead.
    * Other plain data is copied as the core tracker does (a CUDA tensor without making the
      caller wait for the device), and encoded or serialized by the sender thread.
    * Anything else is serialized right here.
    """
    if channel:
        try:
            captured = capture(data, copy=True, copy_max_bytes=SEND_NOW_MIN_BYTES)
        except NotPlainError:
            pass  # not plain data, or a tensor on a device: as below
        except RuntimeError as exc:
            raise SerializationError(f"could not read a tensor for the dump: {exc}") from exc
        else:
            return (captured, captured.nbytes) if captured is not None else (None, 0)
    try:
        nbytes = measure_plain(data)
    except NotPlainError:
        payload = _serialize(data)
        return payload, len(payload)
    if nbytes > PLAIN_COPY_MAX_BYTES:
        payload = _serialize(data)
        return payload, len(payload)
    return snapshot_plain(data, nbytes), nbytes


def _send_acknowledged(data: Any, name: str) -> None:
    # A cached channel needs no check with Ray (two Ray API calls per dump otherwise): it
    # talks to the actor itself, and if the actor is gone it breaks, and the Ray call below
    # (which does check) finds out.
    cached = _cache.get((_actor_name(None), _namespace(None)))
    if cached is None or cached.channel is None:
        cached = _current()
    channel = cached.channel
    if channel is not None:
        # Sent before this returns, so plain data needs no copy: its bytes go out as they are.
        on_the_wire = _payload_for_channel(data)
        try:
            channel.dump(on_the_wire, name)
            return
        except ChannelBrokenError as exc:  # maybe the actor is gone: the Ray call finds out
            _channel_failed(cached, exc)
        payload = on_the_wire if isinstance(on_the_wire, bytes) else _serialize(data)
    else:
        payload = _serialize(data)
    who = _who()
    _call_with_retry(lambda actor: ray.get(actor.dump.remote(payload, name, who)))


def _call_with_retry(call: Any) -> Any:
    """Run ``call(actor)``; if the cached actor is gone, look it up (or create it) once more."""
    try:
        return call(_current_actor())
    except ray.exceptions.RayActorError as exc:
        logger.warning("the trajtrack tracker actor is unavailable (%s); looking it up again", exc)
        _forget()
        return call(_current_actor())


# --------------------------------------------------------------------------- pipelined mode


@dataclass(slots=True)
class _Item:
    seq: int
    payload: _Snapshot
    nbytes: int
    name: str
    who: Who
    actor: tuple[str, str]  # (name, namespace), as configured when dump_data was called


@dataclass
class _Batch:
    first_seq: int
    items: int
    nbytes: int


class _Sender:
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
        payload: _Snapshot,
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
        max_items, max_bytes, timeout = _limits()  # as the environment says now
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
        cached = _current(*actor)
        if cached.channel is not None:
            items, failures = self._over_channel(cached, items)
            if not items:
                self._settle(batch_id, failures)
                return
        payloads: list[bytes] = []
        names: list[str] = []
        for index, item in enumerate(items):
            try:
                payloads.append(_serialized(item.payload))
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
            ref = _current_actor(*actor).dump_many.remote(payloads, names, who)
        except ray.exceptions.RayActorError as exc:
            logger.warning("the trajtrack tracker actor is unavailable (%s); looking it up", exc)
            _forget(*actor)
            ref = _current_actor(*actor).dump_many.remote(payloads, names, who)
        ref.future().add_done_callback(
            lambda done: self._on_done(batch_id, actor, len(payloads), failures, done)
        )

    @staticmethod
    def _over_channel(
        cached: _Cached, items: list[_Item]
    ) -> tuple[list[_Item], list[tuple[int, BaseException]]]:
        """Send a batch on the channel, in order; return what is left for Ray, and failures."""
        assert cached.channel is not None
        frames: list[tuple[Payload, str]] = []
        sent: list[_Item] = []
        failures: list[tuple[int, BaseException]] = []
        for index, item in enumerate(items):
            try:
                frames.append((_on_the_wire(item.payload), item.name))
            except Exception as exc:
                failures.append((index, exc))
            else:
                sent.append(item)
        try:
            refused = cached.channel.dump_many(frames)
        except ChannelBrokenError as exc:  # the unanswered rest goes as Ray calls
            _channel_failed(cached, exc)
            return sent[exc.replies :], [*failures, *exc.failures]
        for item in sent:
            item.payload = b""
        return [], [*failures, *refused]

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
                _forget(*actor)
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


_sender = _Sender()


def own_dumps_in_flight() -> int:
    """How many pipelined dumps of this process the actor has not acknowledged yet.

    Counts both those still in this process's send buffer and those sent but not yet
    acknowledged.
    """
    return _sender.in_flight()


def wait_for_own_dumps(timeout: float | None = None) -> None:
    """Wait until the actor has every pipelined dump this process made before the call.

    Covers the dumps still in the send buffer and those sent but not acknowledged. Afterwards
    a ``flush`` from any process covers them. Call it at the end of a task or worker that used
    the pipelined mode.

    Raises:
        TimeoutError: Not all were acknowledged within *timeout* seconds (they stay tracked).
        Exception: The first error the actor returned for a pipelined dump since the last
            call (with a note counting the others), raised once.
    """
    _sender.wait(timeout)


def _drain_at_exit() -> None:
    if not _sender.in_flight() or not ray.is_initialized():
        return
    try:
        _sender.wait(exit_timeout_from_env())
    except Exception as exc:
        logger.error("trajtrack: pipelined dumps not delivered before exit: %s", exc)


# --------------------------------------------------------------------------- driver helpers


def flush(
    timeout: float | None = None, *, name: str | None = None, namespace: str | None = None
) -> None:
    """Wait for this process's pipelined dumps, then for everything the actor has.

    The blocking form of ``ray.get(get_trajectory_tracker().flush.remote(timeout))``.

    Raises:
        TimeoutError: Not everything was written within *timeout* seconds.
        Exception: The first dump failure since the previous flush of the actor.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    _sender.wait(timeout)
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    actor = _current_actor(name, namespace)
    ray.get(actor.flush.remote(left))


def shutdown(
    timeout: float | None = None, *, name: str | None = None, namespace: str | None = None
) -> None:
    """Drain and close the tracker actor, then kill it (it is detached: nothing else does).

    Does nothing when the actor does not exist.

    Raises:
        TimeoutError: Pending dumps were not written within *timeout* seconds.
        Exception: The first dump failure since the previous flush.
    """
    actor_name, space = _actor_name(name), _namespace(namespace)
    _sender.wait(timeout)
    try:
        actor = ray.get_actor(actor_name, namespace=space)
    except ValueError:
        return
    try:
        ray.get(actor.close.remote(timeout))
    finally:
        ray.kill(actor)
        _forget(actor_name, space)


def _forget_after_fork() -> None:
    global _cache_lock, _identity, _sender
    for cached in _cache.values():
        if cached.channel is not None:
            cached.channel.abandon_after_fork()
    _cache.clear()
    _cache_lock = threading.Lock()
    _identity = None
    _sender = _Sender()  # the sender thread is not inherited; nor are the parent's dumps


os.register_at_fork(after_in_child=_forget_after_fork)
