from __future__ import annotations

import copy
import dataclasses
import io
import pickle
import types
from typing import Any

import numpy as np
import pytest
import torch

import trajtrack
from trajtrack.rollout import (
    SAFE_GLOBALS,
    BatchConflictError,
    BatchError,
    BatchKeyError,
    BatchSizeError,
    BatchTypeError,
    RolloutBatch,
    RolloutSample,
    to_object_array,
)


def make_batch() -> RolloutBatch:
    return RolloutBatch.from_single_dict(
        {
            "input_ids": torch.tensor([[1, 2], [3, 4], [5, 6]]),
            "uid": np.array(["a", "b", "c"], dtype=object),
        },
        meta_info={"temperature": 1.0},
    )


def test_from_single_dict_splits_tensors_and_arrays() -> None:
    batch = make_batch()
    assert list(batch.batch) == ["input_ids"]
    assert list(batch.non_tensor_batch) == ["uid"]
    assert batch.meta_info == {"temperature": 1.0}
    assert len(batch) == 3


def test_len_without_tensors_uses_arrays_and_empty_is_zero() -> None:
    assert len(RolloutBatch(non_tensor_batch={"x": np.arange(4)})) == 4
    assert len(RolloutBatch()) == 0


def test_from_single_dict_rejects_other_types() -> None:
    with pytest.raises(BatchTypeError, match=r"'prompt'.*list"):
        RolloutBatch.from_single_dict({"prompt": ["a", "b"]})


def test_lists_become_one_dimensional_object_arrays() -> None:
    batch = RolloutBatch(non_tensor_batch={"tools": [[1, 2], [3, 4]]})
    arr = batch.non_tensor_batch["tools"]
    assert arr.dtype == object
    assert arr.shape == (2,)
    assert arr[1] == [3, 4]


def test_to_object_array_keeps_items_whole() -> None:
    arr = to_object_array([(1, 2), (3, 4), (5, 6)])
    assert arr.shape == (3,)
    assert arr[2] == (5, 6)
    assert to_object_array([]).shape == (0,)


def test_size_mismatch_names_keys_and_sizes() -> None:
    with pytest.raises(BatchSizeError, match=r"'uid' has 2 rows but 'input_ids' has 3"):
        RolloutBatch({"input_ids": torch.zeros(3, 2)}, {"uid": np.array(["a", "b"], dtype=object)})
    with pytest.raises(BatchSizeError, match=r"'b' has 4 rows but 'a' has 3"):
        RolloutBatch({"a": torch.zeros(3), "b": torch.zeros(4)})


def test_errors_are_value_errors_and_trajtrack_errors() -> None:
    for error in (BatchSizeError, BatchKeyError, BatchConflictError, BatchTypeError):
        assert issubclass(error, BatchError)
        assert issubclass(error, ValueError)
        assert issubclass(error, trajtrack.TrajtrackError)


def test_scalar_tensor_is_rejected() -> None:
    with pytest.raises(BatchSizeError, match="'x' is a scalar"):
        RolloutBatch({"x": torch.tensor(1.0)})


def test_repeat_interleave_and_tile() -> None:
    batch = RolloutBatch(
        {"x": torch.tensor([[1, 1], [2, 2]])}, {"u": np.array(["a", "b"], dtype=object)}
    )
    inter = batch.repeat(repeat_times=3, interleave=True)
    assert inter.batch["x"][:, 0].tolist() == [1, 1, 1, 2, 2, 2]
    assert inter.non_tensor_batch["u"].tolist() == ["a", "a", "a", "b", "b", "b"]
    tiled = batch.repeat(repeat_times=2, interleave=False)
    assert tiled.batch["x"].tolist() == [[1, 1], [2, 2], [1, 1], [2, 2]]
    assert tiled.non_tensor_batch["u"].tolist() == ["a", "b", "a", "b"]


