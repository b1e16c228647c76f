"""Reading nested settings from whatever config object the caller has.

verl passes an OmegaConf ``DictConfig``; tests and non-verl users pass nested dicts,
dataclasses or ``types.SimpleNamespace``. Mappings (``DictConfig`` is one) are read by key,
anything else by attribute, so no config library is needed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trajtrack._exceptions import ConfigurationError

__all__ = ["config_bool", "config_get", "config_positive_int"]

_MISSING: Any = object()


def config_get(config: Any, path: str, default: Any = _MISSING) -> Any:
    """Return the value at dotted ``path`` inside ``config``.

    Args:
        config: A mapping, dataclass, namespace or OmegaConf object.
        path: Dotted path such as ``"actor_rollout_ref.rollout.n"``.
        default: Returned when a part of the path is missing; without it a missing part
            raises.

    Returns:
        The value found, or ``default``.

    Raises:
        ConfigurationError: A part of the path is missing and no default was given.
    """
    node = config
    parts = path.split(".")
    for depth, part in enumerate(parts):
        found, node = _child(node, part)
        if not found:
            if default is not _MISSING:
                return default
            missing = ".".join(parts[: depth + 1])
            raise ConfigurationError(f"config has no {missing!r} (needed for {path!r})")
    return node


def config_bool(config: Any, path: str, default: bool) -> bool:
    """Return the boolean at ``path`` (``default`` when missing or ``None``)."""
    value = config_get(config, path, None)
    return default if value is None else bool(value)


def config_positive_int(config: Any, path: str) -> int:
    """Return the required positive integer at ``path``.

    Raises:
        ConfigurationError: The value is missing, not an integer, or below 1.
    """
    value = config_get(config, path)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"config {path!r} must be a positive integer, got {value!r}")
    return value


def _child(node: Any, key: str) -> tuple[bool, Any]:
    if isinstance(node, Mapping):
        return (True, node[key]) if key in node else (False, None)
    if node is None:
        return False, None
    try:
        return True, getattr(node, key)
    except AttributeError:
        return False, None
