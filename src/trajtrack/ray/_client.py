"""The caller's side: the public functions, and which snapshot a dump gets before it is sent.

Two ways to send a dump:

* **acknowledged** (default): ``dump_data`` returns once the actor has admitted the dump, so a
  ``flush`` from *any* process afterwards covers it (Ray orders the calls of one caller, not
  those of different callers). One round trip per dump, the bytes shipped once. Admitted is
  not written: the actor's tracker writes it later (in the shards layout, when its shard is
  sealed and committed); ``flush`` waits for that.
* **pipelined** (``wait=False`` or ``TRAJTRACK_RAY_PIPELINED=1``): the caller only takes a
  snapshot and appends it to a per-process send buffer; a background thread ships the buffer
  to the actor in batches (:mod:`trajtrack.ray._sender`). At most ``max_in_flight`` dumps (and
  bytes) per process unacknowledged, buffered or sent, beyond which callers wait;
  :func:`wait_for_own_dumps` waits for this process's own. A flush from *another* process does
  not cover dumps still in flight here.

On the actor's node both send through the actor's direct channel
(:mod:`trajtrack.ray._connection`: a Unix socket) whose path and secret the process learns
with one Ray call; from other nodes, with ``TRAJTRACK_RAY_CHANNEL=off``, for a payload over the
channel's limit, and in a process whose channel failed (it logs why, once), a dump is a Ray
call (``dump`` / ``dump_many``), which carries Ray's own TLS and authentication. Finding the
actor, and caching it per process, is :mod:`trajtrack.ray._discovery`'s; the settings are
:mod:`trajtrack.ray._config`'s.
"""

from __future__ import annotations

import io
import logging
import os
import time
from typing import Any

import ray
import ray.exceptions

from trajtrack._exceptions import SerializationError
from trajtrack.layouts.names import validate_name
from trajtrack.ray._config import actor_key, limits, pipelined_by_default
from trajtrack.ray._discovery import (
    answer,
    cached,
    channel_failed,
    current,
    current_actor,
    forget,
    get_or_create_actor,
    process_identity,
    wait_until_released,
)
from trajtrack.ray._protocol import ChannelBrokenError, Payload, payload_size
from trajtrack.ray._sender import Snapshot, sender
from trajtrack.ray._wire_encode import capture, encode
from trajtrack.tracker import (
    NotPlainError,
    is_enabled,
    measure_plain,
    snapshot_plain,
    torch_save,
)

__all__ = [
    "dump_data",
    "flush",
    "get_trajectory_tracker",
    "own_dumps_in_flight",
    "shutdown",
    "wait_for_own_dumps",
]

logger = logging.getLogger(__name__)

SEND_NOW_MIN_BYTES = 64 << 20
"""A pipelined dump of CPU plain data over this size is not copied: after this process's earlier
pipelined dumps are acknowledged it is sent like an acknowledged one, before ``dump_data``
returns. Copying that much costs the caller as much as sending it (fresh memory: page faults),
and would double the memory it holds."""
PLAIN_COPY_MAX_BYTES = 8 << 20
"""Pipelined plain data up to this size is copied by the caller and serialized by the sender
thread; larger objects are serialized by the caller (no second in-memory copy)."""


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
    return get_or_create_actor(destination, name, namespace, actor_options, tracker_options)


def dump_data(data: Any, name: str, *, wait: bool | None = None) -> None:
    """Dump *data* as *name* through the cluster's tracker actor; a no-op unless enabled.

    The original's signature and switch: enabled by ``VERL_ENABLE_TRACKER=1`` (or
    ``TRAJTRACK_ENABLE=1``); destination from ``TRAJTRACK_DIR``/``VERL_TRACKER_HDFS_DIR``
    (used when this call creates the actor). *data* is serialized here, so changing it after
    the call returns does not change what is stored.

    Args:
        data: Anything ``torch.save`` accepts.
        name: A relative dump name such as ``"step3/rank0_obs"``.
        wait: ``True``: return when the actor has admitted the dump to its tracker's queue
            (acknowledged; it is written later, in the shards layout when its shard is
            committed: :func:`flush` waits for that); ``False``: return once the bytes are in
            this process's send buffer (pipelined, see :func:`wait_for_own_dumps`). Default:
            pipelined when ``TRAJTRACK_RAY_PIPELINED=1``, else acknowledged. A pipelined dump
            of CPU plain data over 64 MiB going over the channel is sent as an acknowledged
            one instead (after this process's earlier pipelined dumps): copying it would cost
            the caller as much.

    Raises:
        InvalidNameError: *name* is not a safe relative dump name (nothing was sent).
        SerializationError: *data* cannot be serialized.
        TimeoutError: Pipelined: this process's in-flight bound stayed full for
            ``TRAJTRACK_RAY_FULL_TIMEOUT`` seconds (nothing was buffered). Acknowledged: the
            actor did not answer within as long (the dump may still be admitted).
        Exception: Acknowledged (and a pipelined dump sent as one): the actor's error (e.g.
            ``TrackerClosedError``).
    """
    if not is_enabled():
        return
    validate_name(name, new=True)
    if wait is None:
        wait = not pipelined_by_default()
    if wait:
        _send_acknowledged(data, name)
        return
    actor = actor_key()  # bound now, not when the sender sends
    entry = cached(actor)
    if entry is None:
        entry = current(*actor)  # look up / create in the caller: a bad setup raises here
    snapshot, nbytes = _snapshot(data, channel=entry.channel is not None)
    if snapshot is None:  # too big to copy: sending it costs the caller less
        sender().wait_settled(limits()[2])  # this process's earlier dumps go first
        _send_acknowledged(data, name)
        return
    sender().put(snapshot, nbytes, name, process_identity(), actor)


