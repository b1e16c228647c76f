"""Finding the tracker actor: get or create it by name, and cache it (and its channel) per process.

The first dump of a process looks the actor up (or creates it, where a destination is
configured), asks it once for its ``ready()`` description, warns when it writes somewhere else
than this process was told, and opens a client for its direct channel
(:mod:`trajtrack.ray._connection`). The handle, the job it belongs to and the channel client
are cached under ``(name, namespace)``, so a dump makes no named-actor lookup; the entry is
forgotten when Ray is initialized again (another job id), when the actor turns out to be
dead (:func:`forget`), and in a ``fork()``ed child, which also closes the inherited idle
sockets without touching the parent's.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import ray

from trajtrack._exceptions import ConfigurationError
from trajtrack.layouts.names import WriterIdentity
from trajtrack.ray._actor import TrackerActor
from trajtrack.ray._config import (
    ACTOR_DEFAULTS,
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
    "cached",
    "channel_failed",
    "current",
    "current_actor",
    "forget",
    "get_or_create_actor",
    "process_identity",
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
        handle = get_or_create_actor(None, key[0], key[1], None, {})
        info = ray.get(handle.ready.remote())  # once per process: surfaces a bad destination
        _warn_if_other_destination(info, key)
        fresh = Cached(handle, ray.get_runtime_context().get_job_id(), _open_channel(info))
        old = _cache.get(key)
        if old is not None and old.channel is not None:
            old.channel.close()
        _cache[key] = fresh
        return fresh


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
