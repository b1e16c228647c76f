"""numpy's pickle reconstructors, re-done from data only, for torch's weights-only unpickler.

numpy pickles an array as ``_reconstruct(ndarray, (0,), b"b")`` followed by a BUILD with the
state ``(version, shape, dtype, is_fortran, data)``, a dtype as ``dtype(code, align, copy)``
plus a BUILD with ``(version, byteorder, subarray, names, fields, elsize, alignment, flags)``,
and a scalar as ``scalar(dtype, bytes)``. Allow-listing numpy's own reconstructors lets a file
choose a dtype's flags: an object dtype pickled with flags 0 makes numpy read file bytes as
``PyObject`` pointers (issue #32: a segfault in ``show``/``diff``). The stand-ins here are
allow-listed under numpy's names through torch's public ``(obj, "module.Name")`` pairs instead:

* a dtype is rebuilt from its type code alone (``np.dtype("<f4")``); the pickled flags,
  alignment and sizes are checked or ignored, never applied; structured, sub-array and
  datetime dtypes are refused;
* an array gets numpy's own BUILD with that rebuilt dtype: a numeric array from bytes whose
  length is checked against its shape, an object array from the list of objects the unpickler
  built; raw bytes for an object array are refused.

:class:`ArrayStandIn` is an ``ndarray`` subclass (a BUILD cannot replace the object on the
unpickler's stack); :func:`trajtrack.reader._standins.finish` turns it into a plain ndarray.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

import numpy as np

from trajtrack._exceptions import DumpLoadError

__all__ = ["NUMPY_GLOBALS", "ArrayStandIn", "DTypeStandIn", "pending", "take_pending"]

# Type codes numpy writes for the dtypes a batch holds: bool, ints, floats, complex, object,
# fixed-width str and bytes. Anything else (structured, "V", datetimes) is refused.
_CODE = re.compile(r"(b1|[iu][1248]|f(2|4|8|12|16)|c(8|16|24|32)|O[48]|[US][0-9]{1,9})\Z")
_BYTEORDERS = frozenset("<>|=")


class _Pending(threading.local):
    count = 0


_PENDING = _Pending()


def pending() -> int:
    """How many stand-ins this thread built that :func:`finish` has not yet replaced."""
    return _PENDING.count


def take_pending() -> int:
    """The pending count, reset to 0."""
    count, _PENDING.count = _PENDING.count, 0
    return count


def mark_pending() -> None:
    """Record that a stand-in needing :func:`finish` was built in this thread."""
    _PENDING.count += 1


def _refuse(what: str) -> DumpLoadError:
    return DumpLoadError(f"refusing a numpy pickle: {what}")


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


class DTypeStandIn:
    """What ``numpy.dtype(code, align, copy)`` plus its BUILD becomes: :attr:`value`."""

    value: np.dtype[Any]

    def __init__(self, code: Any = None, align: Any = False, copy: Any = True) -> None:
        if type(code) is not str or not _CODE.match(code):
            raise _refuse(f"unsupported dtype code {code!r:.40}")
        if type(align) is not bool or type(copy) is not bool:
            raise _refuse("dtype arguments are not booleans")
        self.code = code
        # A dtype without a BUILD (numpy always writes one) is the code's native dtype.
        self.value = _dtype(code)
        mark_pending()

    def __setstate__(self, state: Any) -> None:
        if type(state) is not tuple or len(state) not in (8, 9) or state[0] not in (3, 4):
            raise _refuse("dtype state of the wrong shape")
        byteorder, subarray, names, fields, elsize = state[1:6]
        if len(state) == 9 and state[8] is not None:
            raise _refuse("dtype metadata is not supported")
        if subarray is not None or names is not None or fields is not None:
            raise _refuse("structured and sub-array dtypes are not supported")
        if byteorder not in _BYTEORDERS:
            raise _refuse(f"dtype byte order {byteorder!r:.20}")
        dtype = _dtype(byteorder + self.code)  # numpy's own normalization ("<f4" is native)
        if type(elsize) is not int or elsize not in (-1, dtype.itemsize):
            raise _refuse(f"dtype size {elsize!r:.20} does not match {self.code}")
        self.value = dtype  # state[6] (alignment) and state[7] (flags) are never applied


def _dtype(code: str) -> np.dtype[Any]:
    try:
        return np.dtype(code)
    except TypeError:  # a code of this pattern numpy does not have here ("O4", "f12"...)
        raise _refuse(f"unsupported dtype code {code!r}") from None


class ArrayStandIn(np.ndarray):
    """What numpy's ``_reconstruct`` plus the array's BUILD becomes (an ndarray subclass)."""

    def __setstate__(self, state: Any) -> None:
        if type(state) is not tuple or len(state) != 5 or state[0] != 1:
            raise _refuse("array state of the wrong shape")
        _, shape, dtype_in, fortran, data = state
        if type(shape) is not tuple or not all(_is_count(n) for n in shape):
            raise _refuse("array shape is not a tuple of sizes")
        if type(dtype_in) is not DTypeStandIn or type(fortran) is not bool:
            raise _refuse("array dtype or order of the wrong type")
        dtype = dtype_in.value
        count = math.prod(shape)
        if dtype.hasobject:
            if type(data) is not list or len(data) != count:
                raise _refuse("an object array's items are not a list of the array's size")
        elif type(data) is not bytes or len(data) != count * dtype.itemsize:
            raise _refuse(f"array data is not {count * dtype.itemsize} bytes")
        # numpy's own BUILD, with a state whose every part is checked: a dtype rebuilt from its
        # code (so an object dtype always takes its items from the list, never from bytes).
        checked: Any = (1, shape, dtype, fortran, data)
        super().__setstate__(checked)
        mark_pending()


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> ArrayStandIn:
    """numpy's ``_reconstruct(ndarray, (0,), b"b")``: an empty array awaiting its BUILD."""
    if cls is not ArrayStandIn or shape != (0,) or typecode not in (b"b", "b"):
        raise _refuse("unexpected _reconstruct arguments")
    result: ArrayStandIn = np.ndarray.__new__(ArrayStandIn, (0,), np.dtype("b"))
    return result


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()``, how pickle writes ``b""`` (an empty array's data); nothing else."""
    if args:
        raise _refuse("bytes() with arguments")
    return b""


def _scalar(dtype_in: Any, data: Any = None) -> Any:
    """numpy's ``scalar(dtype, bytes)``: one numeric value from exactly its bytes."""
    if type(dtype_in) is not DTypeStandIn:
        raise _refuse("scalar dtype of the wrong type")
    dtype = dtype_in.value
    if dtype.hasobject:
        raise _refuse("object scalars are not supported")
    if type(data) is not bytes or len(data) != dtype.itemsize:
        raise _refuse(f"scalar data is not {dtype.itemsize} bytes")
    return np.frombuffer(data, dtype=dtype)[0]


_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")

NUMPY_GLOBALS: tuple[tuple[Any, str], ...] = (
    (ArrayStandIn, "numpy.ndarray"),
    (DTypeStandIn, "numpy.dtype"),
    *((_reconstruct, f"{module}._reconstruct") for module in _MODULES),
    *((_scalar, f"{module}.scalar") for module in _MODULES),
    (_empty_bytes, "builtins.bytes"),
)
"""(stand-in, numpy's name) pairs for ``torch.serialization.add_safe_globals``."""
