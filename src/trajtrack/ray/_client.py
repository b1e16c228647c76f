"""The caller's side: find (or create) the named actor, snapshot, send, and wait as asked.

Two ways to send a dump:

* **acknowledged** (default): ``dump_data`` returns once the actor has admitted the dump, so a
  ``flush`` from *any* process afterwards covers it (Ray orders the calls of one caller, not
  those of different callers). One actor round trip per dump, the bytes shipped once.
* **pipelined** (``wait=False`` or ``TRAJTRACK_RAY_PIPELINED=1``): returns after submission.
  At most ``max_in_flight`` unacknowledged dumps per process (the oldest is waited for beyond
  that); :func:`wait_for_own_dumps` waits for this process's own. A flush from *another*
  process does not cover dumps still in flight here.

The actor handle is cached per process (no named-actor lookup per call), forgotten after
``fork()``, when Ray is re-initialized, and when the actor turns out to be dead.
"""

from __future__ import annotations

import atexit
import collections
import io
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions

from trajtrack._exceptions import ConfigurationError, SerializationError
from trajtrack._names import WriterIdentity, validate_name
from trajtrack._shim import _destination_from_env, _exit_timeout_from_env, is_enabled
from trajtrack._snapshot import torch_save
from trajtrack._tracker import add_note
from trajtrack.backends import scheme_of
from trajtrack.ray._actor import TrackerActor

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

# Dumps blocked on the actor's full queue hold a concurrency slot each; flush/statistics calls
# need free ones, so the limit is far above any sane number of concurrent writers.
_ACTOR_DEFAULTS: dict[str, Any] = {"max_concurrency": 1000, "num_cpus": 0, "max_restarts": 0}

_RemoteTrackerActor = ray.remote(TrackerActor)


# --------------------------------------------------------------------------- finding the actor


def _actor_name(name: str | None) -> str:
    return name or os.environ.get(ACTOR_NAME_VAR) or DEFAULT_ACTOR_NAME


def _namespace(namespace: str | None) -> str:
    return namespace or os.environ.get(NAMESPACE_VAR) or DEFAULT_NAMESPACE


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
            (``name_template``, ``workers``, ``max_pending_bytes``, ...).

    Returns:
        The actor handle: call ``dump``, ``flush`` (``wait_for_hdfs``), ``statistics`` and
        ``close`` with ``.remote()``; ``ray.get`` or ``await`` the result.

    Raises:
        ConfigurationError: No destination is configured and no such actor exists.
    """
    actor_name, space = _actor_name(name), _namespace(namespace)
    if destination is None:
        try:
            destination = _destination_from_env()
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
        _absolute(os.fspath(destination)), tracker_options
    )


@dataclass
class _Cached:
    handle: Any
    job_id: str


_cache: dict[tuple[str, str], _Cached] = {}
_cache_lock = threading.Lock()
_identity: WriterIdentity | None = None


def _current_actor(name: str | None = None, namespace: str | None = None) -> Any:
    key = (_actor_name(name), _namespace(namespace))
    cached = _cache.get(key)
    if (
        cached is not None
        and ray.is_initialized()
        and cached.job_id == ray.get_runtime_context().get_job_id()
    ):
        return cached.handle
    with _cache_lock:
        handle = get_trajectory_tracker(name=key[0], namespace=key[1])
        info = ray.get(handle.ready.remote())  # once per process: surfaces a bad destination
        _warn_if_other_destination(info, key)
        _cache[key] = _Cached(handle, ray.get_runtime_context().get_job_id())
        return handle


def _warn_if_other_destination(info: dict[str, Any], key: tuple[str, str]) -> None:
    try:
        wanted = _absolute(_destination_from_env())
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
        _cache.pop((_actor_name(name), _namespace(namespace)), None)


def _who() -> WriterIdentity:
    global _identity
    identity = _identity
    if identity is None or identity.pid != os.getpid():
        identity = _identity = WriterIdentity.current()
    return identity


# --------------------------------------------------------------------------- dumping


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
    return os.environ.get(PIPELINED_VAR) == "1"


def _max_in_flight() -> int:
    raw = os.environ.get(MAX_IN_FLIGHT_VAR)
    if not raw:
        return DEFAULT_MAX_IN_FLIGHT
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigurationError(f"{MAX_IN_FLIGHT_VAR}={raw!r} must be a positive integer")
    return value


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
            after submission (pipelined, see :func:`wait_for_own_dumps`). Default: pipelined
            when ``TRAJTRACK_RAY_PIPELINED=1``, else acknowledged.

    Raises:
        InvalidNameError: *name* is not a safe relative dump name (nothing was sent).
        SerializationError: *data* cannot be serialized.
        Exception: In acknowledged mode, the actor's error (e.g. ``TrackerClosedError``).
    """
    if not is_enabled():
        return
    validate_name(name)
    payload = _serialize(data)
    who = _who()
    if wait is None:
        wait = not _pipelined_by_default()
    if wait:
        _call_with_retry(lambda actor: ray.get(actor.dump.remote(payload, name, who)))
    else:
        limit = _max_in_flight()
        ref = _call_with_retry(lambda actor: actor.dump.remote(payload, name, who))
        _in_flight.add(ref, limit)


