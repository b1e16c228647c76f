"""Finding the tracker actor: get or create it by name, and cache it (and its channel) per process.

The first dump of a process looks the actor up (or creates it, where a destination is
configured), asks it once for its ``ready()`` description, warns when it writes somewhere else
than this process was told, and opens a client for its direct channel
(:mod:`trajtrack.ray._connection`). The handle, the job it belongs to and the channel client
are cached under ``(name, namespace)``, so a dump makes no named-actor lookup; the entry is
forgotten when Ray is initialized again (another job id), when the actor turns out to be
dead (:func:`forget`), and in a ``fork()``ed child, which also closes the inherited idle
sockets without touching the parent's.

``ray.kill`` only *sends* the kill to Ray's control store: until the store has carried it out,
the name still gives the dead actor, and a get-or-create returns it. So a lookup that finds a
dead actor waits until the name lets go of it (:func:`wait_until_released`) and looks once more,
and :func:`trajtrack.ray.shutdown` waits for the same before it returns. Every wait here is
bounded by ``TRAJTRACK_RAY_FULL_TIMEOUT`` (:func:`answer`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions

from trajtrack._exceptions import ConfigurationError
from trajtrack.layouts.names import WriterIdentity
from trajtrack.ray._actor import TrackerActor
from trajtrack.ray._config import (
    ACTOR_DEFAULTS,
    FULL_TIMEOUT_VAR,
    absolute_destination,
    actor_key,
    channel_mode,
    limits,
)
from trajtrack.ray._connection import ChannelClient
from trajtrack.ray._protocol import ChannelBrokenError, Endpoints, Who
from trajtrack.tracker import destination_from_env, tracker_options_from_env

__all__ = [
    "Cached",
    "answer",
    "cached",
    "channel_failed",
    "current",
    "current_actor",
    "forget",
    "get_or_create_actor",
    "process_identity",
    "wait_until_released",
]

logger = logging.getLogger(__name__)

_RemoteTrackerActor = ray.remote(TrackerActor)


def get_or_create_actor(
    destination: str | os.PathLike[str] | None,
    name: str | None,
    namespace: str | None,
    actor_options: dict[str, Any] | None,
    tracker_options: dict[str, Any],
) -> Any:
    """What :func:`trajtrack.ray.get_trajectory_tracker` does (documented there).

    Raises:
        ConfigurationError: No destination is configured and no such actor exists.
    """
    actor_name, space = actor_key(name, namespace)
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
        **ACTOR_DEFAULTS,
        **(actor_options or {}),
        "name": actor_name,
        "namespace": space,
        "get_if_exists": True,
        "lifetime": "detached",
    }
    return _RemoteTrackerActor.options(**options).remote(
        absolute_destination(os.fspath(destination)),
        {**tracker_options_from_env(), **tracker_options},
        channel_mode() != "off",
    )


@dataclass
class Cached:
    """What this process knows of one actor: its handle, its Ray job, its channel client."""

    handle: Any
    job_id: str
    channel: ChannelClient | None = None


_cache: dict[tuple[str, str], Cached] = {}
_cache_lock = threading.Lock()
_identity: Who | None = None
_owner = os.getpid()


def _this_process() -> None:
    """In a forked child, forget the parent's entries, lock (perhaps held by a thread the
    child does not have) and identity; the parent's sockets stay open for the parent."""
    global _cache_lock, _identity, _owner
    if _owner == os.getpid():
        return
    for entry in _cache.values():
        if entry.channel is not None:
            entry.channel.abandon_after_fork()
    _cache.clear()
    _cache_lock = threading.Lock()
    _identity = None
    _owner = os.getpid()


def cached(key: tuple[str, str]) -> Cached | None:
    """The cached entry for *key* as it is, unchecked: no Ray call (the dump's fast path)."""
    _this_process()
    return _cache.get(key)


def current_actor(name: str | None = None, namespace: str | None = None) -> Any:
    """The actor's handle (see :func:`current`)."""
    return current(name, namespace).handle


