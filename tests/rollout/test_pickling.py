"""trajtrack's records pickle as one call of an allow-listed rebuild over plain data (#33 item 6):
torch's weights-only load takes them with SAFE_GLOBALS, the fast path in the caller's process
without any allow-list change or worker, and a hostile rebuild call is refused before any
allocation sized by it."""

from __future__ import annotations

import io
import pickle
import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch

import trajtrack.reader._load_worker as load_worker
from trajtrack import DumpLoadError
from trajtrack.reader import load_dump_bytes
from trajtrack.reader._fast_load import DECLINED, fast_load
from trajtrack.rollout import SAFE_GLOBALS, BatchTypeError, RolloutBatch, RolloutSample
from trajtrack.rollout._pickling import rebuild_batch


def record() -> RolloutSample:
    batch = RolloutBatch(
        {
            "input_ids": torch.arange(12).reshape(3, 4),
            "old_log_probs": torch.linspace(0, 1, 12).reshape(3, 4),
        },
        {
            "uid": np.array(["a", "b", "c"], dtype=object),
            "raw_prompt": [[{"role": "user", "content": "hi"}], [], [{"x": 1}]],
            "score": np.array([0.5, 1.0, 2.0]),
            "label": np.array(["x", "yy", "zzz"]),  # a str dtype: travels as raw bytes
        },
        {"temperature": 0.7},
    )
    return RolloutSample(full_batch=batch, sample_id="sample_0_1", processing_times=[0.5])


def saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def assert_equal_records(got: RolloutSample, want: RolloutSample) -> None:
    assert type(got) is RolloutSample and got.sample_id == want.sample_id
    a, b = got.full_batch, want.full_batch
    assert list(a.batch) == list(b.batch)
    for key in b.batch:
        assert a.batch[key].dtype == b.batch[key].dtype
        assert torch.equal(a.batch[key], b.batch[key])
    assert list(a.non_tensor_batch) == list(b.non_tensor_batch)
    for key in b.non_tensor_batch:
        x, y = a.non_tensor_batch[key], b.non_tensor_batch[key]
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert x.tolist() == y.tolist()
    assert a.meta_info == b.meta_info and got.processing_times == want.processing_times


def test_torch_loads_the_rebuild_form_with_safe_globals() -> None:
    data = saved(record())
    names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    assert not any(name.startswith("numpy") for name in names)  # no numpy reconstructor
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert_equal_records(loaded, record())


def test_the_fast_path_loads_records_without_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(**_: Any) -> Any:
        raise AssertionError("the load worker was asked")

    monkeypatch.setattr(load_worker, "request_load", never)
    before = list(torch.serialization.get_safe_globals())
    data = saved(record())
    assert fast_load(data) is not DECLINED
    assert_equal_records(load_dump_bytes(data), record())
    assert list(torch.serialization.get_safe_globals()) == before


def test_a_column_claiming_a_huge_shape_is_refused_before_allocating() -> None:
    with pytest.raises(BatchTypeError, match="items for shape"):
        rebuild_batch({}, {"uid": ("object", [2**40], ["a"])}, {})

    # The same call in a dump: refused, with no allocation of its size.
    class Hostile:
        def __reduce__(self) -> tuple[Any, ...]:
            return (rebuild_batch, ({}, {"uid": ("object", [2**34], ["a"])}, {}))

    data = saved(Hostile())
    tracemalloc.start()
    try:
        with pytest.raises(DumpLoadError):
            load_dump_bytes(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


@pytest.mark.parametrize(
    "column",
    [
        ("raw", "O", [1], torch.zeros(8, dtype=torch.uint8)),  # object dtype from raw bytes
        ("raw", "<f8", [4], torch.zeros(8, dtype=torch.uint8)),  # fewer bytes than claimed
        ("tensor", torch.zeros(2, dtype=torch.bfloat16)),  # no numpy dtype
        ("object", [1], "not a list"),
        ("code", "os.system"),
    ],
    ids=["object dtype", "short data", "bfloat16", "items not a list", "unknown kind"],
)
def test_malformed_columns_are_batch_type_errors(column: tuple[Any, ...]) -> None:
    with pytest.raises(BatchTypeError):
        rebuild_batch({}, {"c": column}, {})


def test_copies_keep_the_records_values() -> None:
    original = record()
    again = pickle.loads(pickle.dumps(original))
    assert_equal_records(again, original)
