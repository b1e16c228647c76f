"""Errors raised by the rollout data layer.

They derive from :class:`trajtrack.TrajtrackError` and from :class:`ValueError`, so callers
written against verl's ``DataProto`` (which raises ``ValueError``/``AssertionError`` for the
same conditions) can keep a broad ``except ValueError``. Configuration problems raise
:class:`trajtrack.ConfigurationError`.
"""

from __future__ import annotations

from trajtrack._exceptions import TrajtrackError

__all__ = [
    "BatchConflictError",
    "BatchError",
    "BatchKeyError",
    "BatchSizeError",
    "BatchTypeError",
]


class BatchError(TrajtrackError, ValueError):
    """Base class for invalid batch contents or operations."""


class BatchSizeError(BatchError):
    """A tensor or array does not share the batch's leading dimension.

    The message names the key and both sizes.
    """


class BatchKeyError(BatchError):
    """A key is missing, or batches that must have the same keys do not."""


class BatchConflictError(BatchError):
    """Two batches carry different values under the same key."""


class BatchTypeError(BatchError, TypeError):
    """A value has a type the batch container cannot hold."""
