"""trajtrack's stand-ins for numpy's reconstructors agree with numpy's own unpickling (#32).

Each value is saved with ``torch.save`` and read back twice: by ``torch.load(weights_only=False)``
(numpy's own reconstructors: the independent answer) and by ``torch.load(weights_only=True)``
with :data:`STANDIN_GLOBALS` plus :func:`finish`. They must agree on dtype (byte order
included), shape, memory order and values.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch

import trajtrack
from trajtrack.reader._standins import STANDIN_GLOBALS, finish

VALUES: dict[str, Any] = {
    "float32": np.arange(6, dtype=np.float32).reshape(2, 3),
    "big-endian": np.arange(4, dtype=">f8"),
    "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    "bool": np.array([True, False, True]),
    "complex": np.array([1 + 2j, -3j], dtype=np.complex64),
    "unicode": np.array(["ab", "c"]),
    "bytes": np.array([b"xy", b"z"]),
    "uint8 empty": np.zeros((0, 4), dtype=np.uint8),
    "object": np.array(["uid-0", {"role": "user"}, [1, 2], None], dtype=object),
    "object 2-d fortran": np.asfortranarray(np.array([["a", 1], [2.5, None]], dtype=object)),
    "nested object": np.array([np.arange(3), np.array(["s"])], dtype=object),
    "scalars": [np.float64(0.7), np.int64(-5), np.bool_(True), np.float16(1.5), np.uint32(7)],
    "dtype values": {"f": np.dtype("float32"), "o": np.dtype(object), "u": np.dtype("<U3")},
}


def saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def with_standins(data: bytes) -> Any:
    with torch.serialization.safe_globals(list(STANDIN_GLOBALS)):
        return finish(torch.load(io.BytesIO(data), weights_only=True))


def assert_agrees(got: Any, want: Any) -> None:
    if isinstance(want, np.ndarray):
        assert type(got) is np.ndarray  # finished: not the stand-in subclass
        assert got.dtype == want.dtype and got.dtype.byteorder == want.dtype.byteorder
        assert got.shape == want.shape and got.flags.f_contiguous == want.flags.f_contiguous
        if want.dtype.hasobject:
            for g, w in zip(got.reshape(-1, order="A"), want.reshape(-1, order="A"), strict=True):
                assert_agrees(g, w)
        else:
            assert got.tobytes(order="A") == want.tobytes(order="A")
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want)
        for key in want:
            assert_agrees(got[key], want[key])
    elif isinstance(want, list):
        assert type(got) is list and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_agrees(g, w)
    else:
        assert type(got) is type(want) and got == want


@pytest.mark.parametrize("name", list(VALUES))
def test_standins_agree_with_numpys_own_unpickling(name: str) -> None:
    data = saved(VALUES[name])
    assert_agrees(with_standins(data), torch.load(io.BytesIO(data), weights_only=False))


def test_shared_nodes_are_finished_once() -> None:
    array = np.array(["a", "b"], dtype=object)
    loaded = with_standins(saved({"x": array, "y": [array, array]}))
    assert loaded["x"] is loaded["y"][0] is loaded["y"][1]
    assert type(loaded["x"]) is np.ndarray


def test_nesting_past_the_bound_is_a_typed_error() -> None:
    deep: Any = np.array([1.0])
    for _ in range(420):  # past finish's bound of 400, within what pickle can write
        deep = [deep]
    with pytest.raises(trajtrack.DumpLoadError, match="nested"):
        with_standins(saved(deep))


def test_without_standins_built_finish_returns_the_object_itself() -> None:
    finish(None)  # clears what earlier loads in this thread left pending
    value = [torch.ones(2), {"k": [1]}]
    assert finish(value) is value


def test_trajtracks_allow_list_has_none_of_numpys_own_reconstructors() -> None:
    """What `trajtrack show`/`diff` add to their own process (#32 item 1)."""
    from trajtrack.reader._safe_load import allowed_globals

    targets = [g[0] if isinstance(g, tuple) else g for g in allowed_globals()]
    numpy_own = [np.empty(0).__reduce__()[0], np.float64(0).__reduce__()[0], np.ndarray, np.dtype]
    assert not any(target is own for target in targets for own in numpy_own)
    names = {g[1] for g in allowed_globals() if isinstance(g, tuple)}
    assert {"numpy.ndarray", "verl.protocol.DataProto"} <= names
