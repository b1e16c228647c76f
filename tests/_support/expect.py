"""An equality for tests that shares no code with the library's own (``values_equal``).

Round trips must be checked against an independent judge: were the library's comparison
broken (say, tensors equal whenever their dtype and shape match), a test using it would pass.
This one compares tensors with ``torch.equal`` (dtype first; NaNs by position), arrays with
numpy, dataclasses and batches field by field, containers item by item, and fails with the
path of the first difference.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Raise ``AssertionError`` naming *path* where *got* and *want* first differ."""
    where = path or "<root>"
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, want a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: dtype/shape"
        if want.is_floating_point():
            assert torch.equal(got.isnan(), want.isnan()), f"{where}: NaN positions"
            got, want = got.nan_to_num(0.0), want.nan_to_num(0.0)
        assert torch.equal(got, want), f"{where}: values differ: {got} vs {want}"
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: {type(got).__name__}, want an array"
        assert got.shape == want.shape and got.dtype == want.dtype, f"{where}: dtype/shape"
        if want.dtype == object:
            for i, (g, w) in enumerate(zip(got.ravel(), want.ravel(), strict=True)):
                assert_same(g, w, f"{path}[{i}]")
        else:
            assert np.array_equal(got, want, equal_nan=want.dtype.kind in "fc"), where
    elif dataclasses.is_dataclass(want) and not isinstance(want, type):
        assert type(got) is type(want), f"{where}: {type(got).__name__} vs {type(want).__name__}"
        for field in dataclasses.fields(want):
            assert_same(getattr(got, field.name), getattr(want, field.name), f"{path}.{field.name}")
    elif all(hasattr(want, part) for part in ("batch", "non_tensor_batch", "meta_info")):
        assert type(got) is type(want), f"{where}: {type(got).__name__}"
        for part in ("batch", "non_tensor_batch", "meta_info"):
            assert_same(dict(getattr(got, part)), dict(getattr(want, part)), f"{path}.{part}")
    elif isinstance(want, Mapping):
        assert isinstance(got, Mapping), f"{where}: {type(got).__name__}, want a mapping"
        assert list(got) == list(want), f"{where}: keys {list(got)} vs {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: {got!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), f"{where}: {got!r}, want NaN"
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} vs {want!r}"
