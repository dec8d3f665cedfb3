"""The documentation's links lead somewhere, and the topology picture is a well-formed SVG.

Every relative link in README.md, docs/*.md and bench/README.md must name a file or directory
of the repository; a link with a ``#fragment`` into a Markdown file must name one of its headings,
slugged as GitHub does.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = REPO_ROOT / "docs"
DOCUMENTS = sorted([REPO_ROOT / "README.md", REPO_ROOT / "bench" / "README.md", *DOCS.glob("*.md")])

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_MARKDOWN_LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def _prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    lines, fenced, fence = [], False, ""
    for line in text.splitlines():
        match = _FENCE.match(line)
        if match and (not fenced or match.group(1) == fence):
            fenced, fence = not fenced, match.group(1)
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = _MARKDOWN_LINK_TEXT.sub(r"\1", heading)
    text = _CODE_SPAN.sub(r"\2", text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    # GitHub keeps letters, digits, marks, connector punctuation (_), hyphens and spaces.
    kept = "".join(ch for ch in text if ch.isalnum() or ch in "_- ")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every fragment that leads into the Markdown file `path`."""
    seen: Counter[str] = Counter()
    found: set[str] = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        # A repeated heading gets -1, -2, ... in order of appearance.
        found.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


def links(path: Path) -> list[str]:
    """Every link target written in the Markdown file `path`, outside code."""
    targets = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        definition = _REFERENCE_DEFINITION.match(line)
        if definition:
            targets.append(definition.group(1))
            continue
        # Code spans keep their place as plain text, so `[x](y)` inside one is not a link,
        # while a link whose text is code (`[`db`](#db)`) still is.
        line = _CODE_SPAN.sub(lambda m: "code" if "](" in m.group(2) else m.group(2), line)
        targets.extend(_INLINE_LINK.findall(line))
    return targets


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    """The relative links of `path` that lead to no file, directory or heading."""
    problems = []
    for target in links(path):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc:
            continue  # http:, https:, mailto: ... are not checked here
        destination = (path.parent / unquote(parts.path)).resolve() if parts.path else path
        if not destination.exists():
            problems.append(f"{target}: {_shown(destination)} does not exist")
        elif (
            parts.fragment
            and destination.suffix == ".md"
            and unquote(parts.fragment) not in anchors(destination)
        ):
            problems.append(f"{target}: no heading #{parts.fragment} in {_shown(destination)}")
    return problems


@pytest.mark.parametrize(
    "heading, slug",
    [
        ("Getting started", "getting-started"),
        ("Reading `outbox-inbox status`", "reading-outbox-inbox-status"),
        (
            "Leases and `idle_in_transaction_session_timeout`",
            "leases-and-idle_in_transaction_session_timeout",
        ),
        ("db upgrade / downgrade", "db-upgrade--downgrade"),
        ("What's new? (v0.1.0)", "whats-new-v010"),
        ("[bench/README.md](../bench/README.md) numbers", "benchreadmemd-numbers"),
    ],
)
def test_heading_slugs_follow_githubs_rules(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_a_repeated_heading_gets_a_numbered_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Setup\n\n## Example\n\n```\n## not a heading\n```\n\n## Example\n")
    assert anchors(page) == {"setup", "example", "example-1"}


def test_links_in_code_are_not_checked(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "[real](other.md#part) and `[not](a-link.md)`\n\n```\n[neither](x.md)\n```\n"
        "[`code text`](#here)\n"
    )
    assert links(page) == ["other.md#part", "#here"]


def test_a_link_to_a_missing_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Part one\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#part-one) [bad](other.md#part-two) [gone](nowhere.md)\n")
    problems = broken_links(page)
    assert len(problems) == 2
    assert "#part-two" in problems[0]
    assert "nowhere.md" in problems[1]


@pytest.mark.parametrize(
    "document", DOCUMENTS, ids=[str(p.relative_to(REPO_ROOT)) for p in DOCUMENTS]
)
def test_every_relative_link_leads_to_an_existing_file_and_heading(document: Path) -> None:
    problems = broken_links(document)
    assert not problems, f"{document.relative_to(REPO_ROOT)}:\n" + "\n".join(problems)


def test_the_docs_index_links_every_page_of_docs() -> None:
    linked = {
        (DOCS / urlsplit(target).path).resolve()
        for target in links(DOCS / "index.md")
        if not urlsplit(target).scheme
    }
    pages = {p.resolve() for p in DOCS.glob("*.md") if p.name != "index.md"}
    missing = sorted(p.name for p in pages - linked)
    assert not missing, f"docs/index.md does not link {missing}"


def test_topology_svg_is_well_formed_svg() -> None:
    root = ET.parse(DOCS / "topology.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.get("viewBox")
    texts = " ".join("".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text"))
    for name in ("commands", "events", "retry", "dead_letter", "unroutable", "<service>.inbox"):
        assert name in texts, f"topology.svg does not show {name}"


def test_every_public_method_of_the_handler_contexts_is_documented_on_a_page() -> None:
    from outbox_inbox import AsyncHandlerContext, BatchContext, HandlerContext

    pages = "\n".join(p.read_text() for p in DOCS.glob("*.md"))
    for context in (HandlerContext, AsyncHandlerContext, BatchContext):
        for name in (
            n for n in vars(context) if not n.startswith("_") and callable(vars(context)[n])
        ):
            assert f"ctx.{name}(" in pages or f"batch.{name}(" in pages, (
                f"{context.__name__}.{name}"
            )


def test_the_batch_example_of_concepts_runs_twice_in_one_folder(tmp_path: Path) -> None:
    import subprocess
    import sys

    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "concepts.md").read_text(), re.S)
    [example] = [b for b in blocks if "batch=True" in b and "ServiceHarness" in b]
    for _ in range(2):  # a reader runs it again after an edit
        ran = subprocess.run(
            [sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True
        )
        assert ran.returncode == 0, ran.stderr[-2000:]


def test_the_examples_tests_assert_no_time_bound() -> None:
    # A user's test that bounds a duration fails on a loaded machine with a correct verdict.
    import ast

    for path in sorted((REPO_ROOT / "examples").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            if not any(isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in node.ops):
                continue
            names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            timed = {n for n in names if n.endswith("_s") or "seconds" in n}
            assert not timed, f"{path.relative_to(REPO_ROOT)}:{node.lineno} bounds {timed}"
