"""report.html (posbench/reports/html.py): one self-contained page of a report, written by a real
`posbench report` over two toy runs, read back with the stdlib's HTML parser and, where Chromium
is installed, rendered by it headless."""
import base64
import html.parser
import re
import shutil
import subprocess

import pytest

from helpers import posbench_cli
from posbench.reports.report import write_report
from test_report import run_record, write

# the page embeds the figures, and the browser test compares one with its screenshot
pytestmark = pytest.mark.figures

# retrieval, RULER and LongPPL on, so that the report has their tables and figures
# (tests/test_retrieval.py, test_ruler.py, test_longppl.py; alpha 0: a toy model has key tokens)
EVALUATIONS = ["train.seq_len=64", "eval.lengths=[64,128]", "eval.retrieval.enabled=true",
             "eval.retrieval.trials=2", "eval.retrieval.key_tokens=4",
             "eval.retrieval.depths=[0,0.5,1]", "eval.ruler.enabled=true",
             "eval.ruler.tasks=[niah_single_1]", "eval.ruler.depths=[0]", "eval.ruler.trials=2",
             "eval.longppl.enabled=true", "eval.longppl.alpha=0", "eval.longppl.beta=100"]
FIGURES = ("ppl_vs_length.png", "position_frequency.png", "retrieval_grid.png",
           "ruler_by_group.png", "longppl_by_group.png")
PNG = b"\x89PNG\r\n\x1a\n"


class Page(html.parser.HTMLParser):
    """The parts of a page the tests check: images, links, tags, and each table's rows as the
    text of their cells."""

    def __init__(self, text):
        super().__init__()
        self.images, self.links, self.tags, self.tables = [], [], set(), []
        self._cell = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        if tag == "img":
            self.images.append(attrs)
        elif tag == "a":
            self.links.append(attrs["href"])
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def markdown_tables(text):
    """summary.md's tables: each a list of rows of cells, its rule rows left out."""
    tables, table = [], None
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                table = table if table is not None else []
                table.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif table is not None:
            tables.append(table)
            table = None
    return tables


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, toy):
    """Two toy runs (rope, alibi) scored on retrieval, RULER and LongPPL, then `posbench report`
    over them."""
    tmp = tmp_path_factory.mktemp("report_html")
    posbench_cli("train", "-m", *toy, *EVALUATIONS, "encoding=rope,alibi", "hydra.sweep.dir=sweep",
                 cwd=tmp, in_process=True)
    sweep = tmp / "sweep"
    (sweep / "report.html").unlink()  # the multirun's own report wrote one: now the command's
    proc = posbench_cli("report", "sweep", cwd=tmp, in_process=True)
    assert "report.html" in proc.stdout
    return sweep


def test_the_page_is_self_contained_with_the_reports_tables_and_links(sweep):
    text = (sweep / "report.html").read_text()
    page = Page(text)
    # every figure the report wrote, embedded as a PNG data: URI
    assert len(page.images) == len(FIGURES)
    for image, name in zip(page.images, FIGURES):
        assert image["alt"] == name
        prefix = "data:image/png;base64,"
        assert image["src"].startswith(prefix)
        data = base64.b64decode(image["src"][len(prefix):], validate=True)
        assert data.startswith(PNG) and data == (sweep / name).read_bytes()
    # nothing from the network: no address anywhere, no script, stylesheet link, frame or font
    assert not re.search(r"https?://", text, re.IGNORECASE)
    assert not page.tags & {"script", "link", "iframe", "object", "embed"}
    assert "@import" not in text and "url(" not in text
    # summary.md's tables, the same cells in the same order
    summary = (sweep / "summary.md").read_text()
    assert page.tables[:-1] == markdown_tables(summary)
    ppl = page.tables[0]
    assert ppl[0][-1] == "gap at train length" and ppl[0][1:3] == ["64", "128"]
    assert sorted(row[0] for row in ppl[1:]) == ["alibi", "rope"]
    assert all(re.fullmatch(r"[+-]\d+\.\d%", row[-1]) for row in ppl[1:])
    assert any(t[0][:2] == ["encoding", "by ppl"] for t in page.tables)  # effective lengths
    assert any(t[0][0] == "encoding" and t[0][1:] == ["64", "128"] for t in page.tables)  # bits saved
    assert any(t[0] == ["group", "64 (L)", "128"] for t in page.tables)  # RULER, LongPPL by group
    # a link to each run's results.json, relative to the page
    runs = page.tables[-1]
    assert runs[0] == ["group", "seed", "status", "results"]
    assert sorted(row[0] for row in runs[1:]) == ["alibi", "rope"]
    results = {p.relative_to(sweep).as_posix() for p in sweep.rglob("results.json")}
    linked = [href for href in page.links if href.endswith("results.json")]
    assert len(results) == 2 and set(linked) == results
    for href in page.links:
        assert not href.startswith("/") and ":" not in href and (sweep / href).is_file(), href
    assert not list(sweep.glob(".report.html.*"))  # no temporary file left


