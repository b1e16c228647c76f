"""tensordict's pickle reductions, re-done from data only, for torch's weights-only unpickler.

tensordict 0.10.0 pickles a consolidated ``TensorDict`` (what verl's ``DataProto`` writes for a
non-empty batch) as ``_rebuild_tensordict_files_consolidated(metadata, storage)``: ``storage`` a
flat ``uint8`` tensor, ``metadata`` a dict of ``cls``, ``cls_metadata`` (batch size, device,
names, lock), ``non_tensors``, ``leaves`` (``key: (dtype name, shape, start, stop, pad)``) and
one nested dict per sub-TensorDict. Any other TensorDict (an empty batch) is pickled as
``_make_td(TensorDict, state)`` with the instance's ``__dict__`` (``_tensordict``, its tensors and
sub-TensorDicts; ``_batch_size``). ``_rebuild_tensordict_files(flat_key_values, metadata)``
(tensors keyed by their key path) is what tensordict's multiprocessing reduction sends.

The stand-ins here take the same arguments, check every key, dtype, shape and offset against
the storage (:class:`~trajtrack.DumpLoadError` otherwise), build each tensor from a copy of its
slice of the storage with public torch calls, and return a :class:`TensorDictStandIn`: a
mapping of tensors and nested stand-ins with a batch size, which
:func:`trajtrack.reader._standins.finish` turns into nested dicts. Non-tensor entries and
nested jagged tensors are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from trajtrack._exceptions import DumpLoadError
from trajtrack._numpy_standins import mark_pending

__all__ = ["TENSORDICT_GLOBALS", "TensorDictStandIn"]

_MAX_NESTING = 64  # sub-TensorDicts inside sub-TensorDicts
_TensorOf = Callable[[tuple[str, ...], Any], torch.Tensor]
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(value): value for value in vars(torch).values() if isinstance(value, torch.dtype)
}


def _refuse(what: str) -> DumpLoadError:
    return DumpLoadError(f"refusing a TensorDict pickle: {what}")


class TensorDictStandIn:
    """A TensorDict read as data: :attr:`items` (tensors, nested stand-ins), :attr:`batch_size`."""

    __slots__ = ("batch_size", "items")

    def __init__(self, items: dict[str, Any], batch_size: tuple[int, ...]) -> None:
        for key, value in items.items():
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value.batch_size
            if shape[: len(batch_size)] != batch_size:
                raise _refuse(f"{key!r} of shape {list(shape)} outside batch size {batch_size}")
        self.items = items
        self.batch_size = batch_size
        mark_pending()


class TensorDictClass:
    """``tensordict._td.TensorDict`` as an argument of ``_make_td``; never built itself."""

    def __setstate__(self, state: Any) -> None:
        raise _refuse("a TensorDict built other than by tensordict's own reductions")


def _key(key: Any) -> str:
    if type(key) is not str:
        raise _refuse(f"key {key!r:.40} is not a string")
    if key.startswith("<NJT"):
        raise _refuse(f"nested jagged tensors are not supported ({key!r:.60})")
    return key


def _sizes(value: Any, what: str) -> tuple[int, ...]:
    if type(value) not in (list, tuple, torch.Size):
        raise _refuse(f"{what} is not a list of sizes")
    if not all(type(n) is int and n >= 0 for n in value):
        raise _refuse(f"{what} is not a list of sizes")
    return tuple(value)


def _leaf(key: str, leaf: Any, storage: torch.Tensor) -> torch.Tensor:
    """One tensor of a consolidated TensorDict: checked, then a slice of the storage."""
    if type(leaf) not in (tuple, list) or len(leaf) != 5:
        raise _refuse(f"leaf {key!r} is not (dtype, shape, start, stop, pad)")
    dtype_name, shape_in, start, stop, pad = leaf
    dtype = _TORCH_DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise _refuse(f"leaf {key!r} has unknown dtype {dtype_name!r:.40}")
    shape = _sizes(shape_in, f"leaf {key!r}'s shape")
    if type(start) is not int or type(stop) is not int or not 0 <= start <= stop:
        raise _refuse(f"leaf {key!r} has bad offsets {start!r:.20}..{stop!r:.20}")
    if stop > storage.numel():
        raise _refuse(f"leaf {key!r} ends at byte {stop}, past its {storage.numel()}-byte storage")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > stop - start or (not pad and nbytes != stop - start):
        raise _refuse(f"leaf {key!r}: {nbytes} bytes of data do not fit {start}..{stop}")
    # A copy of its own bytes: tensors viewing one storage as different dtypes cannot be saved
    # again (torch.save refuses them: the load worker's reply, an export), and the copy is
    # aligned for the wider dtype.
    chunk = storage[start : start + nbytes].clone()
    try:
        return chunk.view(dtype).view(shape)
    except RuntimeError as exc:  # a dtype that cannot view bytes (quantized...)
        raise _refuse(f"leaf {key!r}: {exc}") from None


def _build(
    metadata: Any, tensor_of: _TensorOf, prefix: tuple[str, ...], depth: int
) -> TensorDictStandIn:
    """One TensorDict from its metadata: *tensor_of(key path, leaf)* gives each tensor."""
    if depth > _MAX_NESTING:
        raise _refuse(f"TensorDicts nested more than {_MAX_NESTING} deep")
    if type(metadata) is not dict:
        raise _refuse("metadata is not a dict")
    rest = dict(metadata)
    leaves, batch_size = _head(rest)
    rest.pop("size", None)  # the storage's size, for tensordict's own readers
    items: dict[str, Any] = {}
    for key, leaf in leaves.items():
        items[_key(key)] = tensor_of((*prefix, key), leaf)
    for key, sub in rest.items():
        if _key(key) in items:
            raise _refuse(f"key {key!r} is both a tensor and a sub-TensorDict")
        items[key] = _build(sub, tensor_of, (*prefix, key), depth + 1)
    return TensorDictStandIn(items, batch_size)


def _head(metadata: dict[str, Any]) -> tuple[dict[Any, Any], tuple[int, ...]]:
    """Pops and checks the entries every level of metadata has; returns leaves, batch size."""
    cls = metadata.pop("cls", None)
    if cls != "TensorDict":
        raise _refuse(f"class {cls!r:.40} is not supported (only TensorDict)")
    leaves = metadata.pop("leaves", None)
    non_tensors = metadata.pop("non_tensors", None)
    cls_metadata = metadata.pop("cls_metadata", None)
    if type(leaves) is not dict or type(non_tensors) is not dict or type(cls_metadata) is not dict:
        raise _refuse("leaves, non_tensors or cls_metadata is not a dict")
    if non_tensors:
        raise _refuse(f"non-tensor entries are not supported ({sorted(map(str, non_tensors))})")
    return leaves, _sizes(cls_metadata.get("batch_size"), "batch size")


def _rebuild_consolidated(metadata: Any, storage: Any) -> TensorDictStandIn:
    """``_rebuild_tensordict_files_consolidated(metadata, storage)``, from data."""
    if type(storage) is not torch.Tensor or storage.dtype != torch.uint8 or storage.dim() != 1:
        raise _refuse("the consolidated storage is not a 1-D uint8 tensor")
    return _build(metadata, lambda path, leaf: _leaf(path[-1], leaf, storage), (), 0)


def _rebuild_files(flat_key_values: Any, metadata: Any, is_shared: Any = False) -> Any:
    """``_rebuild_tensordict_files(flat_key_values, metadata_dict)``, from data."""
    if type(flat_key_values) is not dict:
        raise _refuse("flat_key_values is not a dict")

    def tensor_of(path: tuple[str, ...], _: Any) -> torch.Tensor:
        value = flat_key_values.get(path)
        if type(value) is not torch.Tensor:
            raise _refuse(f"no tensor for key {path!r:.80}")
        return value

    return _build(metadata, tensor_of, (), 0)


def _rebuild_files_shared(flat_key_values: Any, metadata: Any) -> Any:
    """``_rebuild_tensordict_files_shared``: the same data."""
    return _rebuild_files(flat_key_values, metadata)


def _make_td(cls: Any, state: Any) -> TensorDictStandIn:
    """``_make_td(TensorDict, state)``: a TensorDict from its ``__dict__``, as data."""
    if cls is not TensorDictClass or type(state) is not dict:
        raise _refuse("_make_td with something other than a TensorDict and its state")
    items = state.get("_tensordict")
    if type(items) is not dict:
        raise _refuse("the state's _tensordict is not a dict")
    for key, value in items.items():
        _key(key)
        if type(value) not in (torch.Tensor, TensorDictStandIn):
            raise _refuse(f"entry {key!r:.40} is neither a tensor nor a TensorDict")
    return TensorDictStandIn(dict(items), _sizes(state.get("_batch_size"), "batch size"))


_REDUCTIONS = "tensordict._reductions"

TENSORDICT_GLOBALS: tuple[tuple[Any, str], ...] = (
    (TensorDictClass, "tensordict._td.TensorDict"),
    (_make_td, f"{_REDUCTIONS}._make_td"),
    (_rebuild_consolidated, f"{_REDUCTIONS}._rebuild_tensordict_files_consolidated"),
    (_rebuild_files, f"{_REDUCTIONS}._rebuild_tensordict_files"),
    (_rebuild_files_shared, f"{_REDUCTIONS}._rebuild_tensordict_files_shared"),
)
"""(stand-in, tensordict's name) pairs for ``torch.serialization.add_safe_globals``."""
