"""The scheme registry: which backend opens which URL, imported only when first used."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from trajtrack._exceptions import ConfigurationError, MissingDependencyError
from trajtrack.backends._protocol import Storage

__all__ = ["StorageFactory", "open_storage", "register_backend", "scheme_of"]

StorageFactory = Callable[..., Storage]

# scheme -> (module:attribute, extra to install when the import fails). Imported lazily so that
# `import trajtrack` never imports requests, hdfs or anything a backend needs.
_REGISTRY: dict[str, tuple[str, str | None]] = {
    "file": ("trajtrack.backends.local:LocalStorage", None),
    "memory": ("trajtrack.backends.memory:MemoryStorage", None),
    "webhdfs": ("trajtrack.backends.webhdfs:open_webhdfs", "hdfs"),
    "swebhdfs": ("trajtrack.backends.webhdfs:open_webhdfs", "hdfs"),
    "hdfs": ("trajtrack.backends.webhdfs:open_webhdfs", "hdfs"),
}
_FACTORIES: dict[str, StorageFactory] = {}


def register_backend(scheme: str, factory: StorageFactory) -> None:
    """Make ``scheme://...`` URLs open with ``factory(url, **options)``."""
    _FACTORIES[scheme.lower()] = factory


def scheme_of(url: str) -> str:
    """The scheme of a destination; plain paths (also Windows drive paths) are ``file``."""
    parts = urlsplit(url)
    if len(parts.scheme) <= 1:  # "" or a drive letter
        return "file"
    return parts.scheme.lower()


def open_storage(url: str, **options: Any) -> Storage:
    """Open the storage for a destination URL; options go to the backend.

    Raises:
        ConfigurationError: unknown scheme or unusable URL.
        MissingDependencyError: the backend's optional extra is not installed.
    """
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"destination must be a non-empty string, got {url!r}")
    scheme = scheme_of(url)
    return _factory(scheme)(url, **options)


def _factory(scheme: str) -> StorageFactory:
    factory = _FACTORIES.get(scheme)
    if factory is not None:
        return factory
    entry = _REGISTRY.get(scheme)
    if entry is None:
        known = sorted({*_REGISTRY, *_FACTORIES})
        raise ConfigurationError(f"no storage backend for scheme {scheme!r}; known: {known}")
    target, extra = entry
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if extra is None or exc.name == module_name:
            raise
        raise MissingDependencyError(
            f"{scheme}:// destinations need the optional dependency {exc.name!r}: "
            f"pip install 'trajtrack[{extra}]'"
        ) from exc
    factory = getattr(module, attribute)
    _FACTORIES[scheme] = factory
    return factory  # type: ignore[no-any-return]
