"""Structural comparison, unit level."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from trajtrack import DumpLoadError
from trajtrack.reader import Tolerance, compare
from trajtrack.rollout import RolloutBatch, RolloutSample


@dataclasses.dataclass
class Point:
    x: float
    tags: list[str]


def kinds(a: object, b: object, **tol: float | bool) -> list[tuple[str, str]]:
    return [(d.path, d.kind) for d in compare(a, b, Tolerance(**tol))]  # type: ignore[arg-type]


def test_equal_nested_structures() -> None:
    value = {"t": torch.arange(4), "a": np.arange(3.0), "l": [1, "x", None], "p": Point(1.0, [])}
    assert compare(value, {**value, "p": Point(1.0, [])}) == []


def test_paths_name_the_place() -> None:
    a = {"p": Point(1.0, ["a", "b"]), "l": (1, 2)}
    b = {"p": Point(2.0, ["a", "c"]), "l": (1, 2, 3)}
    assert kinds(a, b) == [("['p'].x", "value"), ("['p'].tags[1]", "value"), ("['l']", "length")]


def test_type_mismatch_and_numbers() -> None:
    # Another container holding the same items is a note, not a difference (issue 33).
    assert kinds([1], (1,)) == []
    assert compare([1], (1,)).notes == ("list vs tuple at <root>: compared by content",)
    assert kinds([1], "1") == [("", "type")]
    assert kinds(1, 1.0) == []
    assert kinds(1.0, 1.05, atol=0.1) == []
    assert kinds(1.0, 1.05) == [("", "value")]
    assert kinds(float("nan"), float("nan")) == []
    assert kinds(float("nan"), float("nan"), equal_nan=False) == [("", "value")]


def test_numpy_arrays() -> None:
    assert kinds(np.zeros(3), np.zeros(3, dtype=np.float32)) == [("", "dtype")]
    assert kinds(np.zeros((2, 2)), np.zeros(4)) == [("", "shape")]
    a = np.array(["x", {"k": 1}], dtype=object)
    b = np.array(["x", {"k": 2}], dtype=object)
    assert kinds(a, b) == [("[1]['k']", "value")]
    (d,) = compare(np.arange(6).reshape(2, 3), np.array([[0, 1, 2], [3, 9, 5]]))
    # Integers are compared as integers: count and first position, no magnitude (issue 35).
    assert d.index == (1, 1) and d.max_abs is None and d.max_rel is None and d.mismatched == 1
    assert d.detail == "1 of 6 elements differ" and d.rows == (1,)


def test_tensor_statistics_and_first_index() -> None:
    a = torch.zeros(3, 4)
    b = a.clone()
    b[1, 2], b[2, 0] = 0.5, -2.0
    (d,) = compare(a, b)
    assert d.index == (1, 2) and d.mismatched == 2 and d.total == 12
    assert d.max_abs == pytest.approx(2.0)
    assert compare(a, b, Tolerance(atol=2.0)) == []


def test_limit_stops_the_walk() -> None:
    a = {str(i): i for i in range(100)}
    b = {str(i): i + 1 for i in range(100)}
    assert len(compare(a, b, limit=7)) == 7


def test_infinities_do_not_poison_the_statistics() -> None:
    # inf - inf is NaN: equal infinities must not turn max abs / max rel into NaN.
    a = torch.tensor([float("inf"), 1.0, 4.0])
    b = torch.tensor([float("inf"), 2.0, 4.0])
    (found,) = compare(a, b, Tolerance())
    assert found.max_abs == 1.0
    assert found.max_rel == 0.5
    assert found.index == (1,)
    assert found.mismatched == 1


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), (1, 1, 4), (4, 1, 2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16])
def test_the_first_difference_is_placed_and_read_as_numpy_would(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    # The index and the two values at it, whichever path computed them (numpy views for
    # float32/float64, widened copies for the others): row-major, the tensors' own values.
    gen = torch.Generator().manual_seed(len(shape))
    a = torch.randint(0, 50, shape, generator=gen).to(dtype)
    b = a.clone()
    flat = int(torch.randint(0, a.numel(), (1,), generator=gen))
    b.view(-1)[flat] += 3
    b.view(-1)[-1] += 1  # a second difference, later in row-major order
    (d,) = compare({"t": a}, {"t": b})
    expected = tuple(int(i) for i in np.unravel_index(flat, shape))
    assert d.index == expected
    assert (d.a, d.b) == (repr(a[expected].item()), repr(b[expected].item()))
    assert d.mismatched == (1 if flat == a.numel() - 1 else 2)


def test_a_transposed_tensor_is_compared_in_its_own_row_major_order() -> None:
    a = torch.zeros(3, 4).t()  # not contiguous
    b = a.clone()
    b[2, 1] = 5.0
    (d,) = compare(a, b)
    assert d.index == (2, 1) and (d.a, d.b) == ("0.0", "5.0")


def test_mappings_with_the_same_keys_in_another_order_walk_in_a_order() -> None:
    a = {"x": 1, "y": 2, "z": 3}
    b = {"z": 4, "y": 5, "x": 6}
    assert [d.path for d in compare(a, b)] == ["['x']", "['y']", "['z']"]
    assert kinds({"x": 1, "y": 2}, {"y": 2, "w": 1}) == [("['x']", "missing"), ("['w']", "extra")]


# --- issue 33: containers by content, rows and ids, ignore patterns ---------------------------


@dataclasses.dataclass
class VerlRolloutSample:
    """The shape of verl 0.9.1's ``RolloutSample`` (its module needs verl's trainer stack)."""

    full_batch: Any
    sample_id: str
    epoch: int
    rollout_status: dict[str, Any]


def _batch(rows: int = 6) -> RolloutBatch:
    gen = torch.Generator().manual_seed(1)
    return RolloutBatch(
        {"logp": torch.randn(rows, 4, generator=gen), "ids": torch.arange(rows * 4).view(rows, 4)},
        {"uid": [f"u{i}" for i in range(rows)]},
        {"step": 3},
    )


def test_a_tensordict_and_a_dict_with_the_same_data_are_equal_with_a_note() -> None:
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({"x": torch.arange(4.0), "n": {"y": torch.ones(2)}}, batch_size=[])
    plain = {"x": torch.arange(4.0), "n": {"y": torch.ones(2)}}
    found = compare(td, plain)
    assert found == []
    notes = ("TensorDict vs dict at <root> (and 1 more place): compared by content",)
    assert found.notes == notes
    plain["n"]["y"] = torch.zeros(2)  # a real difference is still found inside
    assert [(d.path, d.kind) for d in compare(td, plain)] == [("['n']['y']", "value")]


def test_verl_and_trajtrack_rollout_samples_compare_by_fields() -> None:
    status = {"count/total_generated_samples": 3}
    ours = RolloutSample(_batch(), sample_id="s0", epoch=1, rollout_status=status)
    theirs = VerlRolloutSample(_batch(), "s0", 1, dict(status))
    found = compare(theirs, ours)
    assert found == []
    assert found.notes == ("VerlRolloutSample vs RolloutSample at <root>: compared by content",)
    # A field only one side has counts once it holds something other than its default.
    ours.processing_times = [0.5]
    assert [(d.path, d.kind) for d in compare(theirs, ours)] == [(".processing_times", "extra")]


def test_every_differing_row_is_named_with_its_uid() -> None:
    a, b = _batch(), _batch()
    b.batch["logp"][1, 2] += 1.0
    b.batch["logp"][4, 0] -= 1.0
    (d,) = compare(a, b)
    expected = torch.nonzero((a.batch["logp"] != b.batch["logp"]).any(dim=1)).flatten()
    assert d.path == ".batch['logp']" and d.rows == tuple(expected.tolist()) == (1, 4)
    assert d.id_column == "uid" and d.row_ids == ("u1", "u4")
    # A sample_id column next to the tensor, when there is no uid.
    plain_a = {"x": torch.zeros(3, 2), "sample_id": np.array(["p", "q", "r"], dtype=object)}
    plain_b = {"x": torch.zeros(3, 2), "sample_id": np.array(["p", "q", "r"], dtype=object)}
    plain_b["x"][2, 1] = 7.0
    (d,) = compare(plain_a, plain_b)
    assert (d.rows, d.id_column, d.row_ids) == ((2,), "sample_id", ("r",))
    # No id column of the right length: rows without ids.
    (d,) = compare({"x": plain_a["x"], "uid": [1]}, {"x": plain_b["x"], "uid": [1]})
    assert (d.rows, d.id_column, d.row_ids) == ((2,), None, None)


def test_token_ids_are_compared_as_integers() -> None:
    # Issue 35: count and first position, no relative difference; and exactly (float64 would
    # make 2**60 and 2**60 + 1 equal).
    a = torch.tensor([[2**60, 5, 6], [7, 8, 9]])
    b = a.clone()
    b[0, 0] += 1
    b[1, 2] = 290
    (d,) = compare(a, b)
    assert d.detail == "2 of 6 elements differ" and d.max_abs is None and d.max_rel is None
    assert d.index == (0, 0) and d.rows == (0, 1)
    assert (d.a, d.b) == (str(2**60), str(2**60 + 1))


def test_ignore_patterns_leave_keys_out_and_say_which() -> None:
    a = {"meta": {"timing_s/gen": 1.0, "lr": 0.1}, "status": {"c/x": 3, "c/y": 1}, "v": [1]}
    b = {"meta": {"timing_s/gen": 2.0, "lr": 0.1}, "status": {"c/x": 4, "c/z": 1}, "v": [2]}
    assert [d.path for d in compare(a, b)] == [
        "['meta']['timing_s/gen']",
        "['status']['c/y']",
        "['status']['c/z']",
        "['status']['c/x']",
        "['v'][0]",
    ]
    found = compare(a, b, ignore=["*timing_s*", "['status'][*]"])
    assert [d.path for d in found] == ["['v'][0]"]
    assert found.ignored == (
        "['meta']['timing_s/gen']",
        "['status']['c/y']",
        "['status']['c/z']",
        "['status']['c/x']",
    )
    # Brackets are literal (paths are full of them): "[v]" is no character class.
    assert compare({"v": 1}, {"v": 2}, ignore=["[v]"]) != []
    assert compare({"v": 1}, {"v": 2}, ignore=["['v']"]) == []


# --- issue 32: every walk bounded ---------------------------------------------------------------


def _dag(levels: int, leaf: object) -> list[Any]:
    node: list[Any] = [leaf]
    for _ in range(levels):
        node = [node, node]  # 2**levels paths through levels + 1 objects
    return node


def test_shared_references_are_compared_once() -> None:
    (d,) = compare(_dag(60, 1), _dag(60, 2))
    assert d.path == "[0]" * 61 and d.kind == "value"
    (t,) = compare({"k": _dag(60, 1)}, {"k": "s"})  # and shown by a bounded repr
    assert t.kind == "type" and t.a is not None and t.a.startswith("[[[[...")


def test_nesting_past_the_bound_is_a_typed_error() -> None:
    deep_a: list[Any] = []
    deep_b: list[Any] = [1]
    for _ in range(5000):
        deep_a, deep_b = [deep_a], [deep_b]
    with pytest.raises(DumpLoadError, match="nested deeper than 64 levels"):
        compare(deep_a, deep_b)


def test_an_expanded_tensor_is_not_materialized() -> None:
    a, b = torch.zeros(1).expand(2**34), torch.ones(1).expand(2**34)  # 4 bytes of storage each
    with pytest.raises(DumpLoadError, match="budget"):
        compare(a, b)
    (d,) = compare(torch.zeros(1).expand(1000), torch.ones(1).expand(1000))  # within: compared
    assert d.mismatched == 1000
