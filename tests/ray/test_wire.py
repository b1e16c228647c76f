"""Plain data on the wire (trajtrack.ray._wire*): exact round trips, refusals, hostile payloads."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
import torch

from _support.require import require_module

require_module("ray", required_by="TRAJTRACK_REQUIRE_RAY", hint="pip install 'trajtrack[ray]'")

from trajtrack.ray._wire import ALIGN  # noqa: E402  (after the Ray check)
from trajtrack.ray._wire_decode import decode, parse  # noqa: E402  (after the Ray check)
from trajtrack.ray._wire_encode import (  # noqa: E402  (after the Ray check)
    COPY_HOLDING_GIL_MAX_BYTES,
    VIEW_MIN_BYTES,
    NotPlainError,
    capture,
    encode,
)


def _roundtrip(obj: Any, *, copy: bool = False) -> Any:
    encoded = capture(obj, copy=copy).encoded()
    payload = bytearray(b"".join(bytes(part) for part in encoded.parts))
    assert len(payload) == encoded.size
    return decode(payload)[0]


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
        # bit for bit (every dtype, NaN payloads included): a round trip must preserve them
        x = a.detach().contiguous().reshape(-1).view(torch.uint8)
        y = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(x, y), (a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
    ],
)
@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "copied"])
def test_every_common_tensor_dtype_round_trips_exactly(dtype: torch.dtype, copy: bool) -> None:
    source = (torch.randn(3, 5) * 10).to(dtype) if dtype is not torch.bool else torch.rand(7) > 0.5
    _same(_roundtrip({"t": source}, copy=copy)["t"], source)


@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "copied"])
def test_a_nested_rollout_like_batch_round_trips(copy: bool) -> None:
    shared = torch.randn(4, 4)
    obj = {
        "obs": torch.randn(2, 3, 4)[:, ::2],  # non-contiguous
        "ids": torch.arange(10).reshape(2, 5).t(),  # transposed
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 7),
        "grad": torch.randn(3, requires_grad=True),
        "same": [shared, (shared, 1)],
        "np": np.arange(12, dtype=np.int16).reshape(3, 4),
        "np_fortran": np.asfortranarray(np.ones((2, 3))),
        "np_big_endian": np.arange(3, dtype=">f8"),
        "np_scalar": np.float32(2.5),
        "np_str": np.str_("hey"),
        "dtype": torch.bfloat16,
        "meta": {"step": 7, "lr": 1e-4, "name": "run", "done": False, "none": None, "nan": 0.0},
        "bytes": b"\x00\x01raw",
        "complex": 1 - 2j,
        1: "int key",
        2.5: "float key",
        None: "none key",
        b"k": "bytes key",
    }
    out = _roundtrip(obj, copy=copy)
    _same(out, {**obj, "obs": obj["obs"].contiguous(), "ids": obj["ids"].contiguous()})
    assert out["same"][0] is out["same"][1][0]  # a tensor sent twice stays one tensor


def test_nan_and_infinities_survive() -> None:
    out = _roundtrip({"x": torch.tensor([float("nan"), float("inf"), -float("inf")]), "f": 1e308})
    assert out["x"].isnan()[0] and out["x"][1] == float("inf") and out["x"][2] == -float("inf")
    assert out["f"] == 1e308


def test_decoded_tensors_share_the_payload_not_a_copy() -> None:
    encoded = encode({"x": torch.arange(1000, dtype=torch.int32)})
    payload = bytearray(b"".join(bytes(part) for part in encoded.parts))
    out, nbytes = decode(payload)
    assert nbytes >= 4000
    start = out["x"].data_ptr()
    base = np.frombuffer(payload, dtype=np.uint8).ctypes.data
    assert base <= start < base + len(payload)
    assert (start - base) % ALIGN == 0  # buffers are aligned


def test_the_encoder_sends_the_tensors_own_memory_without_a_copy() -> None:
    tensor = torch.arange(VIEW_MIN_BYTES // 4 + 1, dtype=torch.float32)
    encoded = encode({"x": tensor})
    views = [part for part in encoded.parts if isinstance(part, memoryview)]
    assert len(views) == 1
    tensor[0] = 99.0  # the acknowledged path sends before it returns: it sees the memory
    assert np.frombuffer(views[0], dtype=np.float32)[0] == 99.0


def test_a_copied_capture_is_a_snapshot() -> None:
    """``capture(copy=True)`` (the pipelined dump): changing the data afterwards, in place,
    changes nothing that is sent; small copies (held GIL) and large ones (numpy) alike."""
    big = COPY_HOLDING_GIL_MAX_BYTES // 4 + 1
    obj = {
        "small": torch.arange(10, dtype=torch.float32),
        "large": torch.arange(big, dtype=torch.float32),
        "strided": torch.arange(20).reshape(4, 5).t(),
        "bf16": torch.ones(6, dtype=torch.bfloat16),
        "grad": torch.zeros(3, requires_grad=True),
        "np": np.arange(8)[::2],
        "np_large": np.zeros(big, dtype=np.float32),
    }
    expected = {
        key: value.detach().clone() if isinstance(value, torch.Tensor) else value.copy()
        for key, value in obj.items()
    }
    captured = capture(obj, copy=True)
    with torch.no_grad():
        for key in ("small", "large", "strided", "bf16", "grad"):
            obj[key].add_(1)
    obj["np"] += 1
    obj["np_large"] += 1
    payload = bytearray(b"".join(bytes(part) for part in captured.encoded().parts))
    out = decode(payload)[0]
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(out[key].detach(), value.contiguous()), key
        else:
            np.testing.assert_array_equal(out[key], value)
    assert out["grad"].requires_grad
    assert captured.nbytes >= 2 * big * 4


class Tag(dict[str, Any]):
    pass


@pytest.mark.parametrize(
    "obj",
    [
        Tag(a=1),  # a dict subclass: torch.save would keep its class
        {"p": torch.nn.Parameter(torch.ones(1))},
        {"s": torch.ones(2).to_sparse()},
        {"o": np.array([object()], dtype=object)},
        {"r": np.zeros(2, dtype=[("a", "i4"), ("b", "f4")])},
        {"set": {1, 2}},
        {(1, 2): "tuple key"},
        {"f": lambda: None},
    ],
    ids=[
        "dict-subclass",
        "parameter",
        "sparse",
        "object-array",
        "structured",
        "set",
        "tuple-key",
        "function",
    ],
)
def test_what_it_cannot_carry_exactly_is_not_plain(obj: Any) -> None:
    with pytest.raises(NotPlainError):
        encode(obj)


def test_too_deep_nesting_is_not_plain() -> None:
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    with pytest.raises(NotPlainError, match="deep"):
        encode(deep)


def _payload(skeleton: dict[str, Any], body: bytes = b"") -> bytearray:
    raw = json.dumps(skeleton).encode()
    return bytearray(struct.pack("<I", len(raw)) + raw + body)


def _tensor(dtype: str, shape: list[int], length: int, body: int = 128) -> bytearray:
    skeleton = {"v": 1, "root": ["T", 0], "buffers": [length], "tensors": [[dtype, shape, 0, 0]]}
    return _payload(skeleton, bytes(body))


def _root(root: Any, buffers: list[Any] | None = None, body: int = 128) -> bytearray:
    return _payload({"v": 1, "root": root, "buffers": buffers or [], "tensors": []}, bytes(body))


MALFORMED = {
    "empty": bytearray(b""),
    "skeleton-past-end": bytearray(b"\xff\xff\xff\xff{}"),
    "not-json": bytearray(struct.pack("<I", 5) + b"nope!"),
    "version": _payload({"v": 99, "root": 1, "buffers": [], "tensors": []}),
    "unknown-tag": _root(["X", 1]),
    "buffer-past-end": _tensor("float32", [2], 8, body=0),
    "huge-buffer": _tensor("float32", [2], 10**9),
    "size-mismatch": _tensor("float32", [2], 4),
    "unknown-dtype": _tensor("os.system", [1], 4),
    "negative-shape": _tensor("float32", [-1], 4),
    "bad-length": _root(["b", 0], ["eight"]),
    "object-array": _root(["A", "|O", [1], 0], [8]),
    "torch-dtype-name": _root(["D", "__import__"]),
    "unhashable-key": _root(["M", [[["L", []], 1]]]),
    "tensor-index": _root(["T", 5]),
    "buffer-index": _root(["b", 3], [1]),
    "tensor-key": _payload(
        {
            "v": 1,
            "root": ["M", [[["T", 0], 1]]],
            "buffers": [4],
            "tensors": [["float32", [1], 0, False]],
        },
        bytes(128),
    ),
    # Issue #36: one buffer taken by many nodes would multiply what the actor holds.
    "bytes-buffer-twice": _root(["L", [["b", 0], ["b", 0]]], [64], body=192),
    "array-buffer-twice": _root(["L", [["A", "<f4", [1], 0], ["A", "<f4", [1], 0]]], [4]),
    "tensors-share-a-buffer": _payload(
        {
            "v": 1,
            "root": ["L", [["T", 0], ["T", 1]]],
            "buffers": [4],
            "tensors": [["float32", [1], 0, False], ["float32", [1], 0, False]],
        },
        bytes(128),
    ),
    # A container as a key could carry a tensor placeholder into the dump.
    "tuple-key-with-a-tensor": _payload(
        {
            "v": 1,
            "root": ["M", [[["U", [["T", 0]]], 1]]],
            "buffers": [4],
            "tensors": [["float32", [1], 0, False]],
        },
        bytes(128),
    ),
    "tuple-key": _root(["M", [[["U", [1, 2]], 1]]]),
    "dtype-key": _root(["M", [[["D", "float32"], 1]]]),
    # Zero elements pass the size check; the other dimensions must still fit an index.
    "zero-size-overflowing-tensor": _tensor("float32", [0, 2**62, 2**62], 0),
    "zero-size-overflowing-array": _root(["A", "<f8", [0, 2**40, 2**40], 0], [0]),
    "too-many-dims": _tensor("float32", [1] * 40, 4),
}


@pytest.mark.parametrize("payload", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_payload_is_a_value_error(payload: bytearray) -> None:
    with pytest.raises(ValueError, match="malformed plain payload"):
        parse(payload)  # the actor's check: refused before anything is admitted
    with pytest.raises(ValueError, match="malformed plain payload"):
        decode(payload)


def test_parse_checks_everything_and_makes_the_tensors_only_in_build() -> None:
    obj = {"x": torch.arange(6, dtype=torch.int32).reshape(2, 3), "same": None, "n": 3}
    obj["same"] = [obj["x"]]
    payload = bytearray(b"".join(bytes(part) for part in encode(obj).parts))
    decoded = parse(payload)
    assert decoded.nbytes == len(payload)
    flat = [decoded.root["x"], decoded.root["same"][0]]
    assert not any(isinstance(node, torch.Tensor) for node in flat)  # nothing made yet
    built = decoded.build()
    _same(built, obj)
    assert built["same"][0] is built["x"]  # still one tensor


def test_bytes_values_are_copied_in_build_and_counted_in_nbytes() -> None:
    blob = bytes(range(256)) * 40
    obj = {"blob": blob, "t": torch.ones(4), b"key": 1, complex(1, 2): "c"}
    payload = bytearray(b"".join(bytes(part) for part in encode(obj).parts))
    decoded = parse(payload)
    assert not isinstance(decoded.root["blob"], bytes)  # not copied on the actor's loop
    assert decoded.nbytes == len(payload) + len(blob) + len(b"key")  # what build will hold
    built = decoded.build()
    assert built["blob"] == blob and type(built["blob"]) is bytes
    assert built[b"key"] == 1 and built[complex(1, 2)] == "c"
    assert torch.equal(built["t"], torch.ones(4))


def test_referenced_bytes_never_exceed_the_payload() -> None:
    # The review's request: a 20 KB skeleton naming one 1 MiB buffer 2,000 times.
    root = ["L", [["b", 0]] * 2000]
    payload = _root(root, [1 << 20], body=(1 << 20) + ALIGN)
    with pytest.raises(ValueError, match="used twice"):
        parse(payload)


def test_a_deeply_nested_hostile_skeleton_is_a_value_error() -> None:
    root: Any = 1
    for _ in range(200):
        root = ["L", [root]]
    with pytest.raises(ValueError, match="malformed plain payload: nesting too deep"):
        decode(_payload({"v": 1, "root": root, "buffers": [], "tensors": []}))
