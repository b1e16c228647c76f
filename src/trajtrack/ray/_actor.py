"""The tracker actor: one asyncio :class:`~trajtrack.Tracker` living in an async Ray actor.

Callers snapshot (serialize) in their own process and send the bytes; the actor queues them on
its tracker without re-serializing, and the tracker's upload workers write them from the
actor's event loop (not one Ray task per file, as verl's original did). Every method is a
coroutine, so Ray runs them all on the actor's single event loop, the one the tracker was
started on. The bytes arrive either as a Ray call (:meth:`TrackerActor.dump`,
:meth:`TrackerActor.dump_many`) or, much cheaper, over the actor's direct channel
(:mod:`trajtrack.ray._server`), whose listeners run on the same loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import socket
import uuid
from collections.abc import Sequence
from typing import Any

from trajtrack._exceptions import SerializationError, TrackerClosedError
from trajtrack.layouts.names import WriterIdentity
from trajtrack.ray._bounds import ChannelLimits
from trajtrack.ray._protocol import KIND_PLAIN, Who
from trajtrack.ray._server import ChannelServer
from trajtrack.ray._wire_decode import parse, skeleton_size
from trajtrack.tracker import Tracker, TrackerState, TrackerStatistics

__all__ = ["TrackerActor", "Who"]

logger = logging.getLogger(__name__)

# Who: a writer's identity as it travels to the actor, ``(host, pid, rank, local_rank,
# world_size)``. A plain tuple pickles faster than the dataclass; the actor rebuilds the
# WriterIdentity (cached per distinct writer).

_WHO_CACHE_LIMIT = 4096
_PARSE_INLINE_MAX = 64 << 10
"""Plain payloads whose skeleton is up to this size are checked on the event loop (tens of
microseconds; the tensors' bytes are not touched, however large)."""
_TRACKER_PENDING_BYTES = inspect.signature(Tracker).parameters["max_pending_bytes"].default
"""The tracker's own default budget: the channel's byte limits follow the tracker's."""


class TrackerActor:
    """The body of the named, detached tracker actor (wrap it with ``ray.remote``).

    The tracker starts on the first call (an async actor has no event loop in ``__init__``);
    if starting fails (e.g. the destination is unusable) the call raises that error and the
    next call tries again with a fresh tracker.

    Args:
        destination: Where the tracker writes (a path or URL, as seen from the actor's node).
        options: Keyword arguments for :class:`~trajtrack.Tracker`.
        channel: Open the direct channel (a Unix socket on the actor's node; no network port)
            when the tracker starts; without it every dump is a Ray call.
    """

    def __init__(self, destination: str, options: dict[str, Any], channel: bool = True) -> None:
        self._destination = destination
        self._want_channel = channel
        self._channel: ChannelServer | None = None
        self._options = dict(options)
        self._tracker: Tracker | None = None
        self._start_lock = asyncio.Lock()  # binds to the actor's loop on first use
        self._closed = False
        self._token = uuid.uuid4().hex  # tells one actor incarnation from another
        self._own_identity = WriterIdentity.current()
        self._identities: dict[Who, WriterIdentity] = {}
        # Batches of one writer are admitted one batch at a time, in the order they arrive
        # (Ray starts one caller's calls in order; this keeps them in order past a full queue).
        self._batch_locks: dict[Who, tuple[asyncio.Lock, list[int]]] = {}

    def _identity(self, who: WriterIdentity | Who | None) -> WriterIdentity:
        if isinstance(who, WriterIdentity):
            return who
        if who is None:
            return self._own_identity
        identity = self._identities.get(who)
        if identity is None:
            if len(self._identities) >= _WHO_CACHE_LIMIT:
                self._identities.clear()
            identity = self._identities[who] = WriterIdentity(*who)
        return identity

    async def _running(self) -> Tracker:
        tracker = self._tracker
        if tracker is not None and tracker.state is TrackerState.RUNNING:
            return tracker
        if self._closed:
            raise TrackerClosedError("the trajtrack tracker actor is closed")
        async with self._start_lock:
            if self._tracker is None:
                fresh = Tracker(self._destination, **self._options)
                await fresh.start()  # on failure nothing is kept: the next call retries
                self._tracker = fresh
            return self._tracker

    async def ready(self) -> dict[str, Any]:
        """Start the tracker (and the channel) if needed; describe this actor.

        Returns:
            ``destination``, ``pid``, ``host``, ``token`` (this incarnation) and ``channel``:
            the channel's endpoints and secret (see :class:`~trajtrack.ray._protocol.Endpoints`)
            or ``None`` when the actor has none.
        """
        await self._running()
        channel = await self._channel_endpoints()
        return {
            "destination": self._destination,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "token": self._token,
            "channel": channel,
        }

    async def _channel_endpoints(self) -> dict[str, Any] | None:
        if not self._want_channel or self._closed:
            return None
        async with self._start_lock:
            if self._channel is None:
                import ray  # the actor runs in Ray; the module itself does not need it

                budget = int(self._options.get("max_pending_bytes", _TRACKER_PENDING_BYTES))
                self._channel = ChannelServer(
                    self._admit_frame,
                    node_id=ray.get_runtime_context().get_node_id(),
                    limits=ChannelLimits().for_tracker(budget),
                )
                if await self._channel.start() is None:
                    self._want_channel = False
                    return None
            endpoints = self._channel.endpoints
        assert endpoints is not None  # started above, or by an earlier call
        return endpoints.as_dict()

    async def _tracker_now(self) -> Tracker:
        tracker = self._tracker
        if tracker is None or tracker.state is not TrackerState.RUNNING:
            tracker = await self._running()
        return tracker

    async def _admit(self, data: bytes, name: str, who: WriterIdentity | Who | None) -> None:
        tracker = await self._tracker_now()
        await tracker.dump_serialized(data, name, writer=self._identity(who))

    async def _admit_frame(self, kind: int, payload: bytearray, name: str, who: Who) -> None:
        """A request from the channel: serialized bytes, or plain data to rebuild here."""
        if kind != KIND_PLAIN:
            await self._admit(payload, name, who)  # type: ignore[arg-type]  # bytes-like
            return
        try:
            if skeleton_size(payload) > _PARSE_INLINE_MAX:  # parse a big one off the loop
                decoded = await asyncio.to_thread(parse, payload)
            else:
                decoded = parse(payload)
        except ValueError as exc:
            raise SerializationError(f"{name}: the plain-data payload is invalid: {exc}") from exc
        tracker = await self._tracker_now()
        # Checked, not built: the upload worker makes the tensors (torch calls) in its thread.
        await tracker.dump_decoded(decoded.build, decoded.nbytes, name, writer=self._identity(who))

    async def channel_statistics(self) -> dict[str, int]:
        """What the direct channel has seen: connections, refused, busy, dumps, errors."""
        return self._channel.counters.as_dict() if self._channel else {}

    async def dump(self, data: bytes, name: str, who: WriterIdentity | Who | None = None) -> None:
        """Queue *data* (already serialized by the caller) as *name* for the writer *who*.

        Returns once the dump is admitted to the tracker's queue (it waits for space when the
        queue is full), so a later :meth:`flush` from any process covers it.

        Args:
            data: The serialized dump (``torch.save`` output).
            name: The dump name, before the name template.
            who: The writing process (a ``WriterIdentity`` or its
                ``(host, pid, rank, local_rank, world_size)`` tuple); default: the actor's.
        """
        await self._admit(data, name, who)

    async def dump_many(
        self, data: Sequence[bytes], names: Sequence[str], who: Who
    ) -> list[tuple[int, BaseException]]:
        """Queue a batch of serialized dumps of one writer, in order (the pipelined sender).

        Every dump is tried, even when an earlier one fails; the failures come back as values.

        Args:
            data: The serialized dumps.
            names: Their names, one per entry of *data*.
            who: The writing process, ``(host, pid, rank, local_rank, world_size)``.

        Returns:
            ``(index, exception)`` for each dump that was not admitted; empty when all were.

        Raises:
            Exception: The tracker could not be started (none of the dumps was admitted).
        """
        if len(data) != len(names):
            raise ValueError(f"dump_many: {len(data)} payloads but {len(names)} names")
        tracker = await self._running()
        identity = self._identity(who)
        lock, users = self._batch_locks.setdefault(who, (asyncio.Lock(), [0]))
        users[0] += 1
        failures: list[tuple[int, BaseException]] = []
        try:
            async with lock:
                for index, (payload, name) in enumerate(zip(data, names, strict=True)):
                    try:
                        await tracker.dump_serialized(payload, name, writer=identity)
                    except Exception as exc:
                        failures.append((index, exc))
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._batch_locks[who]
        return failures

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every dump the actor has received is written; re-raise a failure.

        The first failure since the previous flush is raised to whoever flushes first.
        """
        tracker = await self._running()
        await tracker.flush(timeout)

    async def wait_for_hdfs(self, timeout: float | None = None) -> None:
        """The original tracker's name for :meth:`flush`."""
        await self.flush(timeout)

    async def statistics(self) -> TrackerStatistics:
        """The tracker's counters (see :meth:`trajtrack.Tracker.statistics`)."""
        return (await self._running()).statistics()

    async def close(self, timeout: float | None = None) -> None:
        """Drain what is pending, write the record and stop accepting dumps; idempotent.

        The actor process stays until it is killed (``trajtrack.ray.shutdown`` does both).
        """
        self._closed = True
        async with self._start_lock:
            tracker, channel = self._tracker, self._channel
        if channel is not None:
            await channel.aclose()  # callers fall back to Ray calls, which say "closed"
        if tracker is not None:
            await tracker.aclose(timeout)
