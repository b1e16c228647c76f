"""The argument parsers of the commands whose modules import torch: ``show``, ``diff``, ``demo``.

They live apart from the commands so that ``trajtrack show --help`` and a usage error answer
without importing torch (seconds); the command's module is imported when it runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from trajtrack._exceptions import ConfigurationError
from trajtrack.cli._common import (
    SUMMARIES,
    Streams,
    add_output_options,
    non_negative_float,
    positive_int,
)

__all__ = [
    "DEMO_MARKER",
    "MAX_ITEMS",
    "DemoConfig",
    "add_demo",
    "add_diff",
    "add_html_options",
    "add_show",
    "add_text_options",
]

MAX_ITEMS = 20  # children shown per container by ``show``

DEMO_MARKER = ".trajtrack/demo-run"
"""The file that marks a run as the demo's own: only such runs are replaced by a rerun."""


@dataclass(frozen=True)
class DemoConfig:
    """Shape of a simulated run."""

    steps: int = 4
    prompts: int = 8
    n: int = 2
    seed: int = 1234
    perturb_step: int = 2
    perturb_prompt: int = 3
    perturbation: float = 1e-3
    layout: Literal["files", "shards"] = "shards"  # a sample per dump: many small dumps


_DEFAULTS = DemoConfig()


def _lazy(name: str) -> Callable[[argparse.Namespace, Streams], Awaitable[int]]:
    """The handler of command *name*: its module is imported when it runs, not before."""

    async def handler(args: argparse.Namespace, streams: Streams) -> int:
        run: Callable[[argparse.Namespace, Streams], Awaitable[int]] = importlib.import_module(
            f"trajtrack.cli.{name}"
        ).run
        return await run(args, streams)

    return handler


def add_show(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "show",
        help=SUMMARIES["show"],
        description=(
            "Load one dump (safely: torch.load(weights_only=True) with trajtrack's allow-list) "
            "and print its nested structure: keys, tensor shapes, dtypes, devices, "
            "min/max/mean and NaN/inf counts, non-tensor values abbreviated. "
            "Exit 0, or 2 when the dump cannot be read or is refused."
        ),
    )
    parser.add_argument("url", metavar="URL", help="the run: a local path or a storage URL")
    parser.add_argument("name", metavar="NAME", help="the dump name (or its path in the run)")
    parser.add_argument(
        "--unsafe",
        action="store_true",
        help="allow a full unpickle: RUNS CODE from the dump; only for dumps you trust",
    )
    parser.add_argument(
        "--max-items",
        type=int,
        default=MAX_ITEMS,
        metavar="N",
        help="children shown per container (default: %(default)s)",
    )
    add_html_options(
        parser,
        "also write a self-contained HTML page with a histogram of each tensor's values; "
        "needs pip install 'trajtrack[report]'",
    )
    add_text_options(parser, rows=True)
    add_output_options(parser)
    parser.set_defaults(handler=_lazy("show"))


def add_diff(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "diff",
        help=SUMMARIES["diff"],
        description=(
            "Pair the dumps of two runs by name and compare them structurally: missing and "
            "extra dumps and keys, type/length/shape/dtype mismatches, and for numbers the "
            "max absolute and relative difference and the index of the first element outside "
            "tolerance. Dumps are listed in dump order (run A's commit order, each dump only "
            "run B has after the dump before it in run B), so the first divergence is at the "
            "top. "
            "An element is equal when |a - b| <= atol + rtol * |b| (b from URL_B); the "
            "default is exact equality. NaN equals NaN at the same position unless "
            "--nan-unequal. Each file is read once, in parallel. Loading is safe "
            "(weights_only) unless --unsafe."
        ),
        epilog="exit codes: 0 equal within tolerance, 1 the runs differ (values, keys, "
        "or dumps present in only one run), 2 usage or I/O error, or a dump that cannot be "
        "compared (refused as unsafe, corrupt): such a dump is an error, listed apart, never "
        "the first divergence. Containers of other types holding the same data (a DataProto "
        "and a RolloutBatch) are equal, with a note.",
    )
    parser.add_argument("url_a", metavar="URL_A", help="run A")
    parser.add_argument("url_b", metavar="URL_B", help="run B (the reference for rtol)")
    parser.add_argument("--names", metavar="GLOB", help="only dumps whose name matches")
    parser.add_argument(
        "--rtol", type=non_negative_float, default=0.0, metavar="R", help="relative tolerance"
    )
    parser.add_argument(
        "--atol", type=non_negative_float, default=0.0, metavar="A", help="absolute tolerance"
    )
    parser.add_argument(
        "--nan-unequal", action="store_true", help="count NaN == NaN as a difference"
    )
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave out key paths matching this glob, as diff prints them ('*timing_s*', "
        '".rollout_status[*]"): * any characters, ? one, brackets literal; repeatable',
    )
    parser.add_argument(
        "--ignore-volatile",
        action="store_true",
        help="also leave out verl's volatile bookkeeping (timings, processing times, "
        "rollout-status counters: trajtrack.reader.VOLATILE_KEYS)",
    )
    parser.add_argument(
        "--unsafe",
        action="store_true",
        help="allow a full unpickle: RUNS CODE from the dumps; only for runs you trust",
    )
    parser.add_argument(
        "--max-dumps",
        type=positive_int,
        default=20,
        metavar="N",
        help="differing dumps printed in full (default: %(default)s)",
    )
    parser.add_argument(
        "--max-differences",
        type=positive_int,
        default=5,
        metavar="N",
        help="differences printed per dump (default: %(default)s)",
    )
    add_html_options(
        parser,
        "also write a self-contained HTML report (summary, a plot of the differences "
        "dump by dump, the differing dumps, a histogram of the first divergent tensor); "
        "needs pip install 'trajtrack[report]'",
    )
    add_text_options(parser, rows=False)
    add_output_options(parser, progress=True)
    parser.set_defaults(handler=_lazy("diff"))


