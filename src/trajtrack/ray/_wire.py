"""Plain data on the wire: the format both sides of the channel agree on.

``torch.save`` of a small dict builds a zip archive with CRCs and pickles it, which costs the caller
more than the whole channel round trip (``benchmarks/bench_ray.py``). Plain data (nested dicts,
lists and tuples of tensors, numpy arrays and scalars; see :func:`trajtrack.tracker.measure_plain`)
does not need it to cross a process boundary: the caller sends the structure as JSON and each
tensor's bytes as they lie in memory (:mod:`trajtrack.ray._wire_encode`), the actor rebuilds the
object around the received buffer without copying (:mod:`trajtrack.ray._wire_decode`) and its upload
workers run the serializer, off the caller's path.

Layout of one encoded payload::

    u32 skeleton length | skeleton (UTF-8 JSON) | padding | buffer 0 | padding | buffer 1 ...

Buffers follow each other in order, each starting at the next multiple of :data:`ALIGN`. The
skeleton is ``{"v": 1, "root": node, "buffers": [length, ...], "tensors": [[dtype, shape,
buffer, requires_grad], ...]}``
where a node is a JSON scalar (``None``, ``bool``, ``int``, ``float``, ``str``) or a tagged
list: ``["L", [nodes]]`` list, ``["U", [nodes]]`` tuple, ``["M", [[key, value], ...]]`` dict,
``["T", k]`` tensor *k* (a tensor that occurs twice is sent once and stays shared), ``["A",
dtype, shape, buffer]`` numpy array, ``["g", dtype, buffer]`` numpy scalar, ``["b", buffer]``
bytes, ``["c", real, imag]`` complex, ``["D", name]`` a ``torch.dtype``.

Decoding builds only those types: dtypes come from allow-lists (a numpy dtype that holds
objects is refused), sizes are checked against the buffers, nothing is imported or called by
name. Anything the encoder does not know exactly (subclasses, sparse or quantized tensors,
structured arrays) raises :class:`~trajtrack.tracker.NotPlainError` and the caller falls back
to ``torch.save``.
"""

from __future__ import annotations

import logging
import struct
from typing import Any, Final

import numpy as np
import torch

from trajtrack.tracker import NotPlainError

__all__ = [
    "ALIGN",
    "LENGTH",
    "MAX_DEPTH",
    "SCALARS",
    "TORCH_DTYPES",
    "VERSION",
    "aligned",
    "plain_numpy_dtype",
]

logger = logging.getLogger(__name__)

VERSION: Final = 1
ALIGN: Final = 64
MAX_DEPTH: Final = 64
LENGTH: Final = struct.Struct("<I")
"""The header: the skeleton's length."""
SCALARS: Final = (type(None), bool, int, float, str)
"""The types a skeleton holds as they are (exact types: no subclasses)."""
TORCH_DTYPES: Final = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in vars(torch).values()
    if isinstance(dtype, torch.dtype)
}
"""The allow-list of tensor dtypes, by the name the skeleton gives them."""


def aligned(position: int) -> int:
    """*position* rounded up to the next multiple of :data:`ALIGN` (where a buffer starts)."""
    return (position + ALIGN - 1) // ALIGN * ALIGN


def plain_numpy_dtype(dtype: np.dtype[Any]) -> str:
    """The dtype's name on the wire; refuses object, structured and void dtypes.

    Raises:
        NotPlainError: *dtype* holds objects or fields, or is a void or sub-array dtype.
    """
    if dtype.hasobject or dtype.fields is not None or dtype.kind == "V" or dtype.subdtype:
        raise NotPlainError(f"numpy dtype {dtype}")
    return str(dtype.str)
