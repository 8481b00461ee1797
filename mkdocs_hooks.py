"""MkDocs hooks (mkdocs.yml): the site's home page is the repository's README.md, its links to docs/ pages made
relative to the site, so the two never differ."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

README = Path(__file__).resolve().parent / "README.md"


def on_files(files, config):
    text = README.read_text().replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=text))
    return files