def test_every_text_is_escaped_and_a_rerun_touches_only_the_page(tmp_path):
    # a label and an error with markup in them, read from results.json files (no training)
    markup = {"name": "<img src=x onerror=alert(1)>&amp;"}
    write(tmp_path, "a", run_record("rope", 0, {32: 4.0, 64: 5.0}, dataset=markup))
    write(tmp_path, "b", run_record("rope", 0, {32: 6.0, 64: 9.0}, dataset={"name": "plain"}))
    write(tmp_path, "c", {"encoding": "t5", "status": "failed", "error": "<script>x</script>"})
    write_report(tmp_path)
    page = Page((tmp_path / "report.html").read_text())
    assert not page.images[1:] and not page.tags & {"script"}
    labels = [row[0] for row in page.tables[0][1:]]
    assert "rope [name=<img src=x oner…]" in labels  # the parser's text: the label as written
    assert "c/results.json" in page.links
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.name != "report.html"}
    (tmp_path / "report.html").write_text("old")
    write_report(tmp_path)
    assert (tmp_path / "report.html").read_text().startswith("<!DOCTYPE html>")
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.name != "report.html"}
    written = {"summary.md", "summary.csv", "ppl_vs_length.png",  # the report's own files
               "position_frequency.png", "position_frequency.csv"}
    assert {p for p in after if after[p] != before.get(p)} <= {tmp_path / n for n in written}


def chromium():
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)


@pytest.mark.skipif(chromium() is None, reason="Chromium is not installed (Debian: apt-get "
                                                 "install chromium); the page is checked without "
                                                 "a browser by the test above")
def test_chromium_renders_the_page_and_its_figures_without_script(sweep, tmp_path):
    from PIL import Image, ImageChops, ImageStat

    page = sweep / "report.html"
    browser = [chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
               "--window-size=1200,2000", "--force-device-scale-factor=1",
               f"--user-data-dir={tmp_path / 'profile'}"]
    # the page with a probe script ahead of its policy: each image's natural size once the
    # browser has decoded it, and where its content box lies, written into the DOM
    probe = ('<script>addEventListener("load", () => { document.body.dataset.images = '
             '[...document.images].map(i => { const r = i.getBoundingClientRect(); return '
             '[i.naturalWidth, i.naturalHeight, r.left + i.clientLeft, r.top + i.clientTop, '
             'i.clientWidth, i.clientHeight]'
             '.map(Math.round).join(",") }).join(" ") })</script>')
    probed = tmp_path / "probe.html"  # the page needs nothing beside it
    probed.write_text(page.read_text().replace("<head>", "<head>\n" + probe, 1))
    dom = subprocess.run([*browser, "--dump-dom", probed.as_uri()], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    found = re.search(r'<body data-images="([^"]*)"', dom)
    assert found, dom[:2000]
    images = [tuple(map(int, s.split(","))) for s in found.group(1).split()]
    assert len(images) == len(FIGURES) and all(w > 100 and h > 100 for w, h, *_ in images), images
    assert "gap at train length" in dom and "alibi" in dom

    # the page as it is, no script: a screenshot that shows the first figure where it lies
    shot = tmp_path / "shot.png"
    subprocess.run([*browser, f"--screenshot={shot}", page.as_uri()], check=True,
                   capture_output=True, timeout=120)
    screen = Image.open(shot).convert("L")
    assert screen.size == (1200, 2000)
    assert len(screen.getcolors(maxcolors=1 << 16)) > 1, "a blank screenshot"
    _, _, left, top, width, height = images[0]
    assert top + height <= 2000
    # both shrunk 8 times: a sub-pixel offset or the browser's resampling does not count
    small = (width // 8, height // 8)
    shrink = lambda image: image.resize(small, Image.Resampling.BOX)
    shown = shrink(screen.crop((left, top, left + width, top + height)))
    figure = shrink(Image.open(sweep / "ppl_vs_length.png").convert("L"))
    differs = lambda a, b: ImageStat.Stat(ImageChops.difference(a, b)).mean[0]
    blank = differs(Image.new("L", small, 255), figure)  # what an empty box would give
    difference = differs(shown, figure)
    assert difference < blank / 4, (f"the screenshot's figure differs from ppl_vs_length.png by "
                                     f"{difference:.2f} (a blank box: {blank:.2f})")
