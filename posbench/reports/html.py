"""report.html: the report as one self-contained page (docs/design.md, "The report").

The page renders summary.md's own lines (its tables, the parity column and the retrieval tables
included), so it cannot show other numbers than summary.md; embeds each plot the report wrote as a
base64 data: URI; and links each run's results file by a path relative to the page. Inline CSS,
no script, no font or anything else from the network (a Content-Security-Policy says so to the
browser), so it opens from disk and can be sent on its own; the links work beside the runs.
"""
from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import Dict, List
from urllib.parse import quote

from posbench.core.io import write_text
from posbench.core.version import __version__

PAGE = "report.html"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# nothing from the network: images only from data: URIs, styles only inline, no script
POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d1d1f;
       background: #fff; margin: 0; }
main { max-width: 1200px; margin: 0 auto; padding: 1.5em 2em 3em; }
h1 { font-size: 1.6em; margin: 0 0 .2em; }
h2 { font-size: 1.25em; margin: 1.6em 0 .5em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
.meta { color: #666; margin-top: 0; }
figure { margin: 1em 0 2em; }
figure img { max-width: 100%; height: auto; display: block; border: 1px solid #eee; }
figcaption { color: #666; font-size: .9em; margin-top: .3em; }
.table { overflow-x: auto; margin: .8em 0; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d8d8d8; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
tr:nth-child(even) td { background: #fafafa; }
.num, td[style*="right"], th[style*="right"] { white-space: nowrap; }
.num { text-align: right; }
code { font: .92em ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; background: #f3f3f3;
       padding: 0 .2em; border-radius: 3px; }
a { color: #0b57d0; }
"""
CAPTIONS = {"ppl_vs_length.png": "Perplexity by evaluation length",
            "accuracy_vs_length.png": "Exact-match accuracy by evaluation length",
            "retrieval_grid.png": "Passkey retrieval: bits saved per key token, depth by length "
                                  "(each group's first seed)",
            "eval_vs_step.png": "Perplexity at the training length against fine-tuning steps",
            "ruler_by_group.png": "RULER: exact match by length per task and on average, a line "
                                  "per group (mean over seeds)",
            "longppl_by_group.png": "Perplexity and LongPPL (key tokens only) by length, a line "
                                    "per group (mean over seeds)"}


def markdown_html(lines: List[str]) -> str:
    """summary.md's lines as HTML, as CommonMark with tables renders them (markdown-it-py, raw
    HTML off: a label with markup in it is shown, never run), each table in a scrolling box."""
    from markdown_it import MarkdownIt

    rendered = MarkdownIt("commonmark", {"html": False}).enable("table").render("\n".join(lines))
    return rendered.replace("<table>", '<div class="table"><table>').replace(
        "</table>", "</table></div>")


def png_data_uri(path: Path) -> str:
    data = path.read_bytes()
    if not data.startswith(PNG_MAGIC):
        raise ValueError(f"{path} is not a PNG")
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _href(root: Path, target: str) -> str:
    """A link from the page in `root` to `target`, relative, percent-encoded and escaped."""
    rel = Path(os.path.relpath(target, root)).as_posix()
    return html.escape(quote(rel), quote=True)


def _runs_table(root: Path, groups: Dict[str, List[dict]], records: List[dict]) -> str:
    """One row per record the report read: its group, seed, status and a link to its file."""
    label_of = {(r["_dir"], r.get("_file")): label for label, members in groups.items()
                for r in members}
    rows = []
    for r in records:
        label = label_of.get((r["_dir"], r.get("_file")))
        if label is None:
            label = "— (a repeat, counted once)" if r.get("status") == "ok" else "—"
        file = r.get("_file") or ("refused.json" if r.get("status") == "refused" else "")
        target = os.path.join(r["_dir"], file) if file else r["_dir"] + os.sep
        shown = Path(os.path.relpath(target, root)).as_posix() + ("/" if not file else "")
        seed = r.get("seed", r.get("config", {}).get("seed", "—"))
        rows.append(f"<tr><td>{html.escape(label)}</td><td class=\"num\">{html.escape(str(seed))}"
                    f"</td><td>{html.escape(str(r.get('status', '?')))}</td><td><a href=\""
                    f"{_href(root, target)}\">{html.escape(shown)}</a></td></tr>")
    return ('<div class="table"><table><thead><tr><th>group</th><th class="num">seed</th>'
            "<th>status</th><th>results</th></tr></thead><tbody>\n" + "\n".join(rows)
            + "\n</tbody></table></div>")


def write_html(root: Path, lines: List[str], plots: List[str], groups: Dict[str, List[dict]],
               records: List[dict]) -> Path:
    """`root`/report.html from summary.md's `lines`, the `plots` written in `root`, the
    report's `groups` (label -> records) and every record it read (`records`: finished, failed
    and the rest). Written atomically; no other file is touched."""
    root = Path(root)
    title, body = (lines[0].lstrip("#").strip(), lines[1:]) if lines[0].startswith("#") else (
        "posbench report", lines)
    figures = [f'<figure><img src="{png_data_uri(root / name)}" alt="{html.escape(name)}">'
               f"<figcaption>{html.escape(CAPTIONS.get(name, name))} ({html.escape(name)})"
               "</figcaption></figure>" for name in plots]
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{html.escape(POLICY)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{STYLE}</style>
</head>
<body>
<main>
<h1>{html.escape(title)}</h1>
<p class="meta">{html.escape(root.resolve().name)} · posbench {html.escape(__version__)} ·
the same tables as <a href="summary.md">summary.md</a> and <a href="summary.csv">summary.csv</a></p>
<h2>Figures</h2>
{chr(10).join(figures)}
<h2>Tables</h2>
{markdown_html(body)}
<h2>Runs</h2>
<p>Each record the report read, linked by its path relative to this page.</p>
{_runs_table(root, groups, records)}
</main>
</body>
</html>
"""
    write_text(root / PAGE, page)
    return root / PAGE
