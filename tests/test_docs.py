from pathlib import Path

from posbench.encodings.doc_tables import encodings_table, readme_table

ROOT = Path(__file__).resolve().parents[1]
STALE = "is stale: run python scripts/gen_encodings_doc.py"


def test_encodings_page_matches_the_registry():
    assert encodings_table() in (ROOT / "docs" / "encodings.md").read_text(), f"docs/encodings.md {STALE}"


def test_readme_table_matches_the_registry():
    assert readme_table() in (ROOT / "README.md").read_text(), f"README.md {STALE}"
