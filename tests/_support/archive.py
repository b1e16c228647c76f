"""Helpers of the archive writer's tests: torch.save as the reference, compared record by record."""

from __future__ import annotations

import io
import pickle
import struct
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trajtrack.rollout import SAFE_GLOBALS
from trajtrack.tracker import _archive
from trajtrack.tracker._archive import write_archive


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def archive_bytes(obj: Any) -> tuple[bytes, int, str]:
    buffer = io.BytesIO()
    size, checksum = write_archive(obj, buffer)
    return buffer.getvalue(), size, checksum


def mask_serialization_id(data: bytes) -> bytes:
    """*data* with the serialization id record's content and CRC-32s zeroed.

    torch.save draws the id at random; everything else must be byte-identical.
    """
    masked = bytearray(data)
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo("archive/.data/serialization_id")
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    masked[start : start + info.file_size] = bytes(info.file_size)
    masked[start + info.file_size + 4 : start + info.file_size + 8] = bytes(4)  # descriptor
    central = data.rfind(b"PK\x01\x02")  # the id's entry is the last one
    masked[central + 16 : central + 20] = bytes(4)
    return bytes(masked)


def load(data: bytes | Path, **kwargs: Any) -> Any:
    source = data if isinstance(data, Path) else io.BytesIO(data)
    kwargs.setdefault("weights_only", True)
    if not hasattr(torch.serialization, "safe_globals"):  # torch 2.4: process-wide only
        torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
        return torch.load(source, **kwargs)
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        return torch.load(source, **kwargs)


def storage_bytes(tensor: torch.Tensor) -> bytes:
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()


def assert_same(left: Any, right: Any, storages: dict[int, int], other: dict[int, int]) -> None:
    """Deep equality including tensor layout and the aliasing pattern of storages."""
    assert type(left) is type(right)
    if isinstance(left, torch.Tensor):
        assert (left.dtype, left.shape, left.stride()) == (right.dtype, right.shape, right.stride())
        assert left.storage_offset() == right.storage_offset()
        assert (left.requires_grad, left.is_conj(), left.is_neg()) == (
            right.requires_grad,
            right.is_conj(),
            right.is_neg(),
        )
        assert storage_bytes(left) == storage_bytes(right)
        left_key = storages.setdefault(left.untyped_storage().data_ptr(), len(storages))
        right_key = other.setdefault(right.untyped_storage().data_ptr(), len(other))
        assert left_key == right_key  # the same storages shared the same way
    elif isinstance(left, dict):
        assert list(left) == list(right)
        for key in left:
            assert_same(left[key], right[key], storages, other)
    elif isinstance(left, list | tuple):
        assert len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            assert_same(a, b, storages, other)
    elif isinstance(left, np.ndarray):
        assert left.dtype == right.dtype and left.shape == right.shape
        assert left.strides == right.strides and left.tobytes() == right.tobytes()
    elif isinstance(left, float) and left != left:
        assert right != right
    else:
        assert left == right


def assert_same_as_torch_save(ours: bytes, reference: bytes) -> None:
    """Byte-identical but for the serialization id, when this torch writes torch 2.13's records.

    An older torch (2.4) writes no ``.format_version`` or ``.storage_alignment``: then the
    records both write must be identical.
    """
    if records(ours) == records(reference):
        assert mask_serialization_id(ours) == mask_serialization_id(reference)
        return
    mine, theirs = zipfile.ZipFile(io.BytesIO(ours)), zipfile.ZipFile(io.BytesIO(reference))
    shared = [name for name in theirs.namelist() if not name.endswith("serialization_id")]
    assert set(shared) <= set(mine.namelist())
    for name in shared:
        assert mine.read(name) == theirs.read(name), name


def records(data: bytes) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(data)).namelist()