def current(name: str | None = None, namespace: str | None = None) -> Cached:
    """The cached entry for the actor, checked against this Ray job; looked up if needed.

    Raises:
        ConfigurationError: A limit is set badly, or the actor cannot be created.
        Exception: The actor's tracker could not start (e.g. an unusable destination).
    """
    key = actor_key(name, namespace)
    _this_process()
    entry = _cache.get(key)
    if (
        entry is not None
        and ray.is_initialized()
        and entry.job_id == ray.get_runtime_context().get_job_id()
    ):
        return entry
    with _cache_lock:
        entry = _cache.get(key)
        if entry is not None and entry.job_id == ray.get_runtime_context().get_job_id():
            return entry  # another thread looked it up meanwhile
        limits()  # a bad setting fails the first dump, not only the first one that waits
        handle, info = _live_actor(key)
        _warn_if_other_destination(info, key)
        fresh = Cached(handle, ray.get_runtime_context().get_job_id(), _open_channel(info))
        old = _cache.get(key)
        if old is not None and old.channel is not None:
            old.channel.close()
        _cache[key] = fresh
        return fresh


def _live_actor(key: tuple[str, str]) -> tuple[Any, dict[str, Any]]:
    """The actor under *key*, got or created, and its ``ready()`` description.

    Asked once per process: it surfaces a bad destination. A dead actor found by name was
    killed and its name not yet let go of (see the module's docstring): wait until it is, then
    get or create once more. A second dead actor is not that race: its error is raised.
    """
    handle = get_or_create_actor(None, key[0], key[1], None, {})
    try:
        return handle, answer(handle.ready.remote(), "ready()")
    except ray.exceptions.RayActorError as exc:
        logger.warning(
            "the trajtrack tracker actor %r found by name is gone (%s); waiting until Ray lets "
            "go of its name, then looking it up again",
            key[0],
            exc,
        )
    wait_until_released(handle, key)
    handle = get_or_create_actor(None, key[0], key[1], None, {})
    return handle, answer(handle.ready.remote(), "ready()")


def answer(ref: Any, what: str) -> Any:
    """``ray.get(ref)``, waiting at most ``TRAJTRACK_RAY_FULL_TIMEOUT`` seconds.

    Raises:
        TimeoutError: No answer in time (what was asked may still be carried out).
        Exception: The actor's error, or Ray's (e.g. ``RayActorError``: the actor is gone).
    """
    timeout = limits()[2]
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"the trajtrack tracker actor did not answer {what} within {timeout:g} s "
            f"(it may still carry it out; {FULL_TIMEOUT_VAR} sets this wait)"
        ) from None


def wait_until_released(handle: Any, key: tuple[str, str]) -> None:
    """Return once the name *key* no longer gives *handle*, a killed actor.

    Ray has no call that waits for a kill to be carried out, so this asks for the name again,
    less and less often, for at most ``TRAJTRACK_RAY_FULL_TIMEOUT`` seconds. Another actor
    under the name (created meanwhile by another process) counts as released.

    Raises:
        TimeoutError: The name still gave the killed actor when the time was up.
    """
    timeout = limits()[2]
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        try:
            if ray.get_actor(key[0], namespace=key[1]) != handle:
                return
        except ValueError:  # no actor by that name: released
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"Ray still gives the killed trajtrack tracker actor {key[0]!r} (namespace "
                f"{key[1]!r}) for its name after {timeout:g} s ({FULL_TIMEOUT_VAR} sets this wait)"
            )
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.5)


def _open_channel(info: dict[str, Any]) -> ChannelClient | None:
    """The client for the actor's channel, or ``None``: off, the actor has none, or it runs
    on another node (its socket is a Unix socket: there, dumps go as Ray calls)."""
    if channel_mode() == "off" or not info.get("channel"):
        return None
    endpoints = Endpoints.from_dict(info["channel"])
    if endpoints.node_id != ray.get_runtime_context().get_node_id():
        return None
    return ChannelClient(endpoints, process_identity(), reply_timeout=limits()[2])


def channel_failed(cached: Cached, exc: ChannelBrokenError) -> None:
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
        wanted = absolute_destination(destination_from_env())
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


def forget(name: str | None = None, namespace: str | None = None) -> None:
    """Drop the cached entry (the actor is gone or replaced); close its channel client."""
    _this_process()
    with _cache_lock:
        entry = _cache.pop(actor_key(name, namespace), None)
    if entry is not None and entry.channel is not None:
        entry.channel.close()


def process_identity() -> Who:
    """This process's identity as the actor wants it (a tuple: cheaper to pickle per call)."""
    global _identity
    _this_process()
    identity = _identity
    if identity is None:  # reset in a forked child (_this_process)
        me = WriterIdentity.current()
        identity = _identity = (me.host, me.pid, me.rank, me.local_rank, me.world_size)
    return identity
