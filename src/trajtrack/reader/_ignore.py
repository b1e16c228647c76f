"""Key paths a comparison leaves out: ``diff --ignore PATTERN`` and ``compare(ignore=...)``.

A pattern is matched against the whole key path as ``diff`` prints it
(``.meta_info['timing_s/gen']``, ``.rollout_status['count/total_generated_samples']``,
``['x'][3]``): ``*`` matches any run of
characters (dots and brackets included), ``?`` one character, and every other character,
brackets too, only itself -- the paths are full of brackets, so ``[...]`` is not a character
class here (``".rollout_status[*]"`` means every key of ``.rollout_status``). An ignored path is
neither compared nor counted, and neither is anything below it.

:data:`VOLATILE` is a preset for verl's bookkeeping that differs between two runs of the same
training (``diff --ignore-volatile``), never applied unless asked for.
"""

from __future__ import annotations

import functools
import re

from trajtrack._exceptions import ConfigurationError

__all__ = ["VOLATILE", "compile_ignore"]

VOLATILE: tuple[str, ...] = (
    "*timing_s*",  # verl's step timings (meta_info, metrics)
    "*timing_per_token_ms*",
    "*timing_raw*",
    "*processing_time*",  # per-trajectory generation times and their statistics
    "*tool_calls_times*",  # per-trajectory tool-call times (non_tensor_batch)
    "*.tool_calls",  # trajtrack's RolloutSample: tool-call times
    "*rollout_status*",  # the rollouter's counters when the sample finished: completion order
    "*fully_async/*",  # those counters and wait times, copied into the trainer's meta_info
)
"""The patterns of ``--ignore-volatile``: timings, processing times and rollout-status counters
(which depend on wall time and on the order in which samples completed, not on the data)."""


@functools.lru_cache(maxsize=64)
def compile_ignore(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    """One regular expression matching a key path that any of *patterns* matches whole, or
    ``None`` for no patterns (cached: a diff compiles its patterns once, not per pair).

    Raises:
        ConfigurationError: A pattern is empty.
    """
    if any(not p for p in patterns):
        raise ConfigurationError("an ignore pattern must not be empty")
    parts = [_translate(p) for p in patterns]
    if not parts:
        return None
    return re.compile("|".join(f"(?:{p})" for p in parts), re.DOTALL)


def _translate(pattern: str) -> str:
    out = []
    for char in pattern:
        if char == "*":
            out.append(".*")
        elif char == "?":
            out.append(".")
        else:
            out.append(re.escape(char))
    return "".join(out)
