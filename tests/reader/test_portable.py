"""What the load worker sends back: loadable with torch's defaults alone, rebuilt exactly."""

from __future__ import annotations

import collections
import io
from typing import Any

import numpy as np
import pytest
import torch

from trajtrack._numpy_standins import ArrayStandIn, DTypeStandIn
from trajtrack.reader._portable import TAG, UnportableError, decode, encode
from trajtrack.rollout import RolloutBatch, RolloutSample, ValidateMetrics


def through_torch_defaults(obj: Any) -> Any:
    """encode, torch.save, torch.load(weights_only=True) with torch's defaults only, decode."""
    buffer = io.BytesIO()
    torch.save(encode(obj), buffer)
    data = buffer.getvalue()
    assert torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)) == []
    return decode(torch.load(io.BytesIO(data), weights_only=True))


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (arrays: dtype, shape, bytes)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype == object:
            return all(same(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1), strict=True))
        return a.tobytes() == b.tobytes() and fortran_only(a) == fortran_only(b)
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a) and same_attrs(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (RolloutSample, ValidateMetrics, RolloutBatch)):
        return same(dict(vars(a)), dict(vars(b)))
    return bool(a == b)


def fortran_only(a: np.ndarray[Any, Any]) -> bool:
    return bool(a.flags.f_contiguous and not a.flags.c_contiguous)


def same_attrs(a: Any, b: Any) -> bool:
    return type(a) is dict or same(dict(vars(a)), dict(vars(b)))


state_dict = collections.OrderedDict(w=np.arange(3))
state_dict._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]  # as torch does

CASES: dict[str, Any] = {
    "plain": {"a": 1, "b": [1.5, "x", None, True, b"raw", 2j], "t": torch.arange(4)},
    "arrays": [
        np.arange(6, dtype=np.int16).reshape(2, 3),
        np.asfortranarray(np.ones((2, 3), dtype=np.float32)),
        np.arange(10)[::2],  # strided
        np.array(3.5),  # 0-d
        np.zeros((0, 4)),
        np.array(["ab", "c"]),
        np.array([b"ab", b"c"]),
        np.array([1 + 2j], dtype=np.complex64),
        np.array([True, False]),
        np.arange(3, dtype=">f8"),  # big-endian
        np.zeros(2, dtype=[("a", "<f8"), ("b", "S3")]),  # structured
        np.array([{"k": np.float64(1)}, [np.int8(2)], None], dtype=object),
    ],
    "scalars": [np.float64(1.5), np.int32(-3), np.str_("s"), np.bool_(True), np.uint64(7)],
    "dtypes": [np.dtype("<U3"), np.dtype(object), np.dtype([("a", "<i4")])],
    "keys": {np.int64(4): "x", ("t", np.float32(1.0)): [1], TAG: "a user's key"},
    "containers": (
        collections.Counter({"a": 2}),
        state_dict,
        {1, 2, "x"},
        {np.int8(1), np.int8(2)},
        torch.Size([2, 3]),
    ),
    "records": [
        RolloutSample(
            full_batch=RolloutBatch(
                {"r": torch.ones(2, 3)},
                {"uid": np.array(["u", "v"], dtype=object)},
                {"k": np.float64(2.0)},
            ),
            sample_id="s",
            rollout_status={"n": np.int64(3)},
        ),
        ValidateMetrics(timing_raw={"t": 1.0}, metrics={"m": np.float32(0.5)}),
    ],
    # numpy's own classes are no longer on trajtrack's list (#32): its stand-ins are.
    "globals as values": [RolloutSample, ArrayStandIn, DTypeStandIn],
}


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_through_torchs_defaults(name: str) -> None:
    obj = CASES[name]
    assert same(through_torch_defaults(obj), obj)


def test_shared_references_and_cycles_are_kept() -> None:
    array = np.arange(3)
    cycle: list[Any] = [array]
    cycle.append(cycle)
    record = ValidateMetrics(timing_raw={})
    record.metrics = {"self": record}
    out = through_torch_defaults({"a": array, "b": array, "cycle": cycle, "record": record})
    assert out["a"] is out["b"]
    assert out["cycle"][1] is out["cycle"] and out["cycle"][0] is out["a"]
    assert out["record"].metrics["self"] is out["record"]


def test_decoded_arrays_are_writable_and_own_their_rows() -> None:
    out = through_torch_defaults({"a": np.arange(4)})
    out["a"][0] = 10
    assert out["a"].tolist() == [10, 1, 2, 3]


@pytest.mark.parametrize(
    "node",
    [
        {TAG: "exec", "code": "print(1)"},
        {TAG: 3},
        {TAG: "global", "name": "os.system"},
        {TAG: "record", "class": "Popen", "state": {}},
        {TAG: "array", "descr": "<f8", "shape": [2], "order": "C", "data": torch.zeros(16)},
        {
            "__trajtrack_portable__": "array",
            "descr": "<f8",
            "shape": [2],
            "order": "C",
            "data": torch.zeros(20, dtype=torch.uint8),
        },  # more bytes than the shape needs
        {TAG: "array", "descr": "<f8", "shape": [-1], "order": "C", "data": torch.zeros(0)},
        {TAG: "array", "descr": "|O", "shape": [2], "items": [1]},
        {TAG: "array", "descr": [("a", "|O")], "shape": [1], "order": "C", "data": torch.zeros(8)},
        {TAG: "mapping", "type": "defaultdict", "items": [], "attrs": {}},
        {TAG: "record", "class": "RolloutBatch", "state": {"version": 99}},
    ],
)
def test_malformed_tags_are_refused(node: dict[str, Any]) -> None:
    with pytest.raises(UnportableError):
        decode(node)


def test_what_cannot_be_encoded_is_an_error() -> None:
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(UnportableError, match="deeply nested"):
        encode(deep)
    with pytest.raises(UnportableError, match="cannot be passed back"):
        encode(np.zeros(1, dtype=[("a", "O")]))
