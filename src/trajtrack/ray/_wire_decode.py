"""Plain data from the wire, on the actor's side: :func:`parse` checks, :func:`decode` builds.

The format is :mod:`trajtrack.ray._wire`'s. What arrives is untrusted: :func:`parse` checks
the whole payload (sizes against the buffers, dtypes from allow-lists, the nesting depth,
every buffer used by one node at most, dict keys scalars) and rebuilds the structure without
making a tensor or copying a ``bytes`` value; :meth:`Decoded.build` then makes the tensors and
arrays on the received buffer, without copying, and the ``bytes`` values (the actor's upload
worker calls it, in its thread). What the built object holds is at most twice the payload,
and :attr:`Decoded.nbytes` counts it. Nothing is imported or called by name.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import sys
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch

from trajtrack.ray._wire import (
    LENGTH,
    MAX_DEPTH,
    SCALARS,
    TORCH_DTYPES,
    VERSION,
    aligned,
    plain_numpy_dtype,
)
from trajtrack.tracker import NUMPY_DTYPES, NotPlainError

__all__ = ["Decoded", "decode", "parse", "skeleton_size"]

logger = logging.getLogger(__name__)

_NUMPY_OF: Final = {dtype: torch.empty((), dtype=dtype).numpy().dtype for dtype in NUMPY_DTYPES}


_PARSE_ERRORS: Final = (
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    RecursionError,
    RuntimeError,
    NotPlainError,
    struct.error,
)


class Decoded:
    """A checked payload: its structure is rebuilt, its tensors are made by :meth:`build`.

    Making a tensor is a torch call (slow on a cold cache, and torch calls release the GIL);
    the actor admits the dump with this and lets its upload worker call :meth:`build`.
    """

    __slots__ = ("_payload", "nbytes", "root")

    def __init__(self, root: Any, payload: bytearray, copied: int) -> None:
        self.root = root
        self._payload = payload
        # What the built object holds: the payload it shares, and the bytes values it copies
        # (each buffer is used once: at most the payload's length again).
        self.nbytes = len(payload) + copied

    def build(self) -> Any:
        """The object; its tensors and arrays share the payload's memory."""
        return _build(self.root, self._payload, {})


class _Pending:
    """A checked tensor of a :class:`Decoded`, not made yet."""

    __slots__ = ("dims", "dtype", "length", "offset", "requires_grad")

    def __init__(
        self, dtype: torch.dtype, dims: tuple[int, ...], offset: int, length: int, grad: bool
    ) -> None:
        self.dtype, self.dims, self.offset, self.length = dtype, dims, offset, length
        self.requires_grad = grad

    def make(self, payload: bytearray) -> torch.Tensor:
        dtype, length = self.dtype, self.length
        if length and dtype in NUMPY_DTYPES:
            # Through numpy: these calls hold the GIL, torch's view ops release it.
            count = length // dtype.itemsize
            flat = np.frombuffer(payload, dtype=_NUMPY_OF[dtype], count=count, offset=self.offset)
            tensor = torch.from_numpy(flat.reshape(self.dims))
        elif length:
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=length, offset=self.offset)
            tensor = raw.view(dtype).reshape(self.dims)
        else:
            tensor = torch.empty(self.dims, dtype=dtype)
        if self.requires_grad:
            tensor.requires_grad_(True)
        return tensor


class _PendingBytes:
    """A checked ``bytes`` value of a :class:`Decoded`, copied out of the payload by build."""

    __slots__ = ("length", "offset")

    def __init__(self, offset: int, length: int) -> None:
        self.offset, self.length = offset, length


def _build(node: Any, payload: bytearray, made: dict[int, torch.Tensor]) -> Any:
    kind = type(node)
    if kind is _PendingBytes:
        return bytes(payload[node.offset : node.offset + node.length])
    if kind is _Pending:
        tensor = made.get(id(node))
        if tensor is None:  # one tensor sent twice is one _Pending: it stays one tensor
            tensor = made[id(node)] = node.make(payload)
        return tensor
    if kind is dict:
        return {key: _build(value, payload, made) for key, value in node.items()}
    if kind is list:
        return [_build(value, payload, made) for value in node]
    if kind is tuple:
        return tuple(_build(value, payload, made) for value in node)
    return node


def skeleton_size(payload: bytearray) -> int:
    """The length of *payload*'s skeleton as its header says (0 if it has no header)."""
    return LENGTH.unpack_from(payload, 0)[0] if len(payload) >= LENGTH.size else 0


def parse(payload: bytearray) -> Decoded:
    """Check *payload* and rebuild its structure; see :meth:`Decoded.build` for the object.

    Raises:
        ValueError: The payload is not a valid encoding (nothing is built from it).
    """
    try:
        (length,) = LENGTH.unpack_from(payload, 0)
        if LENGTH.size + length > len(payload):
            raise ValueError("skeleton longer than the payload")
        skeleton = json.loads(bytes(payload[LENGTH.size : LENGTH.size + length]))
        if not isinstance(skeleton, dict) or skeleton.get("v") != VERSION:
            raise ValueError("unknown encoding version")
        body = LENGTH.size + length
        decoder = _Decoder(payload, body, skeleton["buffers"], skeleton["tensors"])
        root = decoder.node(skeleton["root"], 0)
    except _PARSE_ERRORS as exc:
        raise ValueError(f"malformed plain payload: {exc}") from None
    return Decoded(root, payload, decoder.copied)


