"""The diff report's token-text section: both runs' texts side by side, the first difference
highlighted (``trajtrack diff --tokenizer PATH --html FILE``).

Everything from the dumps (names, paths, uids, text) is escaped; the highlight is a ``<mark>``.
"""

from __future__ import annotations

from collections.abc import Sequence

from trajtrack.reader._html import escape
from trajtrack.reader._text import TokenDifference

__all__ = ["render_text_section"]

_STYLE = (
    "<style>table.text td{width:50%;font-family:ui-monospace,Menlo,Consolas,monospace;"
    "font-size:12px;white-space:pre-wrap;word-break:break-word}"
    "table.text mark{background:#f9e79f;font-weight:700;outline:1px solid #b7950b}</style>"
)


def render_text_section(found: Sequence[tuple[str, Sequence[TokenDifference]]]) -> str:
    """The section body: per dump and differing row, a two-column table (A | B)."""
    parts = [_STYLE]
    for name, differences in found:
        for d in differences:
            uid = f" (uid {escape(d.uid)})" if d.uid is not None else ""
            parts.append(
                f'<h3 class="text-row"><code>{escape(name)}</code> <code>{escape(d.path)}</code> '
                f"row {d.row}{uid}: first differing token #{d.position}, "
                f"{d.rows_differing} rows differ</h3>"
                '<table class="text"><tr><th>A</th><th>B</th></tr><tr>'
                + "".join(_side(d, side) for side in (0, 1))
                + "</tr></table>"
            )
    return "".join(parts)


def _side(d: TokenDifference, side: int) -> str:
    before, token, after = d.contexts[side]
    token_id = d.tokens[side]
    title = "end of the row" if token_id is None else f"token {token_id}"
    return (
        f'<td class="side-{"ab"[side]}">{escape(before)}'
        f'<mark title="{escape(title)}">{escape(token) or "&#8709;"}</mark>{escape(after)}</td>'
    )
