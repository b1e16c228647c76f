"""Facts of torch's checkpoint format that the writer and the reader both depend on.

``torch.save`` pickles a plain CPU tensor as a call of one of two rebuild functions over a
storage named by a persistent id: ``_rebuild_tensor_v2`` over a typed storage class
(``torch.FloatStorage``...) for the dtypes of :data:`V2_STORAGES`, ``_rebuild_tensor_v3`` over
``torch.UntypedStorage`` for the others (:data:`V3_DTYPES`). The tracker's archive writer
(:mod:`trajtrack.tracker._archive`) writes exactly that, and the reader's fast loader
(:mod:`trajtrack.reader._fast_load`) reads exactly that; both take these facts from here, so
neither imports the other. The rebuild functions are taken from what torch's public pickling
protocol (``Tensor.__reduce_ex__``) returns: they live in a private module of torch, which is
never named here.
"""

from __future__ import annotations

import warnings
from typing import Any, Final

import torch

__all__ = ["PROTOCOL", "REBUILD_V2", "REBUILD_V3", "V2_STORAGES", "V3_DTYPES", "pickled_by"]

PROTOCOL: Final = 2  # torch.serialization.DEFAULT_PROTOCOL

V2_STORAGES: Final = {  # the dtypes torch pickles as a typed storage (_rebuild_tensor_v2)
    torch.float64: torch.DoubleStorage,
    torch.float32: torch.FloatStorage,
    torch.float16: torch.HalfStorage,
    torch.int64: torch.LongStorage,
    torch.int32: torch.IntStorage,
    torch.int16: torch.ShortStorage,
    torch.int8: torch.CharStorage,
    torch.uint8: torch.ByteStorage,
    torch.bool: torch.BoolStorage,
    torch.bfloat16: torch.BFloat16Storage,
    torch.complex128: torch.ComplexDoubleStorage,
    torch.complex64: torch.ComplexFloatStorage,
}


def pickled_by(dtype: torch.dtype) -> Any:
    """The function torch's own pickling (``Tensor.__reduce_ex__``) rebuilds *dtype* with."""
    with warnings.catch_warnings():  # complex32: "experimental"
        warnings.simplefilter("ignore")
        try:
            reduce: Any = torch.empty(0, dtype=dtype).__reduce_ex__
            return reduce(PROTOCOL)[0]
        except Exception:  # a dtype this torch cannot make or save: never archived
            return None


REBUILD_V2: Final = pickled_by(torch.float32)
REBUILD_V3: Final = pickled_by(torch.uint16) if hasattr(torch, "uint16") else None
# The dtypes torch pickles as an untyped storage (_rebuild_tensor_v3): which they are depends
# on the torch version (uint16 is one in 2.13; torch 2.4 cannot save it at all), so ask it.
V3_DTYPES: Final[frozenset[torch.dtype]] = frozenset(
    dtype
    for dtype in {value for value in vars(torch).values() if isinstance(value, torch.dtype)}
    if dtype not in V2_STORAGES and REBUILD_V3 is not None and pickled_by(dtype) is REBUILD_V3
)
