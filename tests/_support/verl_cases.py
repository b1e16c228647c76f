"""The verl fixtures: what each holds, built from torch and numpy alone, and how to write them.

``tests/verl/fixtures/*.pt`` are ``torch.save`` files of real verl 0.9.1 objects (``DataProto``,
verl's fully-async ``RolloutSample``) written by :func:`write_fixtures` (``python
tests/verl/make_fixtures.py``). The values are deterministic, so a test without verl or
tensordict installed compares what trajtrack reads from them with :func:`expected`, built here
from torch and numpy only (with ``_support.expect.assert_same``: ``torch.equal`` and numpy's own
equality, never trajtrack's).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import io
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

FIXTURES = Path(__file__).resolve().parent.parent / "verl" / "fixtures"
SAMPLE_MODULE = "verl.experimental.fully_async_policy.detach_utils"

#: name -> (nested batch or None, serialization method)
_BATCHES: dict[str, tuple[str | None, str | None]] = {
    "consolidated": ("flat", None),
    "nested": ("nested", None),
    "empty_batch": ("empty", None),
    "numpy_form": ("flat", "numpy"),
    "no_batch": (None, None),
}
NAMES = (*_BATCHES, "verl_sample", "containers", "bare_tensordict")


def tensors(kind: str, rows: int = 3) -> dict[str, Any]:
    """The batch's tensors: ``flat`` (several dtypes), ``nested`` (a sub-TensorDict), ``empty``."""
    if kind == "empty":
        return {}
    g = torch.Generator().manual_seed(7)
    flat: dict[str, Any] = {
        "input_ids": torch.randint(0, 1000, (rows, 5), generator=g),
        "attention_mask": torch.rand(rows, 5, generator=g) > 0.3,
        "old_log_probs": torch.randn(rows, 5, generator=g),
        "rollout_log_probs": torch.randn(rows, 5, generator=g).to(torch.bfloat16),
        "token_level_scores": torch.randn(rows, 5, generator=g).to(torch.float16),
        "position_ids": torch.arange(rows * 5, dtype=torch.int32).reshape(rows, 5),
    }
    if kind == "nested":
        flat["critic"] = {"values": torch.randn(rows, 5, generator=g), "steps": torch.arange(rows)}
    return flat


def non_tensors(rows: int = 3) -> dict[str, np.ndarray[Any, Any]]:
    """Per-row values as verl has them: object arrays of str and of chat lists, numbers."""
    uid = np.array([f"uid-{i}" for i in range(rows)], dtype=object)
    chats = np.empty(rows, dtype=object)
    for i in range(rows):
        chats[i] = [{"role": "user", "content": f"question {i}"}]
    return {"uid": uid, "raw_prompt": chats, "score": np.linspace(0.0, 1.0, rows)}


def meta_info() -> dict[str, Any]:
    return {"temperature": 0.7, "global_steps": 3, "timing": {"gen": 1.25}, "eos": [1, 2]}


def expected(name: str) -> Any:
    """What trajtrack reads from fixture *name*: RolloutBatch / RolloutSample / containers."""
    from trajtrack.rollout import RolloutBatch, RolloutSample

    if name in _BATCHES:
        kind, _ = _BATCHES[name]
        batch = tensors(kind) if kind is not None else {}
        return RolloutBatch(batch, non_tensors(), meta_info())
    if name == "verl_sample":
        return RolloutSample(
            full_batch=expected("nested"),
            sample_id="sample_0_3",
            epoch=0,
            rollout_status={"count/total_generated_samples": 12, "staleness": 0.5},
        )
    if name == "bare_tensordict":  # a TensorDict dumped by itself: tensordict's _make_td form
        return tensors("nested")
    one = expected("consolidated")
    return [one, {"again": one, "step": 3}]


# ----------------------------------------------------------------- writing (needs verl)


def verl_rollout_sample_class() -> type:
    """verl 0.9.1's ``RolloutSample``: the real class, or the same dataclass from its source.

    The real module imports verl's trainer (torchdata, datasets, peft...). Without those, the
    class statement is taken from the installed verl's own source and registered under the
    real module name, so pickles name ``verl.experimental...detach_utils.RolloutSample``.
    """
    try:
        module = importlib.import_module(SAMPLE_MODULE)
    except ImportError:
        spec = importlib.util.find_spec("verl")
        assert spec is not None and spec.submodule_search_locations is not None
        root = Path(next(iter(spec.submodule_search_locations)))
        source = (root / "experimental" / "fully_async_policy" / "detach_utils.py").read_text()
        node = next(
            n
            for n in ast.parse(source).body
            if isinstance(n, ast.ClassDef) and n.name == "RolloutSample"
        )
        module = types.ModuleType(SAMPLE_MODULE)
        module.__dict__.update(dataclass=dataclasses.dataclass, Any=Any)
        sys.modules[SAMPLE_MODULE] = module  # the dataclass decorator looks its module up
        code = compile(ast.Module(body=[node], type_ignores=[]), str(root), "exec")
        exec(code, module.__dict__)  # verl's own class statement
    cls: type = module.RolloutSample
    return cls


@contextmanager
def serialization_method(method: str | None) -> Iterator[None]:
    """``VERL_DATAPROTO_SERIALIZATION_METHOD`` set (or unset) while verl pickles."""
    old = os.environ.pop("VERL_DATAPROTO_SERIALIZATION_METHOD", None)
    if method is not None:
        os.environ["VERL_DATAPROTO_SERIALIZATION_METHOD"] = method
    try:
        yield
    finally:
        os.environ.pop("VERL_DATAPROTO_SERIALIZATION_METHOD", None)
        if old is not None:
            os.environ["VERL_DATAPROTO_SERIALIZATION_METHOD"] = old


def real_object(name: str) -> tuple[Any, str | None]:
    """The verl object behind fixture *name*, and the serialization method to save it with."""
    from tensordict import TensorDict
    from verl.protocol import DataProto

    if name in _BATCHES:
        kind, method = _BATCHES[name]
        batch = TensorDict(tensors(kind), batch_size=[3]) if kind is not None else None
        return DataProto(batch=batch, non_tensor_batch=non_tensors(), meta_info=meta_info()), method
    if name == "verl_sample":
        proto, _ = real_object("nested")
        status = {"count/total_generated_samples": 12, "staleness": 0.5}
        sample = verl_rollout_sample_class()(
            full_batch=proto, sample_id="sample_0_3", epoch=0, rollout_status=status
        )
        return sample, None
    if name == "bare_tensordict":
        return TensorDict(tensors("nested"), batch_size=[3]), None
    proto, _ = real_object("consolidated")
    return [proto, {"again": proto, "step": 3}], None


def saved(name: str) -> bytes:
    """``torch.save`` of fixture *name*'s real object (needs verl and tensordict)."""
    obj, method = real_object(name)
    buffer = io.BytesIO()
    with serialization_method(method):
        torch.save(obj, buffer)
    return buffer.getvalue()


def write_fixtures(dest: Path) -> None:
    """Write every fixture into *dest* as ``NAME.pt`` (needs verl and tensordict)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        (dest / f"{name}.pt").write_bytes(saved(name))
