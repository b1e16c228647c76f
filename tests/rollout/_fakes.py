"""A stand-in for verl's ``DataProto``, written independently of ``RolloutBatch``.

The rollout functions must only use the batch's own class methods (duck typing); these
tests pass this class in and check that results come back as this class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class FakeDataProto:
    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        for tensor in self.batch.values():
            return int(tensor.shape[0])
        for array in self.non_tensor_batch.values():
            return int(array.shape[0])
        return 0

    @classmethod
    def from_single_dict(cls, data: dict[str, Any]) -> FakeDataProto:
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        arrays = {k: v for k, v in data.items() if isinstance(v, np.ndarray)}
        return cls(tensors, arrays)

    @staticmethod
    def concat(items: list[FakeDataProto]) -> FakeDataProto:
        first = items[0]
        return FakeDataProto(
            {k: torch.cat([i.batch[k] for i in items]) for k in first.batch},
            {
                k: np.concatenate([i.non_tensor_batch[k] for i in items])
                for k in first.non_tensor_batch
            },
            dict(first.meta_info),
        )

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> FakeDataProto:
        assert interleave
        return FakeDataProto(
            {k: v.repeat_interleave(repeat_times, dim=0) for k, v in self.batch.items()},
            {k: np.repeat(v, repeat_times, axis=0) for k, v in self.non_tensor_batch.items()},
            self.meta_info,
        )