@pytest.mark.parametrize("times", [0, -1, 1.5, True])
def test_repeat_rejects_non_positive_counts(times: object) -> None:
    with pytest.raises(ValueError, match="repeat_times"):
        make_batch().repeat(repeat_times=times)  # type: ignore[arg-type]


def test_concat_joins_rows_and_merges_meta() -> None:
    a = RolloutBatch(
        {"x": torch.tensor([[1], [2]])}, {"u": ["a", "b"]}, {"k": 1, "metrics": [{"t": 1.0}]}
    )
    b = RolloutBatch({"x": torch.tensor([[3]])}, {"u": ["c"]}, {"k": 1, "metrics": [{"t": 2.0}]})
    out = RolloutBatch.concat([a, b])
    assert out.batch["x"].tolist() == [[1], [2], [3]]
    assert out.non_tensor_batch["u"].tolist() == ["a", "b", "c"]
    assert out.meta_info == {"k": 1, "metrics": {"t": [1.0, 2.0]}}


def test_concat_errors() -> None:
    a = RolloutBatch({"x": torch.zeros(2, 3)}, {"u": ["a", "b"]}, {"k": 1})
    with pytest.raises(ValueError, match="empty"):
        RolloutBatch.concat([])
    with pytest.raises(
        BatchKeyError, match=r"batch keys of batch 1 .*missing \['x'\], extra \['y'\]"
    ):
        RolloutBatch.concat([a, RolloutBatch({"y": torch.zeros(1, 3)}, {"u": ["c"]})])
    with pytest.raises(BatchKeyError, match=r"non_tensor_batch keys of batch 1"):
        RolloutBatch.concat([a, RolloutBatch({"x": torch.zeros(1, 3)})])
    with pytest.raises(BatchSizeError, match=r"'x': batch 1 has shape \(1, 4\)"):
        RolloutBatch.concat([a, RolloutBatch({"x": torch.zeros(1, 4)}, {"u": ["c"]})])
    with pytest.raises(BatchConflictError, match=r"meta_info\['k'\] of batch 1"):
        RolloutBatch.concat([a, RolloutBatch({"x": torch.zeros(1, 3)}, {"u": ["c"]}, {"k": 2})])


def test_concat_keeps_subclass() -> None:
    class MyBatch(RolloutBatch):
        pass

    out = MyBatch.concat([MyBatch({"x": torch.zeros(1)}), MyBatch({"x": torch.ones(2)})])
    assert type(out) is MyBatch
    assert out.batch["x"].tolist() == [0.0, 1.0, 1.0]


def test_select_and_pop() -> None:
    batch = make_batch()
    sub = batch.select(batch_keys=["input_ids"], non_tensor_batch_keys=[], meta_info_keys=[])
    assert list(sub.batch) == ["input_ids"] and sub.non_tensor_batch == {} and sub.meta_info == {}
    assert sub.batch["input_ids"] is batch.batch["input_ids"]
    deep = batch.select(deepcopy=True)
    assert deep == batch and deep.batch["input_ids"] is not batch.batch["input_ids"]

    popped = batch.pop(non_tensor_batch_keys=["uid"], meta_info_keys=["temperature"])
    assert popped.non_tensor_batch["uid"].tolist() == ["a", "b", "c"]
    assert popped.meta_info == {"temperature": 1.0}
    assert "uid" not in batch.non_tensor_batch and batch.meta_info == {}

    with pytest.raises(BatchKeyError, match=r"batch has no key\(s\) \['nope'\]"):
        batch.pop(batch_keys=["input_ids", "nope"])
    assert "input_ids" in batch.batch  # nothing removed when a key is missing