def decode(payload: bytearray) -> tuple[Any, int]:
    """Rebuild the object; its tensors and arrays share *payload*'s memory.

    Returns:
        The object and its size as the tracker's budget counts it.

    Raises:
        ValueError: The payload is not a valid encoding (nothing is built from it).
    """
    decoded = parse(payload)
    try:
        return decoded.build(), decoded.nbytes
    except _PARSE_ERRORS as exc:
        raise ValueError(f"malformed plain payload: {exc}") from None


class _Decoder:
    def __init__(self, payload: bytearray, body: int, spans: Any, tensors: Any) -> None:
        self.payload = payload
        self.body = body  # buffers start after the skeleton
        self.spans: list[tuple[int, int]] = self._layout(spans)
        self.tensor_specs: Sequence[Any] = tensors
        self.tensors: dict[int, _Pending] = {}
        self.used: set[int] = set()  # buffers a node has taken: each is taken once
        self.copied = 0  # bytes values' lengths: build copies them

    def span(self, index: Any) -> tuple[int, int]:
        """Buffer *index*'s ``(offset, length)``, taken: a second node taking it is refused.

        Without this, a small skeleton naming one large buffer many times would make the
        actor hold (bytes values) or write (arrays, tensors) many times what was received.
        """
        number = int(index)
        if number < 0 or number in self.used:
            raise ValueError(f"buffer {number} is used twice, or does not exist")
        self.used.add(number)
        return self.spans[number]

    def _layout(self, lengths: Any) -> list[tuple[int, int]]:
        spans, position = [], self.body
        for length in lengths:
            if type(length) is not int or length < 0:
                raise ValueError("bad buffer length")
            position = aligned(position)
            spans.append((position, length))
            position += length
        if position > len(self.payload):
            raise ValueError("buffers beyond the end of the payload")
        return spans

    def node(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError("nesting too deep")
        if type(node) in SCALARS:
            return node
        if type(node) is not list or not node or not isinstance(node[0], str):
            raise ValueError("bad node")
        tag = node[0]
        if tag == "M":
            return {self.key(k, depth + 1): self.node(v, depth + 1) for k, v in node[1]}
        if tag == "L":
            return [self.node(v, depth + 1) for v in node[1]]
        if tag == "U":
            return tuple(self.node(v, depth + 1) for v in node[1])
        if tag == "T":
            return self.tensor(int(node[1]))
        if tag == "A":
            return self.array(node[1], node[2], int(node[3]))
        if tag == "g":
            return self.array(node[1], [], int(node[2]))[()]
        if tag == "b":
            offset, length = self.span(node[1])
            self.copied += length
            return _PendingBytes(offset, length)
        if tag == "c":
            return complex(float(node[1]), float(node[2]))
        if tag == "D":
            return _torch_dtype(node[1])
        raise ValueError(f"unknown tag {tag!r}")

    def key(self, node: Any, depth: int) -> Any:
        """A dict key: a scalar, a complex number or bytes (what the encoder sends), else
        refused -- a container as a key could hold what only values may (a tensor to make)."""
        if type(node) in SCALARS:
            return node
        if type(node) is list and node and node[0] in ("c", "b"):
            key = self.node(node, depth)
            if type(key) is _PendingBytes:  # a key must hash now: copied here
                key = bytes(self.payload[key.offset : key.offset + key.length])
            return key
        raise ValueError("a dict key that is not a scalar, a complex number or bytes")

    def tensor(self, index: int) -> _Pending:
        seen = self.tensors.get(index)
        if seen is not None:
            return seen
        if index < 0:
            raise ValueError("bad tensor index")
        dtype_name, shape, buffer, requires_grad = self.tensor_specs[index]
        dtype = _torch_dtype(dtype_name)
        dims = _shape(shape, dtype.itemsize)
        offset, length = self.span(buffer)
        if math.prod(dims) * dtype.itemsize != length:
            raise ValueError("tensor size does not match its buffer")
        grad = requires_grad is True and (dtype.is_floating_point or dtype.is_complex)
        pending = self.tensors[index] = _Pending(dtype, dims, offset, length, grad)
        return pending

    def array(self, dtype_str: Any, shape: Any, buffer: int) -> Any:
        dtype = np.dtype(str(dtype_str))
        plain_numpy_dtype(dtype)  # refuses object, structured and void dtypes
        dims = _shape(shape, dtype.itemsize)
        offset, length = self.span(buffer)
        if math.prod(dims) * dtype.itemsize != length:
            raise ValueError("array size does not match its buffer")
        flat = np.frombuffer(self.payload, dtype=dtype, count=math.prod(dims), offset=offset)
        return flat.reshape(dims)


def _torch_dtype(name: Any) -> torch.dtype:
    dtype = TORCH_DTYPES.get(str(name))
    if dtype is None:
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


_MAX_DIMS: Final = 32
"""numpy's limit before 2.0 (torch's and numpy 2's are higher)."""


def _shape(shape: Any, itemsize: int) -> tuple[int, ...]:
    """A shape, refused when torch or numpy could not make it (even with zero elements).

    A zero in a shape makes the element count 0 whatever the other dimensions are, so the
    size check against the buffer passes; the other dimensions must still fit in an index.
    """
    if (
        type(shape) is not list
        or len(shape) > _MAX_DIMS
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise ValueError("bad shape")
    if math.prod(max(d, 1) for d in shape) * max(itemsize, 1) > sys.maxsize:
        raise ValueError(f"shape {shape} overflows")
    return tuple(shape)
