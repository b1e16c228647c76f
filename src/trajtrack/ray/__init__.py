"""trajtrack on Ray: one named, detached tracker actor for the whole cluster.

verl's original semantics on top of the asyncio core: any process of the cluster (any task,
actor or driver, on any node) calls :func:`dump_data`; the bytes go to one named actor whose
:class:`~trajtrack.Tracker` uploads them from its event loop, and which outlives the driver
that created it. Needs the extra: ``pip install 'trajtrack[ray]'``.

Example::

    import trajtrack.ray as tr

    tr.dump_data({"obs": obs}, f"step{step}/obs")  # in any Ray worker (VERL_ENABLE_TRACKER=1)
    tr.flush()  # in the driver: every acknowledged dump is written
"""

from __future__ import annotations

from trajtrack._exceptions import MissingDependencyError

try:
    import ray as _ray  # noqa: F401  (only to fail early, with the install hint)
except ImportError as _exc:
    raise MissingDependencyError(
        f"trajtrack.ray needs Ray ({_exc}): pip install 'trajtrack[ray]'"
    ) from _exc

from trajtrack.ray._actor import TrackerActor as TrackerActor
from trajtrack.ray._client import (
    DEFAULT_ACTOR_NAME as DEFAULT_ACTOR_NAME,
    DEFAULT_NAMESPACE as DEFAULT_NAMESPACE,
    dump_data as dump_data,
    flush as flush,
    get_trajectory_tracker as get_trajectory_tracker,
    own_dumps_in_flight as own_dumps_in_flight,
    shutdown as shutdown,
    wait_for_own_dumps as wait_for_own_dumps,
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
