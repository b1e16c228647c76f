"""Allow-list for loading rollout records with ``torch.load(..., weights_only=True)``.

``weights_only`` loading refuses any global it does not know. A pickled
:class:`RolloutSample` holding a :class:`RolloutBatch` needs our three classes plus what
numpy's own pickles reference: the array and scalar reconstructors, ``ndarray`` and ``dtype``.
For those, the list holds trajtrack's stand-ins under numpy's names
(:mod:`trajtrack._numpy_standins`), never numpy's own reconstructors: numpy's take a
dtype's flags from the file, and an object dtype pickled with flags 0 makes numpy read file
bytes as object pointers. The stand-ins rebuild each dtype from its type code and give object
arrays their items from the list the unpickler built.
"""

from __future__ import annotations

from typing import Any

from trajtrack._numpy_standins import NUMPY_GLOBALS

from ._batch import RolloutBatch
from ._pickling import REBUILDS
from ._samples import RolloutSample, ValidateMetrics

__all__ = ["SAFE_GLOBALS"]


SAFE_GLOBALS: tuple[Any, ...] = (
    RolloutSample,
    ValidateMetrics,
    RolloutBatch,
    *REBUILDS,
    *NUMPY_GLOBALS,
)
"""Globals to allow-list before ``torch.load(path, weights_only=True)`` of rollout records.

Example::

    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        sample = torch.load(path, weights_only=True)

The numpy entries are ``(stand-in, "numpy.name")`` pairs, which torch's allow-list accepts.
Arrays load as :class:`numpy.ndarray` subclasses (``np.asarray(a)`` or ``a.view(np.ndarray)``
gives the plain array); trajtrack's reader (``open_run(...).load``) returns plain arrays and
loads these records without changing your process's list. verl's ``DataProto`` is not here:
trajtrack's reader reads it as data (see ``docs/rollout.md``).
"""
