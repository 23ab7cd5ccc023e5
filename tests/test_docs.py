"""Every citation of the spec resolves (docs/README.md#how-to-cite-it): each `docs/<page>.md` or
`docs/<page>.md#<anchor>` in a .py, .md, .toml, .sh or .cfg file of the repository names a page and a heading
that exist, sections are cited in that one form, the pages' own relative links resolve, and nothing cites the
design notes the project started from (only docs/ may say where they came from)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SUFFIXES = {".py", ".md", ".toml", ".sh", ".cfg"}
SKIP_DIRS = {
    ".git",
    ".venv",
    "runs",
    "build",
    "dist",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
}
HERE = Path(__file__).resolve()  # this file quotes bad citations on purpose

CITATION = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)(?:#([\w-]+))?")
OTHER_FORM = re.compile(r"(?<![\w/.-])docs/[\w.-]+\.md(?:,\s*\"|,?\s*§)")
NOTES = re.compile(r"(?<![\w/.-])(?:hetpipe|design|style)\.md\b")
LINK = re.compile(r"\]\((?![a-z]+://)([\w.-]+\.md)?(?:#([\w-]+))?\)")
HEADING = re.compile(r"#{1,6}\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"\s*(```|~~~)")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Anchors of every heading of a markdown text outside fenced code; repeats get -1, -2, ... as on
    GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match[1])
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def pages(docs: Path) -> dict[str, set[str]]:
    """Every page of docs/ and its anchors."""
    return {path.name: anchors(path.read_text()) for path in sorted(docs.glob("*.md"))}


def repo_files(root: Path) -> list[Path]:
    """The repository's files to check: git's tracked and untracked-but-not-ignored ones, else a walk."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.splitlines()
        paths = [root / p for p in out]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in root.rglob("*") if not SKIP_DIRS & set(p.relative_to(root).parts)]
    return sorted(p for p in paths if p.suffix in SUFFIXES and p.is_file() and p.resolve() != HERE)


def problems(
    where: str, lines: Iterable[str], known: dict[str, set[str]], *, in_docs: bool = False
) -> list[str]:
    """What is wrong with the citations in `lines` (`where` names the file); empty when nothing is."""
    found = []
    for number, line in enumerate(lines, 1):
        at = f"{where}:{number}"
        for match in CITATION.finditer(line):
            page, anchor = match[1], match[2]
            if page not in known:
                found.append(f"{at}: {match[0]} cites no page of docs/ (pages: {', '.join(sorted(known))})")
            elif anchor is not None and anchor not in known[page]:
                found.append(
                    f"{at}: {match[0]}: docs/{page} has no section #{anchor} "
                    f"(its sections: {', '.join(sorted(known[page]))})"
                )
        for match in OTHER_FORM.finditer(line):
            found.append(
                f"{at}: {match[0]}...: cite a section as docs/<page>.md#<anchor> "
                "(docs/README.md#how-to-cite-it)"
            )
        if not in_docs:
            for match in NOTES.finditer(line):
                found.append(
                    f"{at}: cites {match[0]}, which is not in the repository: cite docs/<page>.md#<anchor>"
                )
    return found


def link_problems(page: str, text: str, known: dict[str, set[str]]) -> list[str]:
    """Relative links of one docs/ page (`[x](wsp.md#gate)`, `[x](#terms)`) that do not resolve."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in LINK.finditer(line):
            target, anchor = match[1] or page, match[2]
            if target not in known:
                found.append(f"docs/{page}:{number}: link to {target}, which is not a page of docs/")
            elif anchor is not None and anchor not in known[target]:
                found.append(f"docs/{page}:{number}: link to {target}#{anchor}: no such section")
    return found


def test_every_citation_of_the_spec_resolves() -> None:
    known = pages(DOCS)
    found = []
    for path in repo_files(ROOT):
        relative = path.relative_to(ROOT)
        found += problems(
            str(relative),
            path.read_text(errors="replace").splitlines(),
            known,
            in_docs=relative.parts[0] == "docs",
        )
    assert not found, "\n".join(found)


def test_the_pages_links_resolve() -> None:
    known = pages(DOCS)
    found = [p for page in known for p in link_problems(page, (DOCS / page).read_text(), known)]
    assert not found, "\n".join(found)


def test_the_walk_sees_the_code_and_the_readme() -> None:
    files = {str(p.relative_to(ROOT)) for p in repo_files(ROOT)}
    assert {
        "README.md",
        "hetpipe/core/wsp/state.py",
        "worker/transfer.py",
        "setup.cfg",
        "docs/wsp.md",
    } <= files
    assert not any(name.startswith(".venv/") for name in files)


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Bounded memory", "bounded-memory"),
        ("The PS path", "the-ps-path"),
        ("Where a wave's time goes", "where-a-waves-time-goes"),
        ("`[ps] buffers`", "ps-buffers"),
        ("wsp_schedule and D + 2", "wsp_schedule-and-d--2"),
    ],
)
def test_slug_is_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_headings_in_code_blocks_are_not_sections_and_repeats_are_numbered() -> None:
    text = "# Top\n## Gate\n```\n# not a heading\n```\n## Gate\n### Rebase ##\n"
    assert anchors(text) == {"top", "gate", "gate-1", "rebase"}


KNOWN = {"wsp.md": {"gate", "bounded-memory"}, "README.md": {"how-to-cite-it"}}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("see docs/wsp.md#gate and docs/wsp.md", []),
        ("(docs/README.md#how-to-cite-it).", []),
        ("see docs/wsp.md#gates", ["x.py:1: docs/wsp.md#gates: docs/wsp.md has no section #gates"]),
        ("see docs/nope.md", ["x.py:1: docs/nope.md cites no page of docs/"]),
        ('see docs/wsp.md, "Gate"', ['x.py:1: docs/wsp.md, "...: cite a section as docs/<page>.md#<anchor>']),
        ("see docs/wsp.md §Gate", ["x.py:1: docs/wsp.md §...: cite a section as docs/<page>.md#<anchor>"]),
        ("the rules of hetpipe.md §3", ["x.py:1: cites hetpipe.md, which is not in the repository"]),
        ("threads (design.md) and style.md", ["x.py:1: cites design.md", "x.py:1: cites style.md"]),
        ("hetpipe/profiles/README.md and /work/shared/docs/x.md are not citations", []),
    ],
)
def test_problems_name_the_file_line_and_fix(line: str, expected: list[str]) -> None:
    found = problems("x.py", [line], KNOWN)
    assert len(found) == len(expected), found
    for got, want in zip(found, expected, strict=True):
        assert got.startswith(want), (got, want)


def test_docs_may_name_the_notes_they_came_from() -> None:
    assert problems("docs/README.md", ["the notes (hetpipe.md, design.md)"], KNOWN, in_docs=True) == []


def test_link_problems() -> None:
    text = "[a](wsp.md#gate) [b](#how-to-cite-it) [c](wsp.md#nope) [d](gone.md) [e](https://x.org/a.md)"
    found = link_problems("README.md", text, KNOWN)
    assert found == [
        "docs/README.md:1: link to wsp.md#nope: no such section",
        "docs/README.md:1: link to gone.md, which is not a page of docs/",
    ]
