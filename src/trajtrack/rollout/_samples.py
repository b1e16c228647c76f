"""The records a fully-async rollouter hands to the trainer.

Both are plain dataclasses whose ``==`` compares field by field with tensor- and
array-aware deep equality (a dataclass's generated ``==`` would fail on a tensor or an
array inside a field). They pickle as one call of a rebuild function over their attributes
(:mod:`trajtrack.rollout._pickling`), which ``torch.load(..., weights_only=True)`` accepts
once :data:`trajtrack.rollout.SAFE_GLOBALS` is allow-listed, and trajtrack's fast loader
reads without it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._equality import values_equal

__all__ = ["RolloutSample", "ValidateMetrics"]


class _Record:
    """What both records share: deep ``==``, no hash, and their pickled form both ways."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return _fields_equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the generated dataclass

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from ._pickling import reduce_record  # (it imports this module)

        return reduce_record(self)

    def __setstate__(self, state: Any) -> None:
        """The state of a dump written before the rebuild form (``NEWOBJ`` + ``BUILD``, which
        ``torch.load`` and the load worker apply): checked like a rebuild's, never copied
        into the object as it is."""
        from ._pickling import restore_state

        restore_state(self, state)


@dataclasses.dataclass(eq=False)
class RolloutSample(_Record):
    """One prompt's rollout: its generated batch plus bookkeeping.

    Field order follows verl's Jan-2026 ``RolloutSample``, so positional construction as
    in verl keeps working; every field after ``full_batch`` has a default, so verl 0.9.1's
    keyword construction (``full_batch``, ``sample_id``, ``epoch``, ``rollout_status``) works
    too.

    Attributes:
        full_batch: The prompt batch (one prompt repeated ``rollout.n`` times), replaced by
            the generated output once generation finishes. A
            :class:`~trajtrack.rollout.RolloutBatch` or verl's ``DataProto``.
        agent_loop_output_list: Per-trajectory agent-loop outputs (kept for partial rollouts).
        sample_id: Identifier, in verl ``f"sample_{epoch}_{step}"``.
        epoch: Dataloader epoch the prompt came from.
        processing_times: Per-trajectory generation time in seconds. Used by
            :func:`~trajtrack.rollout.assemble_batch_from_rollout_samples` only when the
            batch has no ``processing_times`` column.
        tool_calls: Per-trajectory tool-call time in seconds (same fallback role).
        param_version: Parameter version the prompt was submitted under.
        param_version_start: Per-trajectory parameter version when generation started.
        param_version_end: Per-trajectory parameter version when generation ended.
        rollout_status: Rollouter statistics snapshot taken when the sample finished.
    """

    full_batch: Any
    agent_loop_output_list: list[Any] = dataclasses.field(default_factory=list)
    sample_id: str = ""
    epoch: int = 0
    processing_times: list[float] = dataclasses.field(default_factory=list)
    tool_calls: list[float] = dataclasses.field(default_factory=list)
    param_version: int = 0
    param_version_start: list[int] = dataclasses.field(default_factory=list)
    param_version_end: list[int] = dataclasses.field(default_factory=list)
    rollout_status: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class ValidateMetrics(_Record):
    """Validation results sent from the rollouter to the trainer.

    Attributes:
        timing_raw: Timings of the validation run, keyed by phase.
        metrics: Validation metrics, if computed.
        global_steps: Trainer step the validation belongs to.
        param_version: Parameter version that was validated.
    """

    timing_raw: dict[str, Any]
    metrics: dict[str, Any] | None = None
    global_steps: int | None = None
    param_version: int | None = None


def _fields_equal(a: Any, b: Any) -> bool:
    return all(values_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
