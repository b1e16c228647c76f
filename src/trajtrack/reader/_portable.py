"""An object loaded with trajtrack's allow-list, in a form that torch's defaults alone can load.

trajtrack's load worker (:mod:`trajtrack.reader._load_worker`) unpickles a dump with
trajtrack's allow-list in a process of its own, and must hand the object back to a caller whose
allow-list it may not widen: the caller loads the reply with ``torch.load(weights_only=True)``
and nothing but the process's own list. So before saving the object, the worker replaces what
only trajtrack's list can build, with :func:`encode`:

* the rollout records (``RolloutSample``, ``ValidateMetrics``, ``RolloutBatch``) by their
  class name and state;
* numpy arrays, scalars and dtypes by their dtype description (``numpy.lib.format``), shape
  and raw bytes (a ``uint8`` tensor), or, for object arrays, their encoded items;
* trajtrack's allow-listed globals themselves (a class or function stored as a value) by name;
* containers are rebuilt around the encoded items; mappings whose keys are not plain values,
  and plain dicts that happen to use the tag key, become tagged item lists.

Each replacement is a plain dict carrying the key :data:`TAG`; everything else (tensors, torch
types, strings, numbers) passes through. The caller rebuilds the objects from the tags with
:func:`decode`, from a fixed table of classes: nothing in the reply names a function to call.
Shared references and cycles are kept (both sides memoize by identity).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch

from trajtrack.rollout import SAFE_GLOBALS, RolloutBatch, RolloutSample, ValidateMetrics

__all__ = ["TAG", "UnportableError", "decode", "encode"]

TAG = "__trajtrack_portable__"

_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray)
_RECORDS: dict[str, type[Any]] = {
    cls.__qualname__: cls for cls in (RolloutSample, ValidateMetrics, RolloutBatch)
}
_MAPPINGS: dict[str, type[dict[Any, Any]]] = {
    "dict": dict,
    "OrderedDict": collections.OrderedDict,
    "Counter": collections.Counter,
}
_GLOBALS: dict[str, Any] = {
    g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}": (
        g[0] if isinstance(g, tuple) else g
    )
    for g in SAFE_GLOBALS
}
_GLOBAL_NAMES: dict[int, str] = {id(g): name for name, g in _GLOBALS.items()}


class UnportableError(ValueError):
    """The object cannot be encoded, or the encoded form is malformed."""


def encode(obj: Any) -> Any:
    """*obj* with everything outside torch's default allow-list replaced by tagged plain data.

    Raises:
        UnportableError: Something in *obj* has no portable form (e.g. too deeply nested).
    """
    try:
        return _Encoder()(obj)
    except RecursionError:
        raise UnportableError("the object is too deeply nested") from None


def decode(tree: Any) -> Any:
    """The object :func:`encode` encoded.

    Raises:
        UnportableError: A tag is malformed.
    """
    try:
        return _Decoder()(tree)
    except RecursionError:
        raise UnportableError("the object is too deeply nested") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        if isinstance(exc, UnportableError):
            raise
        raise UnportableError(f"malformed reply: {type(exc).__name__}: {exc}") from exc


_NOTHING: Any = object()


class _Walk:
    """A walk over a tree whose nodes may be shared and lists may hold cycles: each node is
    turned into its counterpart once (``memo``, by id; ``alive`` keeps the originals so that
    no id is reused meanwhile)."""

    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}
        self.alive: list[Any] = []

    def __call__(self, node: Any) -> Any:
        kind = type(node)
        if kind in _PLAIN:
            return node
        early = self._early(node)
        if early is not _NOTHING:
            return early
        key = id(node)
        if key in self.memo:
            return self.memo[key]
        self.alive.append(node)
        if kind is list or kind is tuple:
            return self._sequence(node, key)
        return self._node(node, kind, key)

    def _early(self, node: Any) -> Any:
        """What *node* becomes without the memo, or ``_NOTHING``."""
        return _NOTHING

    def _node(self, node: Any, kind: type, key: int) -> Any:
        """What a node that is not plain data, a list or a tuple becomes (memoized by id)."""
        raise NotImplementedError

    def _sequence(self, node: list[Any] | tuple[Any, ...], key: int) -> Any:
        """A list (memoized first: a cycle through it comes back to it) or a tuple (memoized
        after its items, unless a cycle through a list already did), its items walked."""
        if type(node) is list:
            items: list[Any] = []
            self.memo[key] = items
            items.extend(self(item) for item in node)
            return items
        walked = tuple(self(item) for item in node)
        return self.memo.setdefault(key, walked)


class _Encoder(_Walk):
    def _early(self, node: Any) -> Any:
        name = _GLOBAL_NAMES.get(id(node))
        if name is not None and _GLOBALS[name] is node:
            return {TAG: "global", "name": name}
        return _NOTHING

    def _node(self, obj: Any, kind: type, key: int) -> Any:
        if kind in (dict, collections.OrderedDict, collections.Counter):
            return self._mapping(obj, key)
        if kind is set:
            return self._set(obj, key)
        if kind is np.ndarray or isinstance(obj, np.generic):
            return self._array(obj, key)
        if isinstance(obj, np.dtype):
            return {TAG: "dtype", "descr": np.lib.format.dtype_to_descr(obj)}
        if kind in _RECORDS.values():
            return self._record(obj, key)
        return obj  # tensors and torch's other types: torch's defaults load them

    def _mapping(self, obj: dict[Any, Any], key: int) -> Any:
        kind = type(obj)
        attrs = vars(obj) if kind is not dict else {}  # e.g. a state dict's ``_metadata``
        plain = all(type(k) in _PLAIN for k in obj) and not attrs
        if plain and not (kind is dict and TAG in obj):
            out = kind()
            self.memo[key] = out
            for k, v in obj.items():
                out[k] = self(v)
            return out
        tagged: dict[str, Any] = {TAG: "mapping", "type": kind.__name__, "items": []}
        self.memo[key] = tagged
        tagged["items"].extend([self(k), self(v)] for k, v in obj.items())
        tagged["attrs"] = self(dict(attrs))
        return tagged

    def _set(self, obj: set[Any], key: int) -> Any:
        if all(type(item) in _PLAIN for item in obj):
            return self.memo.setdefault(key, set(obj))
        tagged: dict[str, Any] = {TAG: "set", "items": []}
        self.memo[key] = tagged
        tagged["items"].extend(self(item) for item in obj)
        return tagged

    def _array(self, obj: Any, key: int) -> Any:
        scalar = not isinstance(obj, np.ndarray)
        array: np.ndarray[Any, Any] = np.asarray(obj)
        descr = np.lib.format.dtype_to_descr(array.dtype)
        tagged: dict[str, Any] = {TAG: "scalar" if scalar else "array", "descr": descr}
        tagged["shape"] = list(array.shape)
        self.memo[key] = tagged
        if array.dtype.hasobject:
            if array.dtype != np.dtype(object):
                raise UnportableError(f"arrays of dtype {array.dtype} cannot be passed back")
            tagged["items"] = [self(item) for item in array.reshape(-1).tolist()]
            return tagged
        order: Literal["C", "F"] = "C"
        if array.flags.f_contiguous and not array.flags.c_contiguous:
            order = "F"
        contiguous = np.asfortranarray(array) if order == "F" else np.ascontiguousarray(array)
        if not contiguous.flags.writeable:  # torch.from_numpy wants writable memory
            contiguous = contiguous.copy(order=order)
        if array.dtype.itemsize and contiguous.size:
            raw = contiguous.reshape(-1, order=order).view(np.uint8)
        else:
            raw = np.empty(0, dtype=np.uint8)
        tagged["order"] = order
        tagged["data"] = torch.from_numpy(raw)
        return tagged

    def _record(self, obj: Any, key: int) -> Any:
        kind = type(obj)
        tagged: dict[str, Any] = {TAG: "record", "class": kind.__qualname__}
        self.memo[key] = tagged
        getstate = kind.__dict__.get("__getstate__")  # the class's own, never an instance's
        try:
            state = getstate(obj) if getstate is not None else dict(vars(obj))
        except (AttributeError, TypeError) as exc:  # an instance the unpickler left unbuilt
            raise UnportableError(f"a {kind.__name__} without its state: {exc}") from exc
        tagged["state"] = self(state)
        return tagged


class _Decoder(_Walk):
    def _node(self, node: Any, kind: type, key: int) -> Any:
        if kind is dict and TAG in node:
            return self._tagged(node, key)
        if kind in (dict, collections.OrderedDict, collections.Counter):
            out: dict[Any, Any] = kind()
            self.memo[key] = out
            for k, v in node.items():
                out[k] = self(v)
            return out
        if kind is set:
            return self.memo.setdefault(key, set(node))
        return node

    def _tagged(self, node: dict[str, Any], key: int) -> Any:
        builders: dict[str, Callable[[dict[str, Any], int], Any]] = {
            "global": self._global,
            "mapping": self._mapping,
            "set": self._set,
            "array": self._array,
            "scalar": self._array,
            "dtype": self._dtype,
            "record": self._record,
        }
        builder = builders.get(node[TAG]) if isinstance(node[TAG], str) else None
        if builder is None:
            raise UnportableError(f"unknown tag {node[TAG]!r}")
        return builder(node, key)

    def _global(self, node: dict[str, Any], key: int) -> Any:
        return _GLOBALS[node["name"]]

    def _mapping(self, node: dict[str, Any], key: int) -> Any:
        out = _MAPPINGS[node["type"]]()
        self.memo[key] = out
        for k, v in node["items"]:
            out[self(k)] = self(v)
        attrs = self(node["attrs"])
        if attrs:
            vars(out).update(attrs)
        return out

    def _set(self, node: dict[str, Any], key: int) -> Any:
        out: set[Any] = set()
        self.memo[key] = out
        out.update(self(item) for item in node["items"])
        return out

    def _dtype(self, node: dict[str, Any], key: int) -> Any:
        return _dtype_of(node["descr"])

    def _array(self, node: dict[str, Any], key: int) -> Any:
        dtype = _dtype_of(node["descr"])
        shape = tuple(node["shape"])
        if not all(type(n) is int and n >= 0 for n in shape):
            raise UnportableError(f"bad shape {shape!r}")
        scalar = node[TAG] == "scalar"
        if dtype.hasobject and not scalar:  # numpy has no object scalars
            array: np.ndarray[Any, Any] = np.empty(shape, dtype=object)
            self.memo[key] = array
            items = node["items"]
            if type(items) is not list or len(items) != array.size:
                raise UnportableError("object array with the wrong number of items")
            flat = array.reshape(-1)  # a view: the array is C-contiguous
            for index, item in enumerate(items):
                flat[index] = self(item)
            return array
        data, order = node["data"], node["order"]
        size = math.prod(shape) * dtype.itemsize
        if type(data) is not torch.Tensor or data.dtype != torch.uint8 or data.numel() != size:
            raise UnportableError("array data of the wrong type or size")
        if order not in ("C", "F") or dtype.hasobject:
            raise UnportableError(f"bad array order {order!r} or dtype {dtype}")
        buffer = data.reshape(-1).numpy()
        array = np.ndarray(shape, dtype=dtype, buffer=buffer, order=order)
        result = array[()] if scalar else array
        self.memo[key] = result
        return result

    def _record(self, node: dict[str, Any], key: int) -> Any:
        cls = _RECORDS[node["class"]]
        obj = object.__new__(cls)  # what the unpickler's NEWOBJ made, before the state
        self.memo[key] = obj
        state = self(node["state"])
        # What the weights-only unpickler did with the state in the worker (its BUILD).
        setstate = getattr(cls, "__setstate__", None)
        if setstate is not None:
            setstate(obj, state)
        elif isinstance(state, dict):
            vars(obj).update(state)
        else:
            raise UnportableError(f"bad {cls.__name__} state")
        return obj


def _dtype_of(descr: Any) -> np.dtype[Any]:
    if not isinstance(descr, (str, list)):
        raise UnportableError(f"bad dtype description {descr!r}")
    parse: Any = np.lib.format.descr_to_dtype  # its stub allows structured descriptions only
    dtype: np.dtype[Any] = parse(descr)
    if dtype.hasobject and dtype != np.dtype(object):
        raise UnportableError(f"dtype {dtype} cannot be passed back")
    return dtype
