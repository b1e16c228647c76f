"""The HTML shell the reports share: one page, its CSS, escaping, an atomic write.

A page is self-contained: the CSS is inline, there is no script, and its
Content-Security-Policy forbids loading anything at all (``default-src 'none'``), so a report
opens anywhere after a copy and cannot call out even if some text escaped the escaping.
"""

from __future__ import annotations

import html
import os
import string
from pathlib import Path

from trajtrack._exceptions import StorageNotFoundError

__all__ = ["CSS", "escape", "number", "page", "write_atomically"]

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;
margin:0 auto;max-width:1180px;padding:16px 24px}
h1{font-size:22px;margin:4px 0}h2{font-size:17px;margin:24px 0 8px}
code,td.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:3px 8px;
border-bottom:1px solid #e3e3e3;vertical-align:top}th{background:#f4f4f4}
td.num{text-align:right;white-space:nowrap}
.verdict{display:inline-block;padding:2px 10px;border-radius:10px;font-weight:600}
.s-equal{color:#1e8449}.s-different{color:#c0392b}.s-only_in_a{color:#2471a3}
.s-only_in_b{color:#7d3c98}.s-error{color:#000;font-weight:700}
.verdict.ok{background:#d5f5e3;color:#1e8449}.verdict.bad{background:#fadbd8;color:#922b21}
.counts{display:flex;gap:10px;flex-wrap:wrap}.count{border:1px solid #ddd;border-radius:6px;
padding:6px 14px;font-size:15px}.count b{font-size:20px;margin-right:4px}
dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0}
dt{color:#666}dd{margin:0;word-break:break-all}
svg.plot{width:100%;height:auto;display:block}
ul.legend{list-style:none;display:flex;flex-wrap:wrap;gap:4px 18px;padding:0;margin:4px 0 0 60px;
font-size:13px}.mark{font-weight:700}svg.histogram{max-width:780px}
.note{color:#666;font-size:13px}footer{margin-top:32px;color:#888;font-size:12px}
"""

_PAGE = string.Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>$title</title>
<style>$css</style>
</head>
<body>
<header><h1>$heading</h1>$badge</header>
$body
<footer>$footer</footer>
</body>
</html>
""")


def page(*, title: str, heading: str, badge: str, body: str, footer: str) -> str:
    """The page; *title* and *heading* are text (escaped here), the rest HTML already."""
    return _PAGE.substitute(
        title=escape(title),
        css=CSS,
        heading=escape(heading),
        badge=badge,
        body=body,
        footer=footer,
    )


def escape(text: str) -> str:
    """*text* as HTML text or attribute value (quotes escaped too)."""
    return html.escape(text, quote=True)


def number(value: float | None) -> str:
    """A difference or statistic, 4 significant digits; empty for ``None``."""
    return "" if value is None else escape(f"{value:.4g}")


def write_atomically(path: Path, text: str) -> None:
    """Write *text* (UTF-8) to a temporary file beside *path*, then rename it over *path*."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        try:
            temporary.write_text(text, encoding="utf-8")
        except FileNotFoundError:  # the folder: name what was asked for, not the temp file
            raise StorageNotFoundError(
                f"cannot write {path}: no such directory {path.parent}"
            ) from None
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
