"""trajtrack on Ray: one named, detached tracker actor for the whole cluster.

verl's original semantics on top of the asyncio core: any process of the cluster (any task,
actor or driver, on any node) calls :func:`dump_data`; the bytes go to one named actor whose
:class:`~trajtrack.Tracker` uploads them from its event loop, and which outlives the driver
that created it. Needs the extra: ``pip install 'trajtrack[ray]'``.

Example::

    import trajtrack.ray as tr

    tr.dump_data({"obs": obs}, f"step{step}/obs")  # in any Ray worker (VERL_ENABLE_TRACKER=1)
    tr.flush()  # in the driver: every acknowledged dump is written

Read the modules in this order::

    _client.py       the public functions: dump_data, flush, shutdown, get_trajectory_tracker,
                     wait_for_own_dumps; which snapshot a dump gets before it is sent
    _config.py       what the environment configures: actor name, channel mode, limits
    _discovery.py    finding or creating the named actor; the per-process cache of its handle
                     and channel client; what a fork() forgets
    _sender.py       the pipelined mode: the per-process send buffer and its sender thread
    _actor.py        TrackerActor: the asyncio Tracker inside the detached actor
    _protocol.py     the direct channel's protocol (a Unix socket on the actor's node):
                     frames, statuses, errors, endpoints
    _server.py       the channel's actor side: an asyncio server admitting dumps
    _bounds.py       what the server holds at most: connections, time, a shared byte budget
    _socket_dir.py   the socket's 0700 directory; those of killed actors removed
    _connection.py   the channel's caller side: ChannelClient, a blocking pool of sockets
    _wire.py         the plain-data format on the channel (a JSON skeleton, raw buffers)
    _wire_encode.py  plain data taken apart for the wire (the caller)
    _wire_decode.py  checked and rebuilt from the wire (the actor)
"""

from __future__ import annotations

from trajtrack import _exceptions

try:
    import ray as _ray  # noqa: F401  (only to fail early, with the install hint)
except ImportError as _exc:
    raise _exceptions.MissingDependencyError(
        f"trajtrack.ray needs Ray ({_exc}): pip install 'trajtrack[ray]'"
    ) from _exc

from trajtrack.ray._actor import TrackerActor as TrackerActor
from trajtrack.ray._client import (
    dump_data as dump_data,
    flush as flush,
    get_trajectory_tracker as get_trajectory_tracker,
    own_dumps_in_flight as own_dumps_in_flight,
    shutdown as shutdown,
    wait_for_own_dumps as wait_for_own_dumps,
)
from trajtrack.ray._config import (
    DEFAULT_ACTOR_NAME as DEFAULT_ACTOR_NAME,
    DEFAULT_NAMESPACE as DEFAULT_NAMESPACE,
)

__all__ = [
    "DEFAULT_ACTOR_NAME",
    "DEFAULT_NAMESPACE",
    "TrackerActor",
    "dump_data",
    "flush",
    "get_trajectory_tracker",
    "own_dumps_in_flight",
    "shutdown",
    "wait_for_own_dumps",
]
