"""Which aggregation applies to which metric name — as data users can extend.

Lookup order: exact names, then name patterns in order (first match wins), then the
default. verl matched patterns as substrings of the lower-cased name, so ``"timing"``
contained ``"min"`` (``timing_per_token_ms/*`` was aggregated with ``min``), ``admin/*`` too,
and ``"weighted_avg"`` could never be reached because ``"avg"`` was tested first. Here a
pattern matches whole *words* — parts of the name delimited by ``/``, ``_`` or its ends —
and ``weighted_avg`` is tested before ``avg``.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType

__all__ = ["DEFAULT_RULES", "Aggregation", "AggregationRules", "NamePattern"]


# (str, Enum) rather than StrEnum: the package supports Python 3.10.
class Aggregation(str, enum.Enum):
    """How the values one metric took over several steps become one value.

    Members compare equal to their string values (``Aggregation.MAX == "max"``).
    """

    TIME_SUM = "time_sum"
    """Sum (used for durations, ``timing_s/*``)."""
    SUM = "sum"
    """Sum."""
    AVG = "avg"
    """Arithmetic mean over the steps where the metric appeared."""
    WEIGHTED_AVG = "weighted_avg"
    """Mean weighted by each step's ``sample_count`` (plain mean if the weights sum to 0)."""
    MAX = "max"
    """Largest value."""
    MIN = "min"
    """Smallest value."""
    LAST = "last"
    """Value from the latest step that reported the metric (counters)."""

    def __str__(self) -> str:
        return self.value


NamePattern = str | re.Pattern[str]
"""A name pattern.

A string ending in ``/`` matches names starting with it (``"timing_s/"``). Any other
string matches when it occurs as whole words: ``"min"`` matches ``prompt_length/min`` and
``min_len/x`` but not ``admin/x`` or ``timing_per_token_ms/x``; ``"weighted_avg"`` matches
``reward/weighted_avg``. String patterns ignore case. A compiled regular expression matches
when ``pattern.search(name)`` does.
"""

_Rule = tuple[re.Pattern[str], Aggregation]


def _compile(pattern: NamePattern) -> re.Pattern[str]:
    if isinstance(pattern, re.Pattern):
        return pattern
    if not pattern:
        raise ValueError("a name pattern must not be empty")
    if pattern.endswith("/"):
        return re.compile("^" + re.escape(pattern), re.IGNORECASE)
    return re.compile(r"(?:^|[/_])" + re.escape(pattern) + r"(?:$|[/_])", re.IGNORECASE)


def _freeze_exact(exact: Mapping[str, Aggregation | str]) -> Mapping[str, Aggregation]:
    return MappingProxyType({name: Aggregation(agg) for name, agg in exact.items()})


@dataclasses.dataclass(frozen=True, init=False)
class AggregationRules:
    """Exact-name rules, ordered name patterns and a default aggregation.

    Instances are immutable; :meth:`extended` returns a copy with more rules.

    Args:
        exact: Metric name → aggregation. Checked first.
        patterns: ``(pattern, aggregation)`` pairs, checked in order; see
            :data:`NamePattern`.
        default: Used when nothing matches.

    Raises:
        ValueError: An aggregation name is unknown or a pattern is empty.
    """

    exact: Mapping[str, Aggregation]
    patterns: tuple[tuple[NamePattern, Aggregation], ...]
    default: Aggregation
    _compiled: tuple[_Rule, ...] = dataclasses.field(repr=False, compare=False)

    def __init__(
        self,
        exact: Mapping[str, Aggregation | str] | None = None,
        patterns: Iterable[tuple[NamePattern, Aggregation | str]] = (),
        default: Aggregation | str = Aggregation.AVG,
    ) -> None:
        pairs = tuple((pattern, Aggregation(agg)) for pattern, agg in patterns)
        object.__setattr__(self, "exact", _freeze_exact(exact or {}))
        object.__setattr__(self, "patterns", pairs)
        object.__setattr__(self, "default", Aggregation(default))
        object.__setattr__(self, "_compiled", tuple((_compile(p), a) for p, a in pairs))

    def classify(self, name: str) -> Aggregation:
        """Return the aggregation for metric ``name``."""
        found = self.exact.get(name)
        if found is not None:
            return found
        for regex, aggregation in self._compiled:
            if regex.search(name):
                return aggregation
        return self.default

    def extended(
        self,
        exact: Mapping[str, Aggregation | str] | None = None,
        patterns: Iterable[tuple[NamePattern, Aggregation | str]] = (),
        default: Aggregation | str | None = None,
    ) -> AggregationRules:
        """Return a copy with more rules.

        Args:
            exact: Added to (and overriding) the exact-name rules.
            patterns: Checked *before* the existing patterns, so they override them.
            default: Replaces the default, if given.

        Returns:
            The new rules.
        """
        merged_exact: dict[str, Aggregation | str] = {**self.exact, **(exact or {})}
        return AggregationRules(
            merged_exact,
            (*patterns, *self.patterns),
            self.default if default is None else default,
        )


_A = Aggregation

DEFAULT_RULES = AggregationRules(
    exact={
        "perf/time_per_step": _A.TIME_SUM,
        "timing_s/agent_loop/tool_calls/min": _A.MIN,
        "timing_s/agent_loop/tool_calls/mean": _A.AVG,
        "timing_s/agent_loop/tool_calls/max": _A.MAX,
        "fully_async/count/total_generated_samples": _A.LAST,
        "fully_async/count/stale_samples_processed": _A.LAST,
        "fully_async/count/stale_trajectory_processed": _A.LAST,
        "fully_async/count/current_param_version": _A.LAST,
        "fully_async/count/dropped_stale_samples": _A.LAST,
        "training/global_step": _A.LAST,
        "dynamic_resource/mq_size": _A.LAST,
        "dynamic_resource/train_compute_time_s": _A.SUM,
        "dynamic_resource/train_allocated_time_s": _A.SUM,
        # verl reached "max" through the substring "minmax"; keep that result explicitly.
        "global_seqlen/minmax_diff": _A.MAX,
    },
    patterns=(
        ("timing_s/", _A.TIME_SUM),
        ("weighted_avg", _A.WEIGHTED_AVG),
        ("mean", _A.AVG),
        ("avg", _A.AVG),
        ("average", _A.AVG),
        ("max", _A.MAX),
        ("maximum", _A.MAX),
        ("min", _A.MIN),
        ("minimum", _A.MIN),
        ("sum", _A.SUM),
        ("total", _A.SUM),
    ),
    default=_A.AVG,
)
"""verl 0.9.1's rules with word matching and a reachable ``weighted_avg``."""
