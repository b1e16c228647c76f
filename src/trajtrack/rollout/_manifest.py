"""Which samples made up a trainer step: a small per-step manifest, written through the tracker.

In fully-async training the rollouter dumps each :class:`~trajtrack.rollout.RolloutSample` as
it completes, named after the sample, not after the trainer step that will consume it; only
the trainer knows which samples it assembled into step *n*, and in which order.
:func:`record_step_manifest` dumps that knowledge as a plain dict (it loads under
``torch.load(weights_only=True)`` with no allow-list), and ``Run.replay`` reads it back to
yield exactly those samples, in that order, for the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from trajtrack._exceptions import ConfigurationError, DumpLoadError

__all__ = [
    "MANIFEST_FORMAT",
    "STEP_MANIFEST",
    "manifest_dumps",
    "record_step_manifest",
    "step_manifest",
]

STEP_MANIFEST = "manifest/step{step}"
"""The default name of a step's manifest, and where ``Run.replay`` looks for it."""

MANIFEST_FORMAT = "trajtrack.step_manifest/1"

R = TypeVar("R")


def step_manifest(step: int, dumps: Sequence[str]) -> dict[str, Any]:
    """The manifest of trainer step *step*: the dump names of its samples, in assembly order.

    Raises:
        ConfigurationError: *step* is not a non-negative integer, or a name is not a string.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigurationError(f"a step manifest needs a step number >= 0, got {step!r}")
    names = list(dumps)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ConfigurationError(f"step {step}: sample dump names must be strings, got {bad[:3]!r}")
    return {"format": MANIFEST_FORMAT, "step": step, "dumps": names}


def record_step_manifest(
    dump: Callable[[Any, str], R],
    step: int,
    dumps: Sequence[str],
    *,
    name: str = STEP_MANIFEST,
) -> R:
    """Dump the manifest of trainer step *step* through a tracker's ``dump``.

    Call it where the trainer assembles its batch, with the names the rollouter dumped the
    samples under::

        batch = assemble_batch_from_rollout_samples(samples, tokenizer, config)
        await record_step_manifest(tracker.dump, step, [f"rollout/{s.sample_id}" for s in samples])

    Args:
        dump: ``Tracker.dump`` (then await the result) or ``SyncTracker.dump``.
        step: The trainer step.
        dumps: The dump names of the step's samples, in the order they were assembled.
        name: The manifest's name, a template with a ``{step}`` field; ``Run.replay`` looks for
            manifests under the same template (its ``manifest`` argument).

    Returns:
        What *dump* returns (a handle, or an awaitable of one).

    Raises:
        ConfigurationError: A bad step, name or template.
    """
    if "{step}" not in name:
        raise ConfigurationError(f"the manifest name {name!r} needs a {{step}} field")
    return dump(step_manifest(step, dumps), name.replace("{step}", str(step)))


def manifest_dumps(obj: Any, step: int, where: str) -> list[str]:
    """The sample dump names of a loaded manifest of step *step*.

    Raises:
        DumpLoadError: *obj* is not a manifest of this step.
    """
    if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
        raise DumpLoadError(f"{where}: not a trajtrack step manifest ({MANIFEST_FORMAT})")
    names = obj.get("dumps")
    if obj.get("step") != step or not isinstance(names, list):
        raise DumpLoadError(f"{where}: a step manifest that is not step {step}'s")
    if not all(isinstance(n, str) for n in names):
        raise DumpLoadError(f"{where}: a step manifest whose dump names are not all strings")
    return names
