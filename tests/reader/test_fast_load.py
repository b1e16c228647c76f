"""The fast loader: the objects ``torch.load(weights_only=True)`` builds, or it declines.

Every accepted archive is checked against torch's own loader on the same bytes: types,
containers, tensor dtype, shape, strides, offsets, gradients, bits, and which tensors share a
storage. Everything outside its table is declined (torch then decides), hostile pickles
included, and nothing they name runs.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import struct
import tracemalloc
import warnings
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trajtrack.reader._safe_load as safe_load
from trajtrack.reader._fast_load import DECLINED, fast_load, only_default_globals
from trajtrack.tracker._archive import write_archive


def saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def archived(obj: Any) -> bytes:
    buffer = io.BytesIO()
    write_archive(obj, buffer)
    return buffer.getvalue()


def torch_load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def assert_identical(got: Any, want: Any, storages: dict[int, int], where: str = "") -> None:
    """Same types all the way down; tensors equal in every attribute and bit, and sharing
    storages exactly where torch's result shares them (*storages*: want's -> got's)."""
    assert type(got) is type(want), f"{where}: {type(got)} vs {type(want)}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
        assert got.storage_offset() == want.storage_offset(), where
        assert (got.requires_grad, got.is_leaf) == (want.requires_grad, want.is_leaf), where
        assert (got._base is None) == (want._base is None), f"{where}: a view"
        assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes(), where
        got_bytes = bytes(got.untyped_storage())
        assert got_bytes == bytes(want.untyped_storage()), f"{where}: bits differ"
        pointer = want.untyped_storage().data_ptr()
        mine = got.untyped_storage().data_ptr()
        assert storages.setdefault(pointer, mine) == mine, f"{where}: storage sharing"
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_identical(got[key], want[key], storages, f"{where}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_identical(g, w, storages, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def _shared() -> list[torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return [base, base[1:3, ::2], base.t(), base[3], base]


ACCEPTED: dict[str, Any] = {
    "4 KB sample": {"index": 7, "values": torch.arange(1000, dtype=torch.float32)},
    "views share a storage": _shared(),
    "every v2 dtype": [
        torch.ones(3, dtype=dtype)
        for dtype in (
            torch.float64,
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.complex128,
        )
    ],
    "v3 dtypes": [torch.zeros(3, dtype=torch.uint16), torch.zeros(2, dtype=torch.uint32)],
    "empty and 0-dim": [torch.zeros(0), torch.zeros(3, 0), torch.tensor(2.5)],
    "gradients": {"w": torch.ones(2, requires_grad=True), "b": torch.zeros(2)},
    "scalars": [1, -(2**70), 2.5, float("inf"), "text", b"raw", None, True, 1 + 2j],
    "containers": {"t": (1, (2, [3])), "s": {1, 2}, "o": OrderedDict(a=torch.ones(1))},
    "torch values": [torch.float16, torch.bool, torch.device("cpu"), torch.Size([2, 3])],
    "tensor in a tuple in a list": [(torch.ones(2), torch.ones(2))],
    "not contiguous": torch.arange(30.0).reshape(5, 6)[:, 1::2],
    "whole storages of every rank": [torch.arange(24.0).reshape(2, 3, 4), torch.ones(1, 5)],
    "odd strides of extent-1 dimensions": [
        torch.empty_strided((1,), (7,)).fill_(3.0),
        torch.empty_strided((2, 1, 3), (3, 9, 1)).fill_(1.0),
    ],
    "a tensor over part of its storage": torch.arange(10.0)[2:],
}


@pytest.mark.parametrize("writer", [saved, archived], ids=["torch.save", "archive writer"])
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted_archives_load_as_torch_loads_them(name: str, writer: Any) -> None:
    data = writer(ACCEPTED[name])
    got = fast_load(data)
    assert got is not DECLINED
    assert_identical(got, torch_load(data), {})
    assert only_default_globals(data)


def test_shared_references_and_self_reference_survive() -> None:
    shared = [torch.ones(2)]
    cyclic: list[Any] = [1]
    cyclic.append(cyclic)
    got = fast_load(saved({"a": shared, "b": shared, "c": cyclic}))
    assert got["a"] is got["b"]
    assert got["c"][1] is got["c"]


def test_equal_views_stay_distinct_keys() -> None:
    base = torch.arange(4.0)
    data = saved({base: "whole", base[:]: "view", "s": {base, base[:]}})
    got, want = fast_load(data), torch_load(data)
    assert len(got) == len(want) == 3
    assert sorted(v for k, v in got.items() if isinstance(k, torch.Tensor)) == ["view", "whole"]
    assert len(got["s"]) == 2


def test_loaded_tensors_own_their_memory() -> None:
    data = bytearray(saved(torch.arange(4.0)))
    got = fast_load(bytes(data))
    got.add_(1)  # writable, and not a view of the bytes given
    assert got.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert torch_load(bytes(data)).tolist() == [0.0, 1.0, 2.0, 3.0]


class Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


DECLINED_OBJECTS: dict[str, Any] = {
    "numpy array": np.arange(3),
    "Counter (torch allows it, this table does not)": Counter(a=1),
    "frozenset (torch refuses it)": frozenset({1}),
    "bytearray": bytearray(b"xy"),
    "parameter": torch.nn.Parameter(torch.ones(2)),
    "sparse tensor": torch.eye(2).to_sparse(),
    "tensor with an attribute": (lambda t: (setattr(t, "note", 1), t)[1])(torch.ones(1)),
    "negative view": torch.ones(2, dtype=torch.complex64).conj(),
}


@pytest.mark.parametrize("name", list(DECLINED_OBJECTS))
def test_what_is_not_in_the_table_is_declined(name: str) -> None:
    assert fast_load(saved(DECLINED_OBJECTS[name])) is DECLINED


def test_a_hostile_pickle_is_declined_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = saved({"x": Marker(str(marker)), "t": torch.ones(2)})
    assert fast_load(data) is DECLINED
    assert not only_default_globals(data)
    assert not marker.exists()


def rezipped(data: bytes, change: Any = None, method: int = zipfile.ZIP_STORED) -> bytes:
    """*data*'s records written again by Python's zipfile, with the header fields torch's
    writer uses (UTF-8 flag, no attributes), each record's bytes passed through
    ``change(name, body)`` (a list of bodies: the record written that many times)."""
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w") as target:
        warnings.simplefilter("ignore")  # zipfile: "Duplicate name"
        for record in source.infolist():
            body = source.read(record)
            bodies = change(record.filename, body) if change else body
            for each in bodies if isinstance(bodies, list) else [bodies]:
                info = zipfile.ZipInfo(record.filename, date_time=(1980, 1, 1, 0, 0, 0))
                info.flag_bits, info.external_attr, info.compress_type = 0x800, 0, method
                target.writestr(info, each)
    return out.getvalue()


def _replace_pickle(data: bytes, pickled: bytes) -> bytes:
    """*data* with its data.pkl record replaced."""
    return rezipped(data, lambda name, body: pickled if name.endswith("/data.pkl") else body)


def _rebuild_args_pickle(size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> bytes:
    """A pickle of one tensor over storage '0' (1,000 floats) with the geometry given."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", torch.FloatStorage, "0", "cpu", 1000) if obj == "S" else None

    rebuild = torch.ones(1).__reduce_ex__(2)[0]
    buffer = io.BytesIO()
    args = ("S", offset, size, stride, False, OrderedDict())
    Pickler(buffer, protocol=2).dump(_Reduce(rebuild, args))
    return buffer.getvalue()


class _Reduce:
    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


@pytest.mark.parametrize(
    ("size", "stride", "offset"),
    [
        ((2000,), (1,), 0),
        ((10,), (1,), 995),
        ((2, 2), (999, 1), 0),
        ((3,), (-1,), 2),
        ((1000,), (1,), 1),
    ],
    ids=[
        "too long",
        "offset past the end",
        "stride past the end",
        "negative stride",
        "the storage's shape, one element on",
    ],
)
def test_a_tensor_outside_its_storage_is_never_built(
    size: tuple[int, ...], stride: tuple[int, ...], offset: int
) -> None:
    data = _replace_pickle(saved(torch.zeros(1000)), _rebuild_args_pickle(size, stride, offset))
    assert fast_load(data) is DECLINED


def test_the_sample_geometry_itself_is_accepted() -> None:
    # The crafted archives above differ from this one only in their geometry.
    data = _replace_pickle(saved(torch.zeros(1000)), _rebuild_args_pickle((10,), (2,), 5))
    got = fast_load(data)
    assert got is not DECLINED
    assert_identical(got, torch_load(data), {})


@pytest.mark.parametrize(
    "damage",
    [
        "truncated",
        "compressed",
        "storage too short",
        "big endian",
        "garbage",
        "a record twice",
        "another format version",
        "a record marked as a directory",
    ],
)
def test_malformed_archives_are_declined(damage: str) -> None:
    data = saved({"v": torch.arange(100.0)})
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "compressed":
        data = rezipped(data, method=zipfile.ZIP_DEFLATED)
    elif damage == "storage too short":
        data = rezipped(data, lambda name, body: body[:-4] if "/data/" in name else body)
    elif damage == "big endian":
        data = rezipped(data, lambda name, body: b"big" if name.endswith("/byteorder") else body)
    elif damage == "a record twice":
        data = rezipped(data, lambda name, body: [body, body[::-1]] if "/data/" in name else body)
    elif damage == "another format version":
        data = rezipped(data, lambda name, body: b"9\n" if name.endswith("/version") else body)
    elif damage == "a record marked as a directory":
        data = _with_external_attributes(data, "archive/data/0", 0x10)
    else:
        data = struct.pack("<I", 0x06054B50) + os.urandom(200)
    assert fast_load(data) is DECLINED


def _with_external_attributes(data: bytes, name: str, attributes: int) -> bytes:
    """*data* rezipped, with the central directory entry of *name* given these attributes."""
    raw = bytearray(rezipped(data))
    directory = struct.unpack_from("<I", raw, len(raw) - 6)[0]  # from the end record
    entry = raw.index(name.encode(), directory) - 46  # the fixed part of its entry comes first
    raw[entry + 38 : entry + 42] = struct.pack("<I", attributes)
    assert fast_load(rezipped(data)) is not DECLINED  # the same archive but for that field
    return bytes(raw)


def test_a_rezipped_archive_is_still_accepted() -> None:
    # The damaged archives above are all rewritten by rezipped(): this one, undamaged, loads.
    data = rezipped(saved({"v": torch.arange(100.0)}))
    got = fast_load(data)
    assert got is not DECLINED
    assert_identical(got, torch_load(data), {})


def test_the_safe_loader_goes_to_torch_only_for_what_is_declined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = torch.load

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    plain = saved({"v": torch.ones(3)})
    assert safe_load.load_dump_bytes(plain)["v"].tolist() == [1.0, 1.0, 1.0]
    safe_load.check_loadable(plain)
    assert calls == []
    assert safe_load.load_dump_bytes(saved(Counter(a=2))) == Counter(a=2)
    assert calls == [1]


def test_flipped_bytes_decline_or_load_what_torch_loads() -> None:
    # Differential: whatever a damaged archive gives, the fast path never accepts what torch
    # refuses, and never builds something else.
    rng = random.Random(int(os.environ.get("SEED", "1234")))
    original = saved({"i": 3, "v": torch.arange(64, dtype=torch.int16).reshape(8, 8).t()})
    accepted = 0
    for _ in range(1500):
        data = bytearray(original)
        for _ in range(rng.choice((1, 2, 4))):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        got = fast_load(bytes(data))
        if got is DECLINED:
            continue
        accepted += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Detected pickle protocol 0": a flipped PROTO
            want = torch_load(bytes(data))
        assert_identical(got, want, {})
    assert accepted > 400  # most flips land in tensor data, which both load alike


def test_a_huge_memo_index_is_declined_before_the_unpickler_allocates_for_it() -> None:
    # The C unpickler sizes its memo by the largest index it is given: one LONG_BINPUT of
    # 10 million would make it allocate 160 MB for a pickle of a few bytes.
    pickled = pickle.PROTO + b"\x02" + pickle.NONE + pickle.LONG_BINPUT
    pickled += struct.pack("<I", 10_000_000) + pickle.STOP
    data = _replace_pickle(saved(None), pickled)
    tracemalloc.start()
    try:
        assert fast_load(data) is DECLINED
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20


@pytest.mark.parametrize("protocol", [0, 4])
def test_opcodes_torch_does_not_implement_are_declined(protocol: int) -> None:
    pickled = pickle.dumps({"a": [1, 2.5, "x"]}, protocol=protocol)
    assert fast_load(_replace_pickle(saved(None), pickled)) is DECLINED
    assert fast_load(_replace_pickle(saved(None), pickle.dumps({"a": [1, 2.5, "x"]}, 2))) == {
        "a": [1, 2.5, "x"]
    }
