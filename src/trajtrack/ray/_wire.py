"""Plain data on the wire: a JSON skeleton plus the raw bytes of every tensor and array.

``torch.save`` of a small dict costs the caller 100-500 us (a zip archive with CRCs, pickling),
more than the whole channel round trip. Plain data (nested dicts, lists and tuples of tensors,
numpy arrays and scalars; see :func:`trajtrack._snapshot.measure_plain`) does not need it to
cross a process boundary: the caller sends the structure as JSON and each tensor's bytes as
they lie in memory, the actor rebuilds the object around the received buffer without copying
and its upload workers run the serializer, off the caller's path.

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
structured arrays) raises :class:`NotPlainError` and the caller falls back to ``torch.save``.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from trajtrack._snapshot import NUMPY_DTYPES, NotPlainError, measure_plain

__all__ = ["Captured", "Encoded", "NotPlainError", "capture", "decode", "encode"]

VERSION: Final = 1
ALIGN: Final = 64
MAX_DEPTH: Final = 64
_LENGTH = struct.Struct("<I")
_SCALARS: Final = (type(None), bool, int, float, str)
_TORCH_DTYPES: Final = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in vars(torch).values()
    if isinstance(dtype, torch.dtype)
}


_NUMPY_OF: Final = {dtype: torch.empty((), dtype=dtype).numpy().dtype for dtype in NUMPY_DTYPES}


@dataclass
class Encoded:
    """An encoded payload: the parts to send, in order, and their total size."""

    parts: list[bytes | memoryview] = field(default_factory=list)
    size: int = 0
    keep: list[Any] = field(default_factory=list)  # what the memoryviews point into


_DTYPE_NAMES: Final = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
_JSON: Final = json.JSONEncoder(separators=(",", ":"))
COPY_HOLDING_GIL_MAX_BYTES: Final = 256 << 10
"""A captured copy up to this size is taken as ``bytes`` (holds the GIL: no wait to get it
back); larger ones with numpy, which releases the GIL while it copies."""


class Captured:
    """Plain data taken apart for the wire: the skeleton's nodes and the buffers.

    :meth:`encoded` lays it out; with ``capture(obj, copy=True)`` the buffers are this object's
    own copies, so that work can wait for another thread while *obj* changes.
    """

    __slots__ = ("buffers", "keep", "root", "tensors")

    def __init__(self, root: Any, tensors: list[list[Any]], buffers: list[Any], keep: list[Any]):
        self.root = root
        self.tensors = tensors
        self.buffers = buffers  # memoryviews (1-D, bytes), or bytes
        self.keep = keep  # what the memoryviews point into

    @property
    def nbytes(self) -> int:
        """The buffers' size, plus a little for the skeleton (for memory budgets)."""
        return sum(len(buffer) for buffer in self.buffers) + 64 * (1 + len(self.tensors))

    def encoded(self) -> Encoded:
        lengths = [len(buffer) for buffer in self.buffers]
        skeleton = _JSON.encode(
            {"v": VERSION, "root": self.root, "tensors": self.tensors, "buffers": lengths}
        ).encode()
        head = _LENGTH.pack(len(skeleton)) + skeleton
        encoded = Encoded([head], len(head), self.keep)
        for buffer, length in zip(self.buffers, lengths, strict=True):
            padding = _aligned(encoded.size) - encoded.size
            if padding:
                encoded.parts.append(bytes(padding))
            if length:
                encoded.parts.append(buffer)
            encoded.size += padding + length
        return encoded


