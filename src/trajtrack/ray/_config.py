"""What configures the Ray adapter: the actor's name and namespace, the channel, the limits.

The variables (all optional):

* ``TRAJTRACK_RAY_ACTOR``, ``TRAJTRACK_RAY_NAMESPACE`` -- the tracker actor's name and Ray
  namespace (default ``"global_tracker"`` in ``"trajtrack"``);
* ``TRAJTRACK_RAY_CHANNEL`` -- ``auto`` or ``off`` (:data:`CHANNEL_MODES`);
* ``TRAJTRACK_RAY_PIPELINED=1`` -- ``dump_data`` is pipelined unless told otherwise;
* ``TRAJTRACK_RAY_MAX_IN_FLIGHT``, ``TRAJTRACK_RAY_MAX_IN_FLIGHT_BYTES`` -- the per-process
  bound on unacknowledged pipelined dumps, and ``TRAJTRACK_RAY_FULL_TIMEOUT`` -- how long a
  caller waits at that bound, and for any answer of the actor (its ``ready()``, an
  acknowledgement over the channel or as a Ray call, Ray letting go of a killed actor's name).

They are read when used, not at import: a process may set them after importing
``trajtrack.ray``. The switch, the destination and the tracker's layout options are the core's
(:func:`trajtrack.tracker.destination_from_env`, :func:`trajtrack.tracker.is_enabled`,
:func:`trajtrack.tracker.tracker_options_from_env`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from trajtrack._environ import getenv
from trajtrack._exceptions import ConfigurationError
from trajtrack.backends import scheme_of

__all__ = [
    "ACTOR_DEFAULTS",
    "ACTOR_NAME_VAR",
    "CHANNEL_MODES",
    "CHANNEL_VAR",
    "DEFAULT_ACTOR_NAME",
    "DEFAULT_FULL_TIMEOUT",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_IN_FLIGHT_BYTES",
    "DEFAULT_NAMESPACE",
    "FULL_TIMEOUT_VAR",
    "MAX_IN_FLIGHT_BYTES_VAR",
    "MAX_IN_FLIGHT_VAR",
    "NAMESPACE_VAR",
    "PIPELINED_VAR",
    "absolute_destination",
    "actor_key",
    "channel_mode",
    "limits",
    "pipelined_by_default",
]

logger = logging.getLogger(__name__)

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
CHANNEL_MODES = ("auto", "off")
"""``auto``: the Unix socket on the actor's node, Ray calls from other nodes; ``off``: no
channel (every dump is a Ray call; also keeps a new actor from listening)."""
FULL_TIMEOUT_VAR = "TRAJTRACK_RAY_FULL_TIMEOUT"
DEFAULT_FULL_TIMEOUT = 300.0

# Dumps blocked on the actor's full queue hold a concurrency slot each; flush/statistics calls
# need free ones, so the limit is far above any sane number of concurrent writers.
ACTOR_DEFAULTS: dict[str, Any] = {"max_concurrency": 1000, "num_cpus": 0, "max_restarts": 0}


def actor_key(name: str | None = None, namespace: str | None = None) -> tuple[str, str]:
    """``(name, namespace)`` of the tracker actor: the arguments, else the environment's."""
    return (
        name or getenv(ACTOR_NAME_VAR) or DEFAULT_ACTOR_NAME,
        namespace or getenv(NAMESPACE_VAR) or DEFAULT_NAMESPACE,
    )


def absolute_destination(destination: str) -> str:
    """A local path made absolute (``~`` expanded); URLs as they are."""
    # The actor's working directory is not the caller's: pin relative paths (and ~) here.
    if scheme_of(destination) == "file" and "://" not in destination:
        return os.path.abspath(os.path.expanduser(destination))
    return destination


def channel_mode() -> str:
    """``TRAJTRACK_RAY_CHANNEL``, one of :data:`CHANNEL_MODES` (default ``"auto"``).

    Raises:
        ConfigurationError: Another value.
    """
    mode = os.environ.get(CHANNEL_VAR, "auto").strip().lower() or "auto"
    if mode == "tcp":
        raise ConfigurationError(
            f"{CHANNEL_VAR}=tcp: the TCP channel is gone (it bypassed Ray's TLS and "
            "authentication); other nodes send their dumps as Ray calls: use auto or off"
        )
    if mode not in CHANNEL_MODES:
        raise ConfigurationError(
            f"{CHANNEL_VAR}={mode!r}: expected one of {', '.join(CHANNEL_MODES)}"
        )
    return mode


def pipelined_by_default() -> bool:
    """Whether ``TRAJTRACK_RAY_PIPELINED`` is ``"1"``."""
    return getenv(PIPELINED_VAR) == "1"


def limits() -> tuple[int, int, float]:
    """``(max_items, max_bytes, full_timeout)``: the pipelined bound, and the longest wait.

    Raises:
        ConfigurationError: A variable is set to something that is not a positive number.
    """
    return (
        _positive_from_env(MAX_IN_FLIGHT_VAR, DEFAULT_MAX_IN_FLIGHT, int),
        _positive_from_env(MAX_IN_FLIGHT_BYTES_VAR, DEFAULT_MAX_IN_FLIGHT_BYTES, int),
        _positive_from_env(FULL_TIMEOUT_VAR, DEFAULT_FULL_TIMEOUT, float),
    )


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