def add_demo(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "demo",
        help=SUMMARIES["demo"],
        description=(
            "Run two short simulated async-rollouter runs into DIR/run_a and DIR/run_b "
            "(identical seeds; run B perturbs one element of one tensor in one step), print "
            "what was written and the tracker statistics, then `ls` and a `diff` that "
            "pinpoints the perturbed step, with its HTML report in DIR/diff-report.html "
            "(for a remote DIR: ./trajtrack-demo-diff-report.html; needs "
            "pip install 'trajtrack[report]'). DIR may be any storage URL (e.g. webhdfs://...). "
            "Exit 0 when the diff found exactly the perturbation. "
            "It writes DIR/run_a, DIR/run_b (each marked as the demo's by "
            f"{DEMO_MARKER}) and the report. A rerun replaces runs that carry the mark and "
            "nothing else: a run_a or run_b folder holding anything the demo did not write "
            "(your own run, say) is refused with exit 2 and left as it is."
        ),
    )
    parser.add_argument(
        "dest",
        nargs="?",
        default="trajtrack-demo",
        metavar="DIR",
        help="where to write (default: ./trajtrack-demo)",
    )
    parser.add_argument("--steps", type=int, default=_DEFAULTS.steps, help="training steps")
    parser.add_argument(
        "--prompts", type=int, default=_DEFAULTS.prompts, help="concurrent prompts per step"
    )
    parser.add_argument("--n", type=int, default=_DEFAULTS.n, help="responses per prompt")
    parser.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="the shared seed")
    parser.add_argument(
        "--layout",
        choices=("shards", "files"),
        default=_DEFAULTS.layout,
        help="storage layout: dumps packed into tar shards (default, right for per-sample "
        "dumps) or one .pth file per dump",
    )
    parser.set_defaults(handler=_lazy("demo"))


def add_html_options(parser: argparse.ArgumentParser, html_help: str) -> None:
    """``--html FILE`` and ``--overwrite`` (for ``show`` and ``diff``)."""
    parser.add_argument("--html", metavar="FILE", help=html_help)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="with --html: replace FILE even if it is not a report trajtrack wrote (a "
        "symbolic link is replaced as a link, its target left as it is; a directory is "
        "still refused)",
    )
    parser.set_defaults(check=functools.partial(_overwrite_needs_html, parser))


def _overwrite_needs_html(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error (exit 2) for ``--overwrite`` without ``--html``: it would replace nothing."""
    if args.overwrite and not args.html:
        parser.error("--overwrite applies only to --html FILE: give --html FILE too, or drop it")


def add_text_options(parser: argparse.ArgumentParser, *, rows: bool) -> None:
    """``--tokenizer`` and ``--text-keys`` (and ``--rows`` for ``show``)."""
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="decode token ids (input_ids, prompts, responses) with this tokenizer.json or "
        "model directory; needs pip install 'trajtrack[text]'; nothing is downloaded",
    )
    parser.add_argument(
        "--text-keys",
        type=_keys,
        default=(),
        metavar="K,...",
        help="more keys of token-id tensors to decode (with --tokenizer)",
    )
    if rows:
        parser.add_argument(
            "--rows",
            type=_rows,
            metavar="SPEC",
            help="rows to show as text, e.g. '0-3,7' (default: the first 8 of each batch)",
        )


def _keys(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


def _rows(text: str) -> list[int]:
    from trajtrack.reader import parse_rows  # the reader imports torch: only when given

    try:
        return parse_rows(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
