"""verl's objects read as data: stand-ins allow-listed under verl's, tensordict's and numpy's names.

A dumped ``verl.protocol.DataProto`` pickles as the class plus the state tuple
``(batch_bytes, non_tensor_batch, meta_info)``; verl's own ``__setstate__`` would run
``torch.load(weights_only=False)`` on ``batch_bytes``. torch's weights-only unpickler accepts
``(obj, "module.Name")`` pairs in its allow-list (``torch.serialization.add_safe_globals``), so
trajtrack allow-lists its own objects under those names (:data:`STANDIN_GLOBALS`):

* ``verl.protocol.DataProto``: :class:`DataProtoStandIn`, whose ``__setstate__`` only stores the
  state. :func:`finish` then loads ``batch_bytes`` — a ``torch.save`` archive of the batch
  TensorDict — with trajtrack's safe loader again (so forbidden globals inside are refused as
  anywhere else), decodes verl's ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy`` form from its
  tuple of dtype names, shapes and byte arrays, and returns a
  :class:`~trajtrack.rollout.RolloutBatch` (nested TensorDicts as nested dicts).
* tensordict's reductions: :mod:`trajtrack.reader._tensordict_standins`.
* numpy's reconstructors: :mod:`trajtrack._numpy_standins`.
* ``verl.experimental.fully_async_policy.detach_utils.RolloutSample`` (a dataclass):
  :class:`VerlSampleStandIn`, finished into trajtrack's
  :class:`~trajtrack.rollout.RolloutSample`; each of verl's fields has the same name there.

Neither verl, tensordict nor their code is imported: what the pickle holds is data.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Any

import numpy as np
import torch

from trajtrack._exceptions import DumpLoadError
from trajtrack._numpy_standins import (
    NUMPY_GLOBALS,
    ArrayStandIn,
    DTypeStandIn,
    mark_pending,
    take_pending,
)
from trajtrack.reader._tensordict_standins import (
    TENSORDICT_GLOBALS,
    TensorDictClass,
    TensorDictStandIn,
)

__all__ = ["STANDIN_GLOBALS", "DataProtoStandIn", "VerlSampleStandIn", "finish"]

_MAX_DEPTH = 400  # containers inside containers walked by finish
_MAX_INNER = 4  # DataProto archives inside DataProto archives
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Tensor)
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(value): value for value in vars(torch).values() if isinstance(value, torch.dtype)
}


class DataProtoStandIn:
    """``verl.protocol.DataProto`` as data: the pickled state, kept for :func:`finish`."""

    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state
        mark_pending()


class VerlSampleStandIn:
    """verl's fully-async ``RolloutSample`` as data: its field dict, kept for :func:`finish`."""

    fields: Any = None

    def __setstate__(self, state: Any) -> None:
        self.fields = state
        mark_pending()


STANDIN_GLOBALS: tuple[tuple[Any, str], ...] = (
    *NUMPY_GLOBALS,
    *TENSORDICT_GLOBALS,
    (DataProtoStandIn, "verl.protocol.DataProto"),
    (VerlSampleStandIn, "verl.experimental.fully_async_policy.detach_utils.RolloutSample"),
)
"""(stand-in, original name) pairs for ``torch.serialization.add_safe_globals``."""


class _Nesting(threading.local):
    inner = 0


_NESTING = _Nesting()


def finish(obj: Any) -> Any:
    """*obj*, as loaded with :data:`STANDIN_GLOBALS`, with every stand-in replaced.

    DataProtos become :class:`~trajtrack.rollout.RolloutBatch`, verl's ``RolloutSample``
    trajtrack's, TensorDicts nested dicts, numpy stand-ins plain arrays and dtypes. Lists, dicts
    and trajtrack's records are updated in place; shared nodes are finished once. Returns *obj*
    at once when this thread built no stand-in since the last call.

    Raises:
        DumpLoadError: A stand-in's data is malformed, or nesting is too deep.
        UnsafeLoadError: A DataProto's inner archive names a global outside the allow-list.
    """
    if take_pending() == 0:
        return obj
    try:
        return _Finisher()(obj, 0)
    except RecursionError:
        raise DumpLoadError("the object is nested too deeply to read as data") from None


