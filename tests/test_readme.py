"""The README's quick starts run as written; the README stays a front door and its links hold."""
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
#: the README and the hand-written documentation pages (the generated reports under docs/*/ are not scanned)
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))
#: [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
MAX_README_LINES = 220


def _relative_links(page):
    """(path, anchor) of every link from ``page`` to another file; anchor is '' when there is none."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I) or target.startswith("#"):
            continue  # http:, https:, mailto:, ... and anchors within the page
        path, _, anchor = target.partition("#")
        yield path, anchor


def _anchors(page):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_readme_has_three_quick_starts():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index):
    torch.set_default_dtype(torch.float32)  # as a user's session would be
    torch.manual_seed(0)
    namespace = {"__name__": "__readme__"}
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), namespace)


def test_readme_is_a_front_door():
    n_lines = len(README.read_text().splitlines())
    assert n_lines < MAX_README_LINES, (
        f"README.md has {n_lines} lines, expected fewer than {MAX_README_LINES}: "
        "move protocols, histories and full tables to a page under docs/"
    )


def test_link_pattern_finds_links_and_images():
    text = "see [a](docs/a.md#x), ![fig](uci/ll.png) and [web](https://x.org)"
    assert LINK.findall(text) == ["docs/a.md#x", "uci/ll.png", "https://x.org"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(page):
    broken = []
    for path, anchor in _relative_links(page):
        target = page.parent / path
        if not target.exists():
            broken.append(path)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{path}#{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files or headings {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_works_are_cited_by_name_not_seed_number(page):
    hits = [line for line in page.read_text().splitlines() if "seed 00" in line.lower()]
    assert not hits, f"{page.relative_to(ROOT)} cites a seed number; cite the work (see docs/index.md): {hits[:3]}"
