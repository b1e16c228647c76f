"""Plain data on the wire: a JSON skeleton plus the raw bytes of every tensor and array.

``torch.save`` of a small dict costs the caller 100-500 us (a zip archive with CRCs, pickling),
more than the whole channel round trip. Plain data (nested dicts, lists and tuples of tensors,
numpy arrays and scalars; see :func:`trajtrack.tracker._snapshot.measure_plain`) does not need it to
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
from typing import Any, Final, overload

import numpy as np
import torch

from trajtrack.tracker import NUMPY_DTYPES, NotPlainError

__all__ = [
    "Captured",
    "Decoded",
    "Encoded",
    "NotPlainError",
    "capture",
    "decode",
    "encode",
    "parse",
    "skeleton_size",
]

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


def _skeleton_encoder() -> Any:
    """``json.dumps(skeleton, separators=(",", ":"))``, minus its per-call setup.

    ``JSONEncoder.encode`` builds a C encoder on every call; the skeleton holds only lists,
    dicts with string keys, strings, ints, floats, bools and None, so one C encoder without
    circular-reference markers is built once and reused (pure Python where the C one is
    missing).
    """
    fallback = json.JSONEncoder(separators=(",", ":")).encode
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return fallback

    def unknown(obj: Any) -> Any:
        raise TypeError(f"{type(obj).__name__} in a skeleton")

    try:
        encoder = make(
            None, unknown, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
        )
        probe = {"v": [1, 2.5, None, True, "é"], "n": float("nan")}
        if "".join(encoder(probe, 0)) != fallback(probe):
            return fallback
    except TypeError:  # another signature in another Python version
        return fallback
    return lambda skeleton: "".join(encoder(skeleton, 0))


_SKELETON_JSON: Final = _skeleton_encoder()
_PADDING: Final = bytes(ALIGN)
VIEW_MIN_BYTES: Final = 64 << 10
"""Without ``copy``, buffers up to this size are copied all the same: one ``tobytes`` call costs
less than the four numpy calls of a view, and the channel joins small parts into one send."""
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
        skeleton = _SKELETON_JSON(
            {"v": VERSION, "root": self.root, "tensors": self.tensors, "buffers": lengths}
        ).encode()
        parts: list[bytes | memoryview] = [_LENGTH.pack(len(skeleton)), skeleton]
        size = _LENGTH.size + len(skeleton)
        for buffer, length in zip(self.buffers, lengths, strict=True):
            padding = _aligned(size) - size
            if padding:
                parts.append(_PADDING[:padding])
            if length:
                parts.append(buffer)
            size += padding + length
        return Encoded(parts, size, self.keep)


class _Encoder:
    __slots__ = ("buffers", "copy", "keep", "tensor_ids", "tensors", "to_copy")

    def __init__(self, copy: bool) -> None:
        self.copy = copy
        self.to_copy: list[int] = []  # copy mode: buffers that are arrays, copied at the end
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
        # has (it raises for everything else). torch ops such as ``detach`` and ``view``
        # release the GIL, and a thread waiting for it can hold the caller up for a whole
        # switch interval.
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
        if self.copy:
            self.to_copy.append(len(self.buffers))  # copied by copy_all()
            self.buffers.append(array)
        elif array.nbytes <= VIEW_MIN_BYTES:
            self.buffers.append(array.tobytes())  # one C call, holding the GIL
        else:
            source = np.ascontiguousarray(array)  # a copy only if strided
            self.keep.append(source)
            self.buffers.append(source.reshape(-1).view(np.uint8).data)
        return len(self.buffers) - 1

    def copy_all(self, max_bytes: int | None) -> bool:
        """Copy mode: replace the arrays by copies of their bytes; False if over *max_bytes*."""
        arrays = [(index, self.buffers[index]) for index in self.to_copy]
        if max_bytes is not None and sum(array.nbytes for _, array in arrays) > max_bytes:
            return False
        for index, array in arrays:
            if array.nbytes <= COPY_HOLDING_GIL_MAX_BYTES:
                self.buffers[index] = array.tobytes()  # one C call, holding the GIL
            else:
                self.buffers[index] = np.array(array, order="C").reshape(-1).view(np.uint8).data
        return True


def _plain_numpy_dtype(dtype: np.dtype[Any]) -> str:
    if dtype.hasobject or dtype.fields is not None or dtype.kind == "V" or dtype.subdtype:
        raise NotPlainError(f"numpy dtype {dtype}")
    return str(dtype.str)


@overload
def capture(obj: Any, *, copy: bool = ..., copy_max_bytes: None = ...) -> Captured: ...


@overload
def capture(obj: Any, *, copy: bool = ..., copy_max_bytes: int) -> Captured | None: ...


def capture(obj: Any, *, copy: bool = False, copy_max_bytes: int | None = None) -> Captured | None:
    """Take plain data apart for :meth:`Captured.encoded`.

    Args:
        obj: Plain data.
        copy: Copy every tensor's and array's bytes (a snapshot: *obj* may change afterwards).
            Without it the buffers point into *obj*'s memory.
        copy_max_bytes: With *copy*: return ``None`` (copying nothing) when the copies would
            take more than this many bytes.

    Raises:
        NotPlainError: *obj* is not plain data this encoding carries exactly; with *copy*,
            also when it holds a tensor that is not on the CPU (a snapshot of that is better
            taken without waiting for the device: the tracker's ``snapshot_plain``).
    """
    encoder = _Encoder(copy)
    root = encoder.node(obj, 0)
    if copy and not encoder.copy_all(copy_max_bytes):
        return None
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

    def __init__(self, root: Any, payload: bytearray) -> None:
        self.root = root
        self._payload = payload
        self.nbytes = len(payload)  # what the built object holds: it shares these bytes

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


def _build(node: Any, payload: bytearray, made: dict[int, torch.Tensor]) -> Any:
    kind = type(node)
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
    return _LENGTH.unpack_from(payload, 0)[0] if len(payload) >= _LENGTH.size else 0


def parse(payload: bytearray) -> Decoded:
    """Check *payload* and rebuild its structure; see :meth:`Decoded.build` for the object.

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
        root = decoder.node(skeleton["root"], 0)
    except _PARSE_ERRORS as exc:
        raise ValueError(f"malformed plain payload: {exc}") from None
    return Decoded(root, payload)


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
        self.spans = self._layout(spans)
        self.tensor_specs: Sequence[Any] = tensors
        self.tensors: dict[int, _Pending] = {}

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
            offset, length = self.spans[int(node[1])]
            return bytes(self.payload[offset : offset + length])
        if tag == "c":
            return complex(float(node[1]), float(node[2]))
        if tag == "D":
            return _torch_dtype(node[1])
        raise ValueError(f"unknown tag {tag!r}")

    def key(self, node: Any, depth: int) -> Any:
        key = self.node(node, depth)
        if type(key) is _Pending or isinstance(key, np.ndarray):
            raise ValueError("a tensor or an array as a dict key")
        return key

    def tensor(self, index: int) -> _Pending:
        seen = self.tensors.get(index)
        if seen is not None:
            return seen
        if index < 0:
            raise ValueError("bad tensor index")
        dtype_name, shape, buffer, requires_grad = self.tensor_specs[index]
        dtype, dims = _torch_dtype(dtype_name), _shape(shape)
        offset, length = self.spans[int(buffer)]
        if math.prod(dims) * dtype.itemsize != length:
            raise ValueError("tensor size does not match its buffer")
        grad = requires_grad is True and (dtype.is_floating_point or dtype.is_complex)
        pending = self.tensors[index] = _Pending(dtype, dims, offset, length, grad)
        return pending

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