class _Finisher:
    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}
        self.alive: list[Any] = []  # keeps ids unique while the walk runs

    def __call__(self, node: Any, depth: int) -> Any:
        kind = type(node)
        if kind in _PLAIN:
            return node
        key = id(node)
        if key in self.memo:
            return self.memo[key]
        if depth > _MAX_DEPTH:
            raise DumpLoadError(f"the object is nested more than {_MAX_DEPTH} deep")
        self.alive.append(node)
        if kind in (list, dict, collections.OrderedDict, collections.Counter):
            self.memo[key] = node
            items = enumerate(node) if kind is list else node.items()
            for index, value in list(items):
                node[index] = self(value, depth + 1)
            return node
        if kind is tuple:
            return self.memo.setdefault(key, tuple(self(item, depth + 1) for item in node))
        result = self._special(node, kind, depth)
        self.memo[key] = result
        return result

    def _special(self, node: Any, kind: type, depth: int) -> Any:
        if isinstance(node, np.ndarray):
            return self._array(node, depth)
        if kind is DTypeStandIn:
            return node.value
        if kind is TensorDictStandIn:
            return {k: self(v, depth + 1) for k, v in node.items.items()}
        if kind is DataProtoStandIn:
            return self._dataproto(node.state, depth)
        if kind is VerlSampleStandIn:
            return self._verl_sample(node.fields, depth)
        if kind is TensorDictClass:
            raise DumpLoadError("refusing a TensorDict class object stored as a value")
        from trajtrack.rollout import RolloutBatch, RolloutSample, ValidateMetrics

        if kind in (RolloutBatch, RolloutSample, ValidateMetrics):
            for name, value in list(vars(node).items()):
                setattr(node, name, self(value, depth + 1))
        return node

    def _array(self, array: np.ndarray[Any, Any], depth: int) -> Any:
        plain = array.view(np.ndarray) if type(array) is ArrayStandIn else array
        if plain.dtype.hasobject:
            for index in np.ndindex(plain.shape):
                plain[index] = self(plain[index], depth + 1)
        return plain

    def _dataproto(self, state: Any, depth: int) -> Any:
        from trajtrack.rollout import BatchError, RolloutBatch

        if type(state) is not tuple or len(state) != 3:
            raise DumpLoadError("refusing a DataProto whose state is not a 3-tuple")
        batch_state, non_tensor_batch, meta_info = (self(part, depth + 1) for part in state)
        if type(non_tensor_batch) is not dict or type(meta_info) is not dict:
            raise DumpLoadError("refusing a DataProto: non_tensor_batch or meta_info not a dict")
        batch = _batch(batch_state)
        try:
            return RolloutBatch(batch, non_tensor_batch, meta_info)
        except BatchError as exc:
            raise DumpLoadError(f"refusing a DataProto: {exc}") from None

    def _verl_sample(self, fields: Any, depth: int) -> Any:
        from trajtrack.rollout import RolloutSample

        if type(fields) is not dict or not all(type(name) is str for name in fields):
            raise DumpLoadError("refusing a verl RolloutSample whose state is not a field dict")
        unknown = sorted(set(fields) - set(RolloutSample.__dataclass_fields__))
        if unknown or "full_batch" not in fields:
            raise DumpLoadError(f"refusing a verl RolloutSample with fields {sorted(fields)}")
        return RolloutSample(**{name: self(value, depth + 1) for name, value in fields.items()})


def _batch(state: Any) -> dict[str, Any]:
    """A DataProto's batch from the first item of its state."""
    if state is None:
        return {}
    if type(state) is bytes:
        return _inner_archive(state)
    if type(state) is tuple and len(state) == 3:
        return _numpy_form(state)
    raise DumpLoadError(
        f"refusing a DataProto whose batch is a {type(state).__name__}: neither a torch.save "
        "archive nor verl's numpy serialization form"
    )


def _inner_archive(data: bytes) -> dict[str, Any]:
    from trajtrack.reader._safe_load import load_dump_bytes

    if _NESTING.inner >= _MAX_INNER:
        raise DumpLoadError(f"refusing DataProtos nested more than {_MAX_INNER} deep")
    _NESTING.inner += 1
    try:
        loaded = load_dump_bytes(data, where="the DataProto's batch archive")
    finally:
        _NESTING.inner -= 1
    if loaded is None:
        return {}
    if type(loaded) is not dict:
        raise DumpLoadError(f"refusing a DataProto whose batch is a {type(loaded).__name__}")
    return loaded


def _numpy_form(state: tuple[Any, ...]) -> dict[str, Any]:
    """verl's ``serialize_tensordict`` output: ``(batch_size, device, {key: encoded})``."""
    _, _, encoded = state
    if type(encoded) is not dict:
        raise DumpLoadError("refusing a DataProto in numpy form: its items are not a dict")
    out: dict[str, Any] = {}
    for key, item in encoded.items():
        if type(key) is not str or type(item) is not tuple:
            raise DumpLoadError("refusing a DataProto in numpy form: bad item")
        if len(item) != 3:
            raise DumpLoadError(
                f"refusing a DataProto in numpy form: {key!r} is not (dtype, shape, bytes) "
                "(nested tensors in verl's numpy serialization form are not supported)"
            )
        out[key] = _numpy_tensor(key, *item)
    return out


def _numpy_tensor(key: str, dtype_name: Any, shape: Any, data: Any) -> torch.Tensor:
    dtype = _TORCH_DTYPES.get(f"torch.{dtype_name}") if type(dtype_name) is str else None
    if dtype is None or type(shape) not in (tuple, torch.Size):
        raise DumpLoadError(f"refusing a DataProto in numpy form: {key!r} has a bad dtype/shape")
    if not all(type(n) is int and n >= 0 for n in shape):
        raise DumpLoadError(f"refusing a DataProto in numpy form: {key!r} has a bad shape")
    size = math.prod(shape) * dtype.itemsize
    if type(data) is not np.ndarray or data.dtype != np.uint8 or data.shape != (size,):
        raise DumpLoadError(f"refusing a DataProto in numpy form: {key!r} is not {size} bytes")
    if size == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    raw = torch.frombuffer(bytearray(data.tobytes()), dtype=torch.uint8)
    try:
        return raw.view(dtype).view(tuple(shape))
    except RuntimeError as exc:
        raise DumpLoadError(f"refusing a DataProto in numpy form: {key!r}: {exc}") from None
