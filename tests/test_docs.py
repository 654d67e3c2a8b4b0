"""The repository's references resolve inside the repository (no model, no torch: < 1 s).

* every `docs/DESIGN.md §X` cited in specco/, tests/, bench/, configs/ and the docs names a section heading of
  docs/DESIGN.md, and nothing cites the bare `DESIGN §X` of the notes that used to live outside the repository;
* every repository path a source file mentions (`bench/...`, `docs/...`, `specco/...`, `configs/...`,
  `tests/...`) exists; `*`, `<placeholder>` and a trailing `_` stand for "anything" (a family of result files);
* every relative link of README.md, BENCHMARKS.md and the markdown under docs/ and bench/results/ resolves,
  anchors included (GitHub's heading slugs).
"""
from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve()

SOURCE_DIRS = ("specco", "tests", "bench", "configs")
SOURCE_SUFFIXES = {".py", ".toml", ".sh", ".md"}
MARKDOWN = ["README.md", "BENCHMARKS.md", "docs/**/*.md", "bench/results/README.md", "specco/**/*.md"]


def _sources():
    """Text files under the source directories (bench/results' JSON and logs are data, not prose)."""
    for d in SOURCE_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in SOURCE_SUFFIXES and p.resolve() != SELF:
                yield p


def _markdown():
    seen = set()
    for pattern in MARKDOWN:
        for name in sorted(glob.glob(str(ROOT / pattern), recursive=True)):
            if name not in seen:
                seen.add(name)
                yield Path(name)


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------- DESIGN §X

def design_sections() -> set[str]:
    """Section ids of docs/DESIGN.md: '1', '2', '2b', ... from headings like '## 2. Models', '### 2b. Block'."""
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    return set(re.findall(r"^#+\s+(\d+[a-z]?)\.\s", text, flags=re.M))


# "docs/DESIGN.md §2b", "docs/DESIGN.md §2, §3", "docs/DESIGN.md §2 table, §6"
CITE = re.compile(r"docs/DESIGN\.md\s*((?:§\s*\w+(?:\s+\w+)?(?:,\s*)?)+)")


def design_citations(text: str) -> list[str]:
    out = []
    for m in CITE.finditer(text):
        out += re.findall(r"§\s*(\d+[a-z]?)", m.group(1))
    return out


def test_design_sections_parse():
    assert {"1", "2", "2b", "3", "4", "5", "6", "7"} <= design_sections()
    assert design_citations("x (docs/DESIGN.md §2, §3) y docs/DESIGN.md §2b: and docs/DESIGN.md §2 table, §6") == \
        ["2", "3", "2b", "2", "6"]


def test_every_design_citation_names_a_section():
    sections = design_sections()
    bad, bare = [], []
    files = list(_sources()) + [p for p in _markdown()]
    for p in files:
        text = p.read_text(encoding="utf-8")
        for sec in design_citations(text):
            if sec not in sections:
                bad.append(f"{_rel(p)}: docs/DESIGN.md §{sec}")
        for line_no, line in enumerate(text.splitlines(), 1):
            if re.search(r"(?<![\w/.])DESIGN §", line):
                bare.append(f"{_rel(p)}:{line_no}")
    assert not bad, f"cited sections missing from docs/DESIGN.md: {bad}"
    assert not bare, f"cite the notes as 'docs/DESIGN.md §N' (bare 'DESIGN §N' at {bare})"


# ---------------------------------------------------------------------------------------------- paths

PATH = re.compile(r"(?<![\w/.\-])((?:bench|docs|specco|configs|tests)/(?:[\w.*/\-]|<[^<>\n]*>)*(?:[\w*/\-]|<[^<>\n]*>))")


def path_mentions(text: str) -> list[str]:
    return PATH.findall(text)


def path_exists(mention: str) -> bool:
    pattern = re.sub(r"<[^>]*>", "*", mention)
    if pattern.endswith("_"):  # `rounds_long316m_dflash_*` written as `..._`, a family of files
        pattern += "*"
    if "*" in pattern:
        return bool(glob.glob(str(ROOT / pattern)))
    return (ROOT / pattern).exists()


def test_path_mentions_parse():
    text = ("see bench/results/cp_attention_cuda*.json, (bench/rollout.py) and `specco/ops/`; "
            "default bench/results/cotrain_overhead_<device type>.json; not runs/demo or x/specco/y")
    assert path_mentions(text) == ["bench/results/cp_attention_cuda*.json", "bench/rollout.py", "specco/ops/",
                                   "bench/results/cotrain_overhead_<device type>.json"]
    assert path_exists("specco/config.py") and path_exists("bench/results/cp_attention_cuda*.json")
    assert not path_exists("bench/results/no_such_dir_2026-01-01/")


def test_every_mentioned_path_exists():
    missing = []
    for p in list(_sources()) + list(_markdown()):
        for line_no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            for m in path_mentions(line):
                if not path_exists(m):
                    missing.append(f"{_rel(p)}:{line_no}: {m}")
    assert not missing, "paths mentioned but absent from the repository:\n" + "\n".join(missing)


# ---------------------------------------------------------------------------------------------- links

def github_slugs(md: str) -> set[str]:
    """Anchors GitHub gives the headings of `md` (lowercase, punctuation dropped, spaces to '-', -1, -2 for
    repeats); fenced code blocks are skipped."""
    slugs, counts, fenced = set(), {}, False
    for line in md.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = counts.get(s, 0)
        counts[s] = n + 1
        slugs.add(s if n == 0 else f"{s}-{n}")
    return slugs


LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_github_slugs():
    md = "# A b\n## Ring trunk + branch (issue 5)\n```\n# not a heading\n```\n## A b\n"
    assert github_slugs(md) == {"a-b", "ring-trunk--branch-issue-5", "a-b-1"}


@pytest.mark.parametrize("md", [_rel(p) for p in _markdown()])
def test_markdown_links_resolve(md):
    src = ROOT / md
    text = src.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (src.parent / path).resolve() if path else src
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in github_slugs(dest.read_text(encoding="utf-8")):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{md}: broken links: {broken}"
