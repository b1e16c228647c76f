"""Allow-list for loading rollout records with ``torch.load(..., weights_only=True)``.

``weights_only`` loading refuses any global it does not know. A pickled
:class:`RolloutSample` holding a :class:`RolloutBatch` needs our three classes plus what
numpy's own pickles reference: the array reconstructor, ``ndarray``, ``dtype`` and the
concrete dtype classes (``numpy.dtypes.ObjectDType`` …), and the scalar reconstructor for
numpy scalars stored in ``meta_info`` or ``rollout_status``. The numpy functions are taken
from numpy's own ``__reduce__`` output rather than from private module paths, so the list
is right for whichever numpy version is installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._batch import RolloutBatch
from ._pickling import REBUILDS
from ._samples import RolloutSample, ValidateMetrics

__all__ = ["SAFE_GLOBALS"]

# One dtype per kind a batch can reasonably hold: bool, signed/unsigned ints, floats,
# complex, str, bytes, object. "l"/"q" and "L"/"Q" are distinct classes on some platforms.
_DTYPE_CODES = "?bhilqBHILQefdgFDGUSO"


def _numpy_globals() -> tuple[Any, ...]:
    array_reconstruct = np.empty(0).__reduce__()[0]
    scalar_reconstruct = np.float64(0).__reduce__()[0]
    dtype_classes = {type(np.dtype(code)) for code in _DTYPE_CODES}
    ordered = sorted(dtype_classes, key=lambda cls: cls.__name__)
    return (array_reconstruct, scalar_reconstruct, np.ndarray, np.dtype, *ordered)


SAFE_GLOBALS: tuple[Any, ...] = (
    RolloutSample,
    ValidateMetrics,
    RolloutBatch,
    *REBUILDS,
    *_numpy_globals(),
)
"""Globals to allow-list before ``torch.load(path, weights_only=True)`` of rollout records.

Example::

    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        sample = torch.load(path, weights_only=True)

``safe_globals()`` widens the list for the whole process while it is entered; trajtrack's reader
(``open_run(...).load``) loads these records without changing it. Never add verl's ``DataProto``:
its ``__setstate__`` runs ``torch.load(weights_only=False)`` (see ``docs/rollout.md``).
"""