def test_union_adds_keys_and_checks_conflicts() -> None:
    batch = make_batch()
    other = RolloutBatch(
        {"input_ids": torch.tensor([[1, 2], [3, 4], [5, 6]]), "y": torch.ones(3)}, {}, {"new": 1}
    )
    assert batch.union(other) is batch
    assert set(batch.batch) == {"input_ids", "y"} and batch.meta_info["new"] == 1

    with pytest.raises(BatchSizeError, match="3 and 2"):
        batch.union(RolloutBatch({"z": torch.ones(2)}))
    with pytest.raises(BatchConflictError, match=r"batch\['y'\] differs"):
        batch.union(RolloutBatch({"y": torch.zeros(3)}))
    with pytest.raises(BatchConflictError, match=r"meta_info\['new'\] differs"):
        batch.union(RolloutBatch(meta_info={"new": 2}))


def test_reorder_in_place() -> None:
    batch = make_batch()
    batch.reorder(torch.tensor([2, 0, 1]))
    assert batch.batch["input_ids"][:, 0].tolist() == [5, 1, 3]
    assert batch.non_tensor_batch["uid"].tolist() == ["c", "a", "b"]


def test_equality_is_deep_and_nan_aware() -> None:
    a = RolloutBatch(
        {"x": torch.tensor([1.0, float("nan")])}, {"u": [{"k": [1]}, None]}, {"m": np.arange(2)}
    )
    b = copy.deepcopy(a)
    assert a == b
    b.non_tensor_batch["u"][0]["k"].append(2)
    assert a != b
    c = RolloutBatch(
        {"x": torch.tensor([1.0, float("nan")], dtype=torch.float64)},
        {"u": [{"k": [1]}, None]},
        {"m": np.arange(2)},
    )
    assert a != c  # dtype differs


def test_pickles_as_plain_state() -> None:
    batch = make_batch()
    state = batch.__getstate__()
    assert state["version"] == 1
    assert set(state) == {"version", "batch", "non_tensor_batch", "meta_info"}
    assert type(state["batch"]) is dict
    assert pickle.loads(pickle.dumps(batch)) == batch


def test_setstate_rejects_unknown_version() -> None:
    batch = RolloutBatch.__new__(RolloutBatch)
    with pytest.raises(BatchTypeError, match="version 99"):
        batch.__setstate__({"version": 99, "batch": {}, "non_tensor_batch": {}, "meta_info": {}})


class _ElementwiseDict(dict):  # type: ignore[type-arg]
    """Like a TensorDict: ``==`` is element-wise, and its result has no truth value."""

    def __eq__(self, other: object) -> Any:
        return _NoTruth()

    __hash__ = None  # type: ignore[assignment]


class _NoTruth:
    def __bool__(self) -> bool:
        raise RuntimeError("Converting a tensordict to boolean value is not permitted")


@dataclasses.dataclass
class _DataProtoLike:
    """verl's DataProto in the way that matters here: a dataclass holding a TensorDict."""

    batch: Any
    non_tensor_batch: dict[str, Any]
    meta_info: dict[str, Any]


def _sample(value: float) -> RolloutSample:
    batch = _DataProtoLike(
        _ElementwiseDict(obs=torch.tensor([1.0, value])),
        {"uid": np.array(["a", "b"], dtype=object)},
        {"step": 1},
    )
    return RolloutSample(full_batch=batch, sample_id="s")


def test_rollout_sample_equality_with_a_dataproto_batch_never_raises() -> None:
    with pytest.raises(RuntimeError):  # what a plain dataclass comparison does
        bool(_sample(2.0).full_batch == _sample(2.0).full_batch)
    assert _sample(2.0) == _sample(2.0)  # compared tensor by tensor instead
    assert _sample(2.0) != _sample(3.0)
    assert _sample(2.0) != RolloutSample(full_batch=RolloutBatch(), sample_id="s")