class _Encoder:
    __slots__ = ("buffers", "copy", "keep", "tensor_ids", "tensors")

    def __init__(self, copy: bool) -> None:
        self.copy = copy
        self.buffers: list[Any] = []
        self.tensors: list[list[Any]] = []
        self.tensor_ids: dict[int, int] = {}
        self.keep: list[Any] = []  # what the memoryviews point into

    def node(self, obj: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise NotPlainError("nesting too deep")
        kind = type(obj)
        if kind is torch.Tensor:
            return ["T", self.tensor(obj)]
        if kind is dict:
            return ["M", [[self.key(k), self.node(v, depth + 1)] for k, v in obj.items()]]
        if kind in _SCALARS:
            return obj
        if kind is list:
            return ["L", [self.node(v, depth + 1) for v in obj]]
        if kind is tuple:
            return ["U", [self.node(v, depth + 1) for v in obj]]
        if kind is np.ndarray:
            dtype = _plain_numpy_dtype(obj.dtype)
            return ["A", dtype, list(obj.shape), self.array(obj)]
        if kind is bytes:  # immutable: never copied
            self.buffers.append(obj)
            return ["b", len(self.buffers) - 1]
        if kind is complex:
            return ["c", obj.real, obj.imag]
        if kind is torch.dtype:
            return ["D", str(obj).removeprefix("torch.")]
        if isinstance(obj, np.generic) and type(obj).__module__ == "numpy":
            dtype = _plain_numpy_dtype(obj.dtype)
            self.buffers.append(np.asarray(obj).tobytes())  # a new array: never shared
            return ["g", dtype, len(self.buffers) - 1]
        raise NotPlainError(kind.__name__)

    def key(self, key: Any) -> Any:
        if type(key) is str:
            return key
        if type(key) in _SCALARS or type(key) is complex or type(key) is bytes:
            return self.node(key, 0)
        raise NotPlainError(f"dict key of type {type(key).__name__}")

    def tensor(self, tensor: torch.Tensor) -> int:
        index = self.tensor_ids.get(id(tensor))
        if index is not None:
            return index
        # The common case in one call that holds the GIL: ``numpy()`` accepts exactly the
        # strided CPU tensors without autograd, conjugate or negative bit whose dtype numpy
        # has (it raises for everything else). torch's own checks (``is_conj``, ``detach``,
        # ``view``...) each release the GIL, and a thread waiting for it can hold the caller up
        # for a whole switch interval.
        try:
            array = tensor.numpy()
            shape = array.shape
        except (RuntimeError, TypeError):
            array, shape = self._general_tensor(tensor, self.copy)
        index = self.tensor_ids[id(tensor)] = len(self.tensors)
        spec = [_DTYPE_NAMES[tensor.dtype], list(shape), 0, tensor.requires_grad]
        self.tensors.append(spec)
        spec[2] = self.array(array)
        return index

    @staticmethod
    def _general_tensor(
        tensor: torch.Tensor, copy: bool
    ) -> tuple[np.ndarray[Any, Any], tuple[int, ...]]:
        """Any other tensor encoding carries: a numpy array of its bytes, and its shape."""
        if tensor.layout is not torch.strided or tensor.is_quantized or tensor.is_meta:
            raise NotPlainError("special tensor")
        if tensor.dtype not in _DTYPE_NAMES:
            raise NotPlainError(f"tensor dtype {tensor.dtype}")
        source = tensor.detach()
        if source.device.type != "cpu":
            if copy:  # a device-to-host copy here would wait for the device: see capture()
                raise NotPlainError(f"tensor on {source.device}")
            source = source.to("cpu")
        if source.is_conj() or source.is_neg():
            source = source.resolve_conj().resolve_neg()
        if not source.is_contiguous():
            source = source.contiguous()
        try:
            if source.dtype in NUMPY_DTYPES:
                return source.numpy(), tuple(source.shape)
            return source.reshape(-1).view(torch.uint8).numpy(), tuple(source.shape)
        except (RuntimeError, TypeError) as exc:  # e.g. sub-byte dtypes
            raise NotPlainError(f"tensor dtype {tensor.dtype}: {exc}") from None

    def array(self, array: np.ndarray[Any, Any]) -> int:
        """Add the array's bytes in C order as the next buffer; return its index."""
        if not self.copy:
            source = np.ascontiguousarray(array)  # a copy only if strided
            self.keep.append(source)
            self.buffers.append(source.reshape(-1).view(np.uint8).data)
        elif array.nbytes <= COPY_HOLDING_GIL_MAX_BYTES:
            self.buffers.append(array.tobytes())
        else:
            self.buffers.append(np.array(array, order="C").reshape(-1).view(np.uint8).data)
        return len(self.buffers) - 1


def _plain_numpy_dtype(dtype: np.dtype[Any]) -> str:
    if dtype.hasobject or dtype.fields is not None or dtype.kind == "V" or dtype.subdtype:
        raise NotPlainError(f"numpy dtype {dtype}")
    return str(dtype.str)


def capture(obj: Any, *, copy: bool = False) -> Captured:
    """Take plain data apart for :meth:`Captured.encoded`.

    Args:
        obj: Plain data.
        copy: Copy every tensor's and array's bytes (a snapshot: *obj* may change afterwards).
            Without it the buffers point into *obj*'s memory.

    Raises:
        NotPlainError: *obj* is not plain data this encoding carries exactly; with *copy*,
            also when it holds a tensor that is not on the CPU (a snapshot of that is better
            taken without waiting for the device: :func:`trajtrack._snapshot.snapshot_plain`).
    """
    encoder = _Encoder(copy)
    root = encoder.node(obj, 0)
    return Captured(root, encoder.tensors, encoder.buffers, encoder.keep)


def encode(obj: Any) -> Encoded:
    """Encode plain data without copying the tensors' bytes (the parts point into them).

    The caller must keep *obj* unchanged until the parts are sent (the acknowledged dump
    sends before it returns; the pipelined one sends a :func:`capture` copy).

    Raises:
        NotPlainError: *obj* is not plain data this encoding carries exactly.
    """
    return capture(obj).encoded()


def _aligned(position: int) -> int:
    return (position + ALIGN - 1) // ALIGN * ALIGN


def decode(payload: bytearray) -> tuple[Any, int]:
    """Rebuild the object; its tensors and arrays share *payload*'s memory.

    Returns:
        The object and its size as the tracker's budget counts it.

    Raises:
        ValueError: The payload is not a valid encoding (nothing is built from it).
    """
    try:
        (length,) = _LENGTH.unpack_from(payload, 0)
        if _LENGTH.size + length > len(payload):
            raise ValueError("skeleton longer than the payload")
        skeleton = json.loads(bytes(payload[_LENGTH.size : _LENGTH.size + length]))
        if not isinstance(skeleton, dict) or skeleton.get("v") != VERSION:
            raise ValueError("unknown encoding version")
        body = _LENGTH.size + length
        decoder = _Decoder(payload, body, skeleton["buffers"], skeleton["tensors"])
        obj = decoder.node(skeleton["root"], 0)
    except (
        ValueError,
        KeyError,
        IndexError,
        TypeError,
        RecursionError,
        RuntimeError,
        NotPlainError,
        struct.error,
    ) as exc:
        raise ValueError(f"malformed plain payload: {exc}") from None
    return obj, measure_plain(obj)


class _Decoder:
    def __init__(self, payload: bytearray, body: int, spans: Any, tensors: Any) -> None:
        self.payload = payload
        self.body = body  # buffers start after the skeleton
        self.spans = self._layout(spans)
        self.tensor_specs: Sequence[Any] = tensors
        self.tensors: dict[int, torch.Tensor] = {}

    def _layout(self, lengths: Any) -> list[tuple[int, int]]:
        spans, position = [], self.body
        for length in lengths:
            if type(length) is not int or length < 0:
                raise ValueError("bad buffer length")
            position = _aligned(position)
            spans.append((position, length))
            position += length
        if position > len(self.payload):
            raise ValueError("buffers beyond the end of the payload")
        return spans

    def node(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError("nesting too deep")
        if type(node) in _SCALARS:
            return node
        if type(node) is not list or not node or not isinstance(node[0], str):
            raise ValueError("bad node")
        tag = node[0]
        if tag == "M":
            return {self.node(k, depth + 1): self.node(v, depth + 1) for k, v in node[1]}
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
            offset, length = self.spans[int(node[1])]
            return bytes(self.payload[offset : offset + length])
        if tag == "c":
            return complex(float(node[1]), float(node[2]))
        if tag == "D":
            return _torch_dtype(node[1])
        raise ValueError(f"unknown tag {tag!r}")

    def tensor(self, index: int) -> torch.Tensor:
        seen = self.tensors.get(index)
        if seen is not None:
            return seen
        if index < 0:
            raise ValueError("bad tensor index")
        dtype_name, shape, buffer, requires_grad = self.tensor_specs[index]
        dtype, dims = _torch_dtype(dtype_name), _shape(shape)
        offset, length = self.spans[int(buffer)]
        itemsize = dtype.itemsize
        if math.prod(dims) * itemsize != length:
            raise ValueError("tensor size does not match its buffer")
        if length and dtype in NUMPY_DTYPES:
            # Through numpy: these calls hold the GIL, torch's view ops release it (and the
            # actor's upload threads, serializing earlier dumps, would take it meanwhile).
            count = length // itemsize
            flat = np.frombuffer(self.payload, dtype=_NUMPY_OF[dtype], count=count, offset=offset)
            tensor = torch.from_numpy(flat.reshape(dims))
        elif length:
            raw = torch.frombuffer(self.payload, dtype=torch.uint8, count=length, offset=offset)
            tensor = raw.view(dtype).reshape(dims)
        else:
            tensor = torch.empty(dims, dtype=dtype)
        if requires_grad is True and (tensor.is_floating_point() or tensor.is_complex()):
            tensor.requires_grad_(True)
        self.tensors[index] = tensor
        return tensor

    def array(self, dtype_str: Any, shape: Any, buffer: int) -> Any:
        dtype = np.dtype(str(dtype_str))
        _plain_numpy_dtype(dtype)  # refuses object, structured and void dtypes
        dims = _shape(shape)
        offset, length = self.spans[buffer]
        if math.prod(dims) * dtype.itemsize != length:
            raise ValueError("array size does not match its buffer")
        flat = np.frombuffer(self.payload, dtype=dtype, count=math.prod(dims), offset=offset)
        return flat.reshape(dims)


def _torch_dtype(name: Any) -> torch.dtype:
    dtype = _TORCH_DTYPES.get(str(name))
    if dtype is None:
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def _shape(shape: Any) -> tuple[int, ...]:
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError("bad shape")
    return tuple(shape)
