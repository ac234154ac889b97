"""Every relative link of the repository's Markdown pages resolves: the file or folder exists and,
where the link names a section of a Markdown page, that page has a heading with that anchor."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, List, Tuple

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def pages(root: Path) -> List[Path]:
    """The Markdown files of the tree, hidden folders (.git, caches) left out."""
    return sorted(p for p in root.rglob("*.md")
                  if not any(part.startswith(".") for part in p.relative_to(root).parts))


def prose_lines(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield number, line


def anchors(text: str) -> set:
    """The anchors GitHub gives the page's headings: lower case, punctuation other than `-` and
    `_` left out, spaces as `-`; a repeated heading's anchor numbered from -1."""
    found, seen = set(), {}
    for _, line in prose_lines(text):
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(root: Path) -> List[str]:
    broken = []
    for page in pages(root):
        text = page.read_text()
        for number, line in prose_lines(text):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                linked = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(root)}:{number}: {target}"
                if not linked.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
                    broken.append(f"{where} (no such section)")
    return broken


def test_every_relative_link_of_the_markdown_pages_resolves():
    broken = broken_links(REPO)
    assert not broken, "\n".join(broken)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run.json").write_text("{}")
    (tmp_path / "README.md").write_text(
        "# Top\n\n## Speed (`bench`, 8K)\n\n"
        "[ok](results/run.json) [ok](#speed-bench-8k) [ok](results/) [web](https://x.org/a.md)\n"
        "`[code](missing.md)`\n```\n[fenced](missing.md)\n```\n"
        "[gone](results/other.json) [no section](#speed) ![plot](plot.png)\n")
    (tmp_path / "results" / "README.md").write_text("[up](../README.md#top) [up](../README.md#nope)\n")
    assert broken_links(tmp_path) == [
        "README.md:10: results/other.json (no such file)",
        "README.md:10: #speed (no such section)",
        "README.md:10: plot.png (no such file)",
        "results/README.md:1: ../README.md#nope (no such section)",
    ]
