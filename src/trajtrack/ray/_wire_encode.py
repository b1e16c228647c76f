"""Plain data for the wire, on the caller's side: :func:`capture` and :func:`encode`.

The format is :mod:`trajtrack.ray._wire`'s. The acknowledged dump encodes in place
(:func:`encode`: the parts point into the tensors, sent before ``dump_data`` returns); the
pipelined one captures a copy (:func:`capture` with ``copy=True``) that its sender thread lays
out later.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Final, overload

import numpy as np
import torch

from trajtrack.ray._wire import (
    ALIGN,
    LENGTH,
    MAX_DEPTH,
    SCALARS,
    TORCH_DTYPES,
    VERSION,
    aligned,
    plain_numpy_dtype,
)
from trajtrack.tracker import NUMPY_DTYPES, NotPlainError

__all__ = [
    "COPY_HOLDING_GIL_MAX_BYTES",
    "VIEW_MIN_BYTES",
    "Captured",
    "Encoded",
    "NotPlainError",
    "capture",
    "encode",
]

logger = logging.getLogger(__name__)


@dataclass
class Encoded:
    """An encoded payload: the parts to send, in order, and their total size."""

    parts: list[bytes | memoryview] = field(default_factory=list)
    size: int = 0
    keep: list[Any] = field(default_factory=list)  # what the memoryviews point into


_DTYPE_NAMES: Final = {dtype: name for name, dtype in TORCH_DTYPES.items()}


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
        parts: list[bytes | memoryview] = [LENGTH.pack(len(skeleton)), skeleton]
        size = LENGTH.size + len(skeleton)
        for buffer, length in zip(self.buffers, lengths, strict=True):
            padding = aligned(size) - size
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
        if kind in SCALARS:
            return obj
        if kind is list:
            return ["L", [self.node(v, depth + 1) for v in obj]]
        if kind is tuple:
            return ["U", [self.node(v, depth + 1) for v in obj]]
        if kind is np.ndarray:
            dtype = plain_numpy_dtype(obj.dtype)
            return ["A", dtype, list(obj.shape), self.array(obj)]
        if kind is bytes:  # immutable: never copied
            self.buffers.append(obj)
            return ["b", len(self.buffers) - 1]
        if kind is complex:
            return ["c", obj.real, obj.imag]
        if kind is torch.dtype:
            return ["D", str(obj).removeprefix("torch.")]
        if isinstance(obj, np.generic) and type(obj).__module__ == "numpy":
            dtype = plain_numpy_dtype(obj.dtype)
            self.buffers.append(np.asarray(obj).tobytes())  # a new array: never shared
            return ["g", dtype, len(self.buffers) - 1]
        raise NotPlainError(kind.__name__)

    def key(self, key: Any) -> Any:
        if type(key) is str:
            return key
        if type(key) in SCALARS or type(key) is complex or type(key) is bytes:
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
