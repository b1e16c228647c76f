"""What the environment configures: the switch, the destination and the tracker's options.

The sync shim (``dump_data``/``get_tracker``) and the Ray adapter read the same variables:

* ``VERL_ENABLE_TRACKER=1`` or ``TRAJTRACK_ENABLE=1`` -- dumping is on (exactly ``"1"``, as in
  verl's original);
* ``TRAJTRACK_DIR`` or ``VERL_TRACKER_HDFS_DIR`` -- the destination;
* ``TRAJTRACK_EXIT_TIMEOUT`` -- seconds the drain at interpreter exit may take (default 120);
* ``TRAJTRACK_LAYOUT`` (``files`` or ``shards``), ``TRAJTRACK_SHARD_MAX_BYTES``,
  ``TRAJTRACK_SHARD_MAX_AGE`` -- the storage layout and its options.
"""

from __future__ import annotations

import os
from typing import Any

from trajtrack._environ import getenv
from trajtrack._exceptions import ConfigurationError

__all__ = [
    "DEFAULT_EXIT_TIMEOUT",
    "destination_from_env",
    "exit_timeout_from_env",
    "is_enabled",
    "tracker_options_from_env",
]

DIR_VARS = ("TRAJTRACK_DIR", "VERL_TRACKER_HDFS_DIR")
EXIT_TIMEOUT_VAR = "TRAJTRACK_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT = 120.0
LAYOUT_VAR = "TRAJTRACK_LAYOUT"
SHARD_MAX_BYTES_VAR = "TRAJTRACK_SHARD_MAX_BYTES"
SHARD_MAX_AGE_VAR = "TRAJTRACK_SHARD_MAX_AGE"


def is_enabled() -> bool:
    """True when ``VERL_ENABLE_TRACKER`` or ``TRAJTRACK_ENABLE`` is exactly ``"1"``.

    Exactly like the original: ``"true"``, ``"yes"`` or ``"01"`` do not enable it.
    """
    # In every dump call: two cheap lookups, no generator.
    return getenv("VERL_ENABLE_TRACKER") == "1" or getenv("TRAJTRACK_ENABLE") == "1"


def destination_from_env() -> str:
    """``TRAJTRACK_DIR``, else ``VERL_TRACKER_HDFS_DIR``.

    Raises:
        ConfigurationError: Neither is set.
    """
    for var in DIR_VARS:
        value = os.environ.get(var)
        if value:
            return value
    raise ConfigurationError(
        "the trajtrack tracker is enabled but has no destination: set TRAJTRACK_DIR or "
        "VERL_TRACKER_HDFS_DIR to a local path or an hdfs:// / webhdfs:// URL"
    )


def exit_timeout_from_env() -> float:
    """``TRAJTRACK_EXIT_TIMEOUT`` seconds (default 120)."""
    return float(_number(EXIT_TIMEOUT_VAR, float, DEFAULT_EXIT_TIMEOUT, minimum=0.0))


def tracker_options_from_env() -> dict[str, Any]:
    """:class:`~trajtrack.Tracker` keyword arguments the environment sets (only those set).

    Raises:
        ConfigurationError: A variable holds something unusable (named in the message).
    """
    options: dict[str, Any] = {}
    layout = os.environ.get(LAYOUT_VAR, "").strip().lower()
    if layout:
        if layout not in ("files", "shards"):
            raise ConfigurationError(f"{LAYOUT_VAR}={layout!r}: expected 'files' or 'shards'")
        options["layout"] = layout
    if os.environ.get(SHARD_MAX_BYTES_VAR):
        options["shard_max_bytes"] = _number(SHARD_MAX_BYTES_VAR, int, 0, minimum=1)
    if os.environ.get(SHARD_MAX_AGE_VAR):
        options["shard_max_age"] = _number(SHARD_MAX_AGE_VAR, float, 0.0, minimum=1e-3)
    return options


def _number(var: str, kind: type[int] | type[float], default: float, *, minimum: float) -> Any:
    raw = os.environ.get(var)
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigurationError(f"{var}={raw!r} is not a number") from None
    if value < minimum:
        raise ConfigurationError(f"{var}={raw!r} must be at least {minimum:g}")
    return value