def assert_loads_like_torch_save(obj: Any) -> None:
    ours, size, checksum = archive_bytes(obj)
    reference = torch_bytes(obj)
    assert_same_as_torch_save(ours, reference)
    assert size == len(ours)
    assert checksum == f"crc32:{zlib.crc32(ours):08x}"
    assert zipfile.ZipFile(io.BytesIO(ours)).testzip() is None
    try:
        expected = load(reference)
    except pickle.UnpicklingError:  # torch 2.4's weights_only refuses bytes, complex, numpy
        with pytest.raises(pickle.UnpicklingError):
            load(ours)
        loaded, expected = load(ours, weights_only=False), load(reference, weights_only=False)
    else:
        loaded = load(ours)
    assert_same(loaded, expected, {}, {})
    ids = [id(x) for x in flatten(loaded)]
    expected_ids = [id(x) for x in flatten(expected)]
    assert [ids.index(i) for i in ids] == [expected_ids.index(i) for i in expected_ids]


def flatten(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for value in obj.values() for x in flatten(value)]
    if isinstance(obj, list | tuple):
        return [x for value in obj for x in flatten(value)]
    return [obj] if isinstance(obj, torch.Tensor) else []


def dtypes() -> list[torch.dtype]:
    return [*_archive._V2_STORAGES, *sorted(_archive._V3_DTYPES, key=str)]


def tensor_of(dtype: torch.dtype, numel: int = 6) -> torch.Tensor:
    raw = torch.randint(
        0, 256, (numel * dtype.itemsize,), generator=torch.Generator().manual_seed(0)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        return raw.to(torch.uint8).view(dtype)


def creatable(dtype: torch.dtype) -> bool:
    try:
        tensor_of(dtype)
    except (RuntimeError, TypeError):
        return False
    return True


DTYPES = [dtype for dtype in dtypes() if creatable(dtype)]

BASE = torch.arange(24, dtype=torch.float32).reshape(4, 6)
COMPLEX = torch.randn(5, dtype=torch.complex64)

OBJECTS: dict[str, Any] = {
    "int_and_floats": {"step": 1, "x": torch.randn(1000)},
    "zero_dim": torch.tensor(3.5),
    "zero_dim_int": {"a": torch.tensor(7), "b": torch.tensor(True)},
    "empty": {"e": torch.zeros(0), "e2": torch.zeros(3, 0, 2, dtype=torch.int64)},
    "transposed": BASE.t(),
    "sliced_views": {"whole": BASE, "row": BASE[1], "col": BASE[:, 2], "tail": BASE[2:, 3:]},
    "expanded": torch.arange(3).expand(4, 3),
    "same_tensor_twice": [BASE, BASE, {"again": BASE}],
    "two_storages_equal_bytes": [torch.ones(3), torch.ones(3)],
    "from_numpy": torch.from_numpy(np.arange(10, dtype=np.int32)),
    "nested": {"a": [1, (2.5, None, {"b": torch.ones(2, 2)})], "c": (b"raw", "text", True)},
    "scalars": [0, -1, 2**70, 1.5, float("inf"), float("nan"), complex(1, 2), None, False],
    "non_str_keys": {1: torch.ones(1), 2.5: "x", (1, "a"): torch.zeros(2), None: 0},
    "numpy": {
        "f": np.linspace(0, 1, 7),
        "i": np.arange(12, dtype=np.int16).reshape(3, 4),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "b": np.array([True, False]),
        "scalar": np.float32(2.5),
        "int_scalar": np.int64(-3),
    },
    "dtypes_as_values": [torch.float32, torch.bfloat16, torch.int8],
    "requires_grad": torch.ones(3, requires_grad=True),
    "non_leaf": torch.ones(3, requires_grad=True) * 2,
    "conj": COMPLEX.conj(),
    "neg": torch.randn(4)._neg_view(),
    "conj_neg": COMPLEX.conj()._neg_view(),
    "strings_like_ours": {"storage": "cpu", "cpu": ["storage", "0"], "0": torch.ones(1)},
    "bigger": {"obs": torch.randn(70_000), "actions": torch.randint(0, 9, (5000,))},
    "empty_containers": {"d": {}, "l": [], "t": ()},
}
