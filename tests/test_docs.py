"""The documentation stays true to what it links and measures: the docs/ pages build as a site in MkDocs' strict
mode (a broken link to a page or a heading, or a page left out of the navigation, fails); the README stays the
newcomer's page (at most 200 lines, the two commands, links that resolve); and every speed figure (a ratio such
as 1.71x) in the README and the docs pages is one docs/BENCHMARKS.md records, the README's next to a link to it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)x\b")


def _pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "BENCHMARKS.md")


def test_the_site_builds_in_strict_mode(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "index.html").is_file() and (tmp_path / "metrics" / "index.html").is_file()
    # the home page is the README, its links rewritten to the site's pages
    assert "What runs where" in (tmp_path / "index.html").read_text()


def test_the_readme_is_a_newcomers_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make run" in text and "make test" in text
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).is_file(), target


def test_every_speed_figure_is_one_the_benchmarks_record():
    bench = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    missing = [f"{page.relative_to(ROOT)}:{n}: {m.group(1)}x" for page in _pages()
               for n, line in enumerate(page.read_text().splitlines(), 1) for m in RATIO.finditer(line)
               if m.group(1) + "x" not in bench]
    assert not missing, missing
    for paragraph in (ROOT / "README.md").read_text().split("\n\n"):
        if RATIO.search(paragraph) and "|" not in paragraph:
            assert "docs/BENCHMARKS.md" in paragraph, paragraph