def test_batches_equal_only_with_equal_values() -> None:
    def batch(values: list[float]) -> RolloutBatch:
        return RolloutBatch.from_single_dict({"x": torch.tensor(values), "k": np.array([1, 2])})

    assert batch([1.0, float("nan")]) == batch([1.0, float("nan")])  # NaN equals NaN in place
    assert batch([1.0, 2.0]) != batch([1.0, 2.5])  # same dtype and shape, another value
    assert batch([1.0, float("nan")]) != batch([float("nan"), 1.0])
    assert RolloutSample(batch([1.0, 2.0])) != RolloutSample(batch([1.0, 2.5]))


def nested_batch() -> RolloutBatch:
    critic = {"values": torch.arange(6.0).reshape(3, 2), "deep": {"steps": torch.tensor([7, 8, 9])}}
    return RolloutBatch(
        {"ids": torch.tensor([[1], [2], [3]]), "critic": critic}, {"uid": ["a", "b", "c"]}
    )


def test_nested_mappings_are_kept_and_checked() -> None:
    """A nested TensorDict of a DataProto is a nested dict (#33): no BatchTypeError."""
    batch = nested_batch()
    assert len(batch) == 3 and batch.batch["critic"]["deep"]["steps"].tolist() == [7, 8, 9]
    assert "critic.deep.steps: (3,)" in repr(batch)
    with pytest.raises(BatchSizeError, match=r"'critic\.values' has 2 rows"):
        RolloutBatch({"ids": torch.zeros(3), "critic": {"values": torch.zeros(2)}})
    with pytest.raises(BatchTypeError, match=r"batch\['critic\.name'\] must be a torch.Tensor"):
        RolloutBatch({"critic": {"name": "x"}})


def test_operations_walk_nested_mappings() -> None:
    batch = nested_batch()
    batch.reorder([2, 0, 1])
    assert batch.batch["critic"]["deep"]["steps"].tolist() == [9, 7, 8]
    twice = RolloutBatch.concat([batch, batch])
    assert twice.batch["critic"]["values"][:, 0].tolist() == [4.0, 0.0, 2.0, 4.0, 0.0, 2.0]
    assert batch.repeat(2).batch["critic"]["deep"]["steps"].tolist() == [9, 9, 7, 7, 8, 8]
    copied = batch.select(deepcopy=True)
    assert copied.batch["critic"]["values"] is not batch.batch["critic"]["values"]
    assert torch.equal(copied.batch["critic"]["values"], batch.batch["critic"]["values"])
    flat = RolloutBatch(
        {"ids": torch.zeros(3, 1), "critic": torch.zeros(3)}, {"uid": ["a", "b", "c"]}
    )
    with pytest.raises(BatchKeyError, match="critic"):
        RolloutBatch.concat([batch, flat])


def test_nested_batch_pickles_for_weights_only() -> None:
    batch = nested_batch()
    buffer = io.BytesIO()
    torch.save(batch, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        loaded = torch.load(buffer, weights_only=True)
    assert torch.equal(loaded.batch["critic"]["deep"]["steps"], torch.tensor([7, 8, 9]))
    assert torch.equal(loaded.batch["critic"]["values"], torch.arange(6.0).reshape(3, 2))


def test_from_dataproto_takes_anything_shaped_like_one() -> None:
    class Nested:
        def __init__(self, items: dict[str, Any]) -> None:
            self._items = items

        def items(self) -> Any:
            return self._items.items()

    proto = types.SimpleNamespace(
        batch=Nested({"x": torch.ones(2), "n": Nested({"y": torch.zeros(2, 3)})}),
        non_tensor_batch={"uid": np.array(["a", "b"], dtype=object)},
        meta_info={"k": 1},
    )
    batch = RolloutBatch.from_dataproto(proto)
    assert batch.batch["n"]["y"] is proto.batch._items["n"]._items["y"]
    assert batch.non_tensor_batch["uid"] is proto.non_tensor_batch["uid"] and batch.meta_info == {
        "k": 1
    }
    assert (
        len(
            RolloutBatch.from_dataproto(
                types.SimpleNamespace(batch=None, non_tensor_batch={}, meta_info={})
            )
        )
        == 0
    )
