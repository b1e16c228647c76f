"""A small batch container compatible with verl's ``DataProto``.

:class:`RolloutBatch` keeps the three parts of a ``DataProto`` — tensors sharing a leading
batch dimension, per-row non-tensor values as numpy arrays, and a free-form ``meta_info``
dict — with plain dicts instead of a ``TensorDict`` (a nested TensorDict is a nested dict of
tensors), so it has no dependency beyond torch and numpy and pickles as plain dicts, tensors
and arrays (loadable with ``torch.load(..., weights_only=True)`` once
:data:`trajtrack.rollout.SAFE_GLOBALS` is allow-listed). trajtrack's reader returns a dumped
``DataProto`` as one; :meth:`RolloutBatch.from_dataproto` and
:meth:`RolloutBatch.to_dataproto` convert in memory.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from trajtrack._exceptions import MissingDependencyError

from ._batch_ops import concat_parts, map_tensors, repeat_parts, subset
from ._equality import values_equal
from ._errors import BatchConflictError, BatchSizeError, BatchTypeError

__all__ = ["RolloutBatch", "to_object_array"]

logger = logging.getLogger(__name__)

# Bumped when the pickled layout of RolloutBatch changes; __setstate__ checks it.
_STATE_VERSION = 1
# Nested TensorDicts inside nested TensorDicts: a bound for the recursive checks.
_MAX_NESTING = 64


def to_object_array(values: Iterable[Any]) -> np.ndarray[Any, np.dtype[Any]]:
    """Build a 1-D ``dtype=object`` array holding each item as one element.

    Unlike ``np.array(values, dtype=object)``, a list of equal-length lists stays 1-D.

    Args:
        values: The per-row values.

    Returns:
        A 1-D object array with one element per item.
    """
    items = list(values)
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


class RolloutBatch:
    """Tensors, per-row numpy arrays and metadata sharing one batch dimension.

    The dicts are copied on construction (the tensors and arrays in them are not).

    Args:
        batch: Tensors keyed by name; each has the batch size as its first dimension. A value
            may also be a mapping of the same kind (a nested ``TensorDict``).
        non_tensor_batch: Per-row values keyed by name: numpy arrays (usually 1-D
            ``dtype=object``), or lists/tuples, which become 1-D object arrays.
        meta_info: Metadata about the whole batch (not per row).

    Attributes:
        batch: Tensors (and nested mappings of tensors) keyed by name.
        non_tensor_batch: Numpy arrays keyed by name, one element per row.
        meta_info: Metadata about the whole batch.

    Raises:
        BatchSizeError: A tensor or array does not have the batch size as its first dimension.
        BatchTypeError: A value is not a tensor or a mapping of tensors (in ``batch``) or an
            array, list or tuple (in ``non_tensor_batch``).
    """

    batch: dict[str, Any]
    non_tensor_batch: dict[str, np.ndarray[Any, Any]]
    meta_info: dict[str, Any]

    def __init__(
        self,
        batch: Mapping[str, Any] | None = None,
        non_tensor_batch: Mapping[str, np.ndarray[Any, Any] | Sequence[Any]] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> None:
        self.batch = dict(batch or {})
        self.non_tensor_batch = {
            key: _as_row_array(key, value) for key, value in (non_tensor_batch or {}).items()
        }
        self.meta_info = dict(meta_info or {})
        self.check_consistency()

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_single_dict(
        cls, data: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None
    ) -> RolloutBatch:
        """Split a collated dict into tensors and non-tensors.

        Args:
            data: Values keyed by name: ``torch.Tensor`` go to :attr:`batch`, ``np.ndarray``
                to :attr:`non_tensor_batch`.
            meta_info: Optional metadata.

        Returns:
            A new batch.

        Raises:
            BatchTypeError: A value is neither a tensor nor an ndarray.
        """
        tensors: dict[str, torch.Tensor] = {}
        arrays: dict[str, np.ndarray[Any, Any]] = {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                arrays[key] = value
            else:
                raise BatchTypeError(
                    f"unsupported type for key {key!r}: {type(value).__name__} "
                    "(expected torch.Tensor or numpy.ndarray)"
                )
        return cls(tensors, arrays, meta_info)

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> RolloutBatch:
        """Build a batch from separate tensor and non-tensor mappings.

        Args:
            tensors: Tensors keyed by name.
            non_tensors: Per-row values keyed by name (arrays, lists or tuples).
            meta_info: Optional metadata.

        Returns:
            A new batch.
        """
        return cls(tensors, non_tensors, meta_info)

    @classmethod
    def from_dataproto(cls, proto: Any) -> RolloutBatch:
        """The same data as verl's ``DataProto`` *proto*, without verl or tensordict.

        The TensorDict's tensors are shared, not copied; a nested TensorDict becomes a nested
        dict; ``non_tensor_batch`` and ``meta_info`` are shallow copies.

        Args:
            proto: A ``verl.protocol.DataProto`` (or anything with its ``batch``,
                ``non_tensor_batch`` and ``meta_info``).

        Returns:
            A new batch.

        Raises:
            BatchTypeError: The TensorDict holds a value that is neither a tensor nor a
                TensorDict (e.g. non-tensor data).
            BatchSizeError: As for the constructor.
        """
        batch = {} if proto.batch is None else _from_tensordict(proto.batch, 0)
        return cls(batch, dict(proto.non_tensor_batch or {}), dict(proto.meta_info or {}))

    def to_dataproto(self) -> Any:
        """The same data as a verl ``DataProto`` (verl and tensordict imported now).

        Nested dicts become nested TensorDicts with the batch dimension; tensors are shared.
        A batch without tensors gives a ``DataProto`` whose ``batch`` is ``None``.

        Returns:
            A ``verl.protocol.DataProto``.

        Raises:
            MissingDependencyError: verl or tensordict is not installed.
        """
        try:
            from tensordict import TensorDict
            from verl.protocol import DataProto
        except ImportError as exc:
            raise MissingDependencyError(
                f"RolloutBatch.to_dataproto needs verl and tensordict: {exc}"
            ) from exc
        batch = TensorDict(self.batch, batch_size=[len(self)]) if self.batch else None
        return DataProto(
            batch=batch,
            non_tensor_batch=dict(self.non_tensor_batch),
            meta_info=dict(self.meta_info),
        )

    # -- invariants -----------------------------------------------------------------------

    def check_consistency(self) -> None:
        """Check that every tensor and array has the batch size as its first dimension.

        Raises:
            BatchSizeError: Naming the offending key, its size and the batch size.
            BatchTypeError: A value in :attr:`batch` is not a tensor.
        """
        expected: tuple[str, int] | None = None
        for key, tensor in _leaves(self.batch):
            expected = _check_rows(key, _leading_dim(key, tensor.shape), expected)
        for key, array in self.non_tensor_batch.items():
            expected = _check_rows(key, _leading_dim(key, array.shape), expected)

    def __len__(self) -> int:
        for _, tensor in _leaves(self.batch):
            return int(tensor.shape[0])
        for array in self.non_tensor_batch.values():
            return int(array.shape[0])
        return 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutBatch):
            return NotImplemented
        return (
            values_equal(self.batch, other.batch)
            and values_equal(self.non_tensor_batch, other.non_tensor_batch)
            and values_equal(self.meta_info, other.meta_info)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable container, like dict

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in _leaves(self.batch))
        arrays = ", ".join(self.non_tensor_batch)
        return (
            f"RolloutBatch(len={len(self)}, batch={{{tensors}}}, "
            f"non_tensor_batch=[{arrays}], meta_info={sorted(self.meta_info)})"
        )

    # -- pickling: plain dicts of tensors/arrays so weights_only loading works ----------------

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # One call of an allow-listed rebuild over plain data, no numpy reconstructor
        # (see trajtrack.rollout._pickling); __setstate__ still reads older dumps.
        from ._pickling import reduce_batch  # (it imports this module)

        return reduce_batch(self)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "batch": dict(self.batch),
            "non_tensor_batch": dict(self.non_tensor_batch),
            "meta_info": dict(self.meta_info),
        }

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        version = state.get("version")
        if version != _STATE_VERSION:
            raise BatchTypeError(f"unsupported RolloutBatch state version {version!r}")
        self.batch = dict(state["batch"])
        self.non_tensor_batch = dict(state["non_tensor_batch"])
        self.meta_info = dict(state["meta_info"])
        self.check_consistency()

    # -- DataProto-compatible operations ----------------------------------------------------

    @staticmethod
    def concat(data: Sequence[RolloutBatch]) -> RolloutBatch:
        """Concatenate batches along the batch dimension.

        All batches must have the same tensor keys and the same non-tensor keys, and
        tensors under one key must agree on every dimension but the first. ``meta_info``
        is merged as ``DataProto.concat`` does: ``"metrics"`` entries are collected across
        batches (lists extended, dicts appended) and, when they are all dicts, turned into
        a dict of lists; every other key must be equal in every batch that has it.

        Args:
            data: The batches, in order.

        Returns:
            A new batch (of the first batch's class).

        Raises:
            ValueError: ``data`` is empty.
            BatchKeyError: The batches do not have the same keys.
            BatchSizeError: Tensors under one key differ beyond the first dimension.
            BatchConflictError: A ``meta_info`` key has different values.
        """
        if not data:
            raise ValueError("cannot concat an empty list of batches")
        return type(data[0])(*concat_parts(data))

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> RolloutBatch:
        """Repeat every row.

        Args:
            repeat_times: How many copies of each row (at least 1).
            interleave: ``True`` gives ``[a, a, b, b]``, ``False`` gives ``[a, b, a, b]``.

        Returns:
            A new batch; ``meta_info`` is a shallow copy.

        Raises:
            ValueError: ``repeat_times`` is not a positive integer.
        """
        tensors, arrays = repeat_parts(self.batch, self.non_tensor_batch, repeat_times, interleave)
        return type(self)(tensors, arrays, dict(self.meta_info))

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> RolloutBatch:
        """Return a new batch with a subset of the keys (``None`` keeps all of a part).

        Tensors and arrays are shared with this batch unless ``deepcopy`` is true.

        Raises:
            BatchKeyError: A requested key does not exist.
        """
        tensors = subset("batch", self.batch, batch_keys)
        arrays = subset("non_tensor_batch", self.non_tensor_batch, non_tensor_batch_keys)
        meta = subset("meta_info", self.meta_info, meta_info_keys)
        if deepcopy:
            tensors = map_tensors(torch.Tensor.clone, tensors)
            arrays = copy.deepcopy(arrays)
            meta = copy.deepcopy(meta)
        return type(self)(tensors, arrays, meta)

    def pop(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> RolloutBatch:
        """Remove keys from this batch and return them as a new batch.

        ``None`` pops nothing from that part. Nothing is removed if any key is missing.

        Raises:
            BatchKeyError: A requested key does not exist.
        """
        b_keys = list(batch_keys or [])
        n_keys = list(non_tensor_batch_keys or [])
        m_keys = list(meta_info_keys or [])
        popped = self.select(b_keys, n_keys, m_keys)
        for key in b_keys:
            del self.batch[key]
        for key in n_keys:
            del self.non_tensor_batch[key]
        for key in m_keys:
            del self.meta_info[key]
        return popped

    def union(self, other: RolloutBatch) -> RolloutBatch:
        """Merge ``other`` into this batch in place and return ``self``.

        New keys are added; keys present in both must hold equal values.

        Raises:
            BatchSizeError: The two batches have different lengths.
            BatchConflictError: A shared key holds different values.
        """
        if self._has_rows() and other._has_rows() and len(self) != len(other):
            raise BatchSizeError(
                f"cannot union batches of different sizes: {len(self)} and {len(other)}"
            )
        for part in ("batch", "non_tensor_batch", "meta_info"):
            mine: dict[str, Any] = getattr(self, part)
            theirs: dict[str, Any] = getattr(other, part)
            for key, value in theirs.items():
                if key in mine and not values_equal(mine[key], value):
                    raise BatchConflictError(f"cannot union: {part}[{key!r}] differs")
        merged_batch = {**self.batch, **other.batch}
        merged_arrays = {**self.non_tensor_batch, **other.non_tensor_batch}
        RolloutBatch(merged_batch, merged_arrays)  # validates before we mutate self
        self.batch, self.non_tensor_batch = merged_batch, merged_arrays
        self.meta_info.update(other.meta_info)
        return self

    def reorder(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Permute the rows in place (what verl's ``_balance_batch`` calls).

        Args:
            indices: New order, as row indices of the current batch.
        """
        index = torch.as_tensor(indices, dtype=torch.long)
        np_index = index.cpu().numpy()
        self.batch = map_tensors(lambda v: v[index.to(v.device)], self.batch)
        self.non_tensor_batch = {k: v[np_index] for k, v in self.non_tensor_batch.items()}

    def _has_rows(self) -> bool:
        return bool(self.batch or self.non_tensor_batch)


def _leaves(
    batch: Mapping[str, Any], prefix: str = "", depth: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key path, tensor)`` for every tensor of *batch*, nested mappings included."""
    if depth > _MAX_NESTING:
        raise BatchTypeError(f"batch[{prefix!r}] nests mappings more than {_MAX_NESTING} deep")
    for key, value in batch.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, torch.Tensor):
            yield path, value
        elif isinstance(value, Mapping):
            yield from _leaves(value, path, depth + 1)
        else:
            raise BatchTypeError(
                f"batch[{path!r}] must be a torch.Tensor or a mapping of them, "
                f"got {type(value).__name__}"
            )


def _from_tensordict(tensordict: Any, depth: int) -> dict[str, Any]:
    if depth > _MAX_NESTING:
        raise BatchTypeError(f"TensorDicts nested more than {_MAX_NESTING} deep")
    return {
        key: value if isinstance(value, torch.Tensor) else _from_tensordict(value, depth + 1)
        for key, value in tensordict.items()
    }


def _as_row_array(key: str, value: Any) -> np.ndarray[Any, Any]:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, list | tuple):
        return to_object_array(value)
    raise BatchTypeError(
        f"non_tensor_batch[{key!r}] must be a numpy array, list or tuple, "
        f"got {type(value).__name__}"
    )


def _leading_dim(key: str, shape: Sequence[int]) -> int:
    if len(shape) == 0:
        raise BatchSizeError(f"{key!r} is a scalar; batch values need a leading batch dimension")
    return int(shape[0])


def _check_rows(key: str, rows: int, expected: tuple[str, int] | None) -> tuple[str, int]:
    if expected is not None and rows != expected[1]:
        raise BatchSizeError(
            f"batch size mismatch: {key!r} has {rows} rows but {expected[0]!r} has {expected[1]}"
        )
    return expected or (key, rows)