def _call_with_retry(call: Any) -> Any:
    """Run ``call(actor)``; if the cached actor is gone, look it up (or create it) once more."""
    try:
        return call(_current_actor())
    except ray.exceptions.RayActorError as exc:
        logger.warning("the trajtrack tracker actor is unavailable (%s); looking it up again", exc)
        _forget()
        return call(_current_actor())


# --------------------------------------------------------------------------- pipelined mode


class _InFlight:
    """This process's unacknowledged pipelined dumps, oldest first, bounded per process."""

    def __init__(self) -> None:
        self._refs: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._errors = 0
        self._exit_hook = False

    def __len__(self) -> int:
        return len(self._refs)

    def add(self, ref: Any, limit: int) -> None:
        with self._lock:
            self._refs.append(ref)
            if not self._exit_hook:
                self._exit_hook = True
                atexit.register(_drain_at_exit)
            # Backpressure: Ray runs one caller's calls to an actor in order, so waiting for
            # the oldest is waiting for the first to finish.
            while len(self._refs) > limit:
                self._settle(self._refs.popleft(), None)

    def _settle(self, ref: Any, timeout: float | None) -> None:
        try:
            ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise
        except Exception as exc:
            logger.warning("a pipelined trajtrack dump failed: %s", exc)
            self._errors += 1
            if self._error is None:
                self._error = exc

    def wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._refs:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    self._settle(self._refs[0], left)
                except ray.exceptions.GetTimeoutError:
                    raise TimeoutError(
                        f"{len(self._refs)} pipelined dumps of this process were not "
                        f"acknowledged within {timeout} s"
                    ) from None
                self._refs.popleft()
            error, count = self._error, self._errors
            self._error, self._errors = None, 0
        if error is not None:
            if count > 1:
                add_note(error, f"trajtrack: {count - 1} more pipelined dumps failed")
            raise error

    def forget(self) -> None:
        self._refs = collections.deque()
        self._lock = threading.Lock()
        self._error, self._errors = None, 0


_in_flight = _InFlight()


def own_dumps_in_flight() -> int:
    """How many pipelined dumps of this process the actor has not acknowledged yet."""
    return len(_in_flight)


def wait_for_own_dumps(timeout: float | None = None) -> None:
    """Wait until the actor has every pipelined dump this process submitted.

    Afterwards a ``flush`` from any process covers them. Call it at the end of a task or
    worker that used the pipelined mode.

    Raises:
        TimeoutError: Not all were acknowledged within *timeout* seconds (they stay tracked).
        Exception: The first error the actor returned for one of them since the last call.
    """
    _in_flight.wait(timeout)


def _drain_at_exit() -> None:
    if not len(_in_flight) or not ray.is_initialized():
        return
    try:
        _in_flight.wait(_exit_timeout_from_env())
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
    _in_flight.wait(timeout)
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
    _in_flight.wait(timeout)
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
    global _cache_lock, _identity
    _cache.clear()
    _cache_lock = threading.Lock()
    _identity = None
    _in_flight.forget()


os.register_at_fork(after_in_child=_forget_after_fork)