def _snapshot(data: Any, *, channel: bool) -> tuple[Snapshot | None, int]:
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


def _send_acknowledged(data: Any, name: str) -> None:
    # A cached channel needs no check with Ray (two Ray API calls per dump otherwise): it
    # talks to the actor itself, and if the actor is gone it breaks, and the Ray call below
    # (which does check) finds out.
    entry = cached(actor_key())
    if entry is None or entry.channel is None:
        entry = current()
    channel = entry.channel
    if channel is not None:
        # Sent before this returns, so plain data needs no copy: its bytes go out as they are.
        on_the_wire = _payload_for_channel(data)
        if channel.carries(payload_size(on_the_wire)):
            try:
                channel.dump(on_the_wire, name)
                return
            except ChannelBrokenError as exc:  # maybe the actor is gone: the Ray call finds out
                channel_failed(entry, exc)
        payload = on_the_wire if isinstance(on_the_wire, bytes) else _serialize(data)
    else:
        payload = _serialize(data)
    who = process_identity()
    _call_with_retry(lambda actor: answer(actor.dump.remote(payload, name, who), repr(name)))


def _call_with_retry(call: Any) -> Any:
    """Run ``call(actor)``; if the cached actor is gone, look it up (or create it) once more."""
    try:
        return call(current_actor())
    except ray.exceptions.RayActorError as exc:
        logger.warning("the trajtrack tracker actor is unavailable (%s); looking it up again", exc)
        forget()
        return call(current_actor())


def own_dumps_in_flight() -> int:
    """How many pipelined dumps of this process the actor has not acknowledged yet.

    Counts both those still in this process's send buffer and those sent but not yet
    acknowledged.
    """
    return sender().in_flight()


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
    sender().wait(timeout)


def flush(
    timeout: float | None = None, *, name: str | None = None, namespace: str | None = None
) -> None:
    """Wait for this process's pipelined dumps, then for everything the actor has.

    The blocking form of ``ray.get(get_trajectory_tracker().flush.remote(timeout))``. In the
    shards layout this is what commits the open shard (short of its size or age limit).

    Raises:
        TimeoutError: Not everything was written within *timeout* seconds.
        Exception: The first dump failure since the previous flush of the actor.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    sender().wait(timeout)
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    actor = current_actor(name, namespace)
    ray.get(actor.flush.remote(left))


def shutdown(
    timeout: float | None = None, *, name: str | None = None, namespace: str | None = None
) -> None:
    """Drain and close the tracker actor, then kill it (it is detached: nothing else does).

    Returns once Ray has let go of the actor's name, so a dump afterwards creates a new actor
    (where a destination is configured) instead of finding the dead one. Does nothing when the
    actor does not exist.

    Raises:
        TimeoutError: Pending dumps were not written within *timeout* seconds, or Ray still
            gave the killed actor for its name after ``TRAJTRACK_RAY_FULL_TIMEOUT`` seconds.
        Exception: The first dump failure since the previous flush.
    """
    actor_name, space = actor_key(name, namespace)
    sender().wait(timeout)
    try:
        actor = ray.get_actor(actor_name, namespace=space)
    except ValueError:
        return
    try:
        ray.get(actor.close.remote(timeout))
    finally:
        ray.kill(actor)  # only sent: the name is let go of when Ray has carried it out
        forget(actor_name, space)
        wait_until_released(actor, (actor_name, space))
