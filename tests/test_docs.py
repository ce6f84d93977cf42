"""The README and docs/ stay true: the column tables match the schemas, every relative link
resolves, and the README stays short and links to every page. Reads files only: no cluster, no
torch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from quantdask.store import schema
from quantdask.store.schema import FRAME, FRAMES

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
RESULTS_DOC = DOCS / "results.md"
README_MAX_BYTES = 12_000


FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^[ ]{0,3}\[[^\]]+\]:[ \t]*<?(\S+?)>?(?:[ \t]+\"[^\"]*\")?[ \t]*$",
                            re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
COLUMN_CELL = re.compile(r"^`[a-z][a-z0-9_]*`(?:, `[a-z][a-z0-9_]*`)*$")
CELL_SPLIT = re.compile(r"(?<!\\)\|")


def doc_pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def without_code_blocks(text: str) -> str:
    """``text`` with its fenced code blocks blanked (line count kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for match in HEADING.finditer(without_code_blocks(page.read_text(encoding="utf-8"))):
        base = slug(match.group(2))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def link_targets(page: Path) -> list[str]:
    text = INLINE_CODE.sub("", without_code_blocks(page.read_text(encoding="utf-8")))
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def relative_links(page: Path) -> list[tuple[str, Path, str]]:
    """(as written, the file it names, its #anchor or "") for each link to a repository file."""
    links = []
    for target in link_targets(page):
        if SCHEME.match(target) or target.startswith("//"):
            continue  # https:, mailto:, ...
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page.resolve()
        links.append((target, resolved, anchor))
    return links


def section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    text = without_code_blocks(text)
    matches = list(HEADING.finditer(text))
    found = [m for m in matches if m.group(2) == heading]
    assert len(found) == 1, f"docs/results.md needs exactly one heading {heading!r}"
    start = found[0]
    level = len(start.group(1))
    end = next((m.start() for m in matches
                if m.start() > start.start() and len(m.group(1)) <= level), len(text))
    return text[start.end():end]


def documented_columns(heading: str) -> list[str]:
    """The column names of the one ``| column | meaning |`` table under ``heading``; a row's
    first cell is one or more backticked names (``| `a`, `b` | ... |``)."""
    lines = section(RESULTS_DOC.read_text(encoding="utf-8"), heading).splitlines()
    starts = [i for i, line in enumerate(lines)
              if line.startswith("|") and CELL_SPLIT.split(line)[1].strip() == "column"]
    assert len(starts) == 1, f"{heading!r}: expected one table headed | column | ..."
    names: list[str] = []
    rows = lines[starts[0] + 2:]  # after the header and its |---| line
    for line in rows:
        if not line.startswith("|"):
            break
        first = CELL_SPLIT.split(line)[1].strip()
        assert COLUMN_CELL.fullmatch(first), (
            f"{heading!r}: the first cell must be backticked column names, got {first!r}")
        names += re.findall(r"`([^`]+)`", first)
    return names


@pytest.mark.timeout(30)
def test_every_schema_is_a_declared_frame():
    schemas = [value for name, value in vars(schema).items()
               if name.endswith("_SCHEMA") and isinstance(value, dict)]
    declared = [frame.schema for frame in FRAMES]
    assert all(any(s is d for d in declared) for s in schemas), (
        "each *_SCHEMA of store.schema needs its Frame in store.schema.FRAMES")
    assert len({frame.heading for frame in FRAMES}) == len(FRAMES)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(FRAME))
def test_documented_columns_are_the_schema(name):
    frame = FRAME[name]
    heading = frame.heading
    documented = documented_columns(heading)
    duplicated = sorted({c for c in documented if documented.count(c) > 1})
    assert not duplicated, f"{heading}: documented twice: {duplicated}"
    actual = set(frame.schema)
    assert not actual - set(documented), (
        f"{heading}: undocumented columns of {name}: {sorted(actual - set(documented))}")
    assert not set(documented) - actual, (
        f"{heading}: documented columns {name} lacks: {sorted(set(documented) - actual)}")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target, path, anchor in relative_links(page):
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no heading #{anchor} in {path.name})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


@pytest.mark.timeout(30)
def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail into docs/")


@pytest.mark.timeout(30)
def test_readme_links_to_every_docs_page():
    pages = {path.resolve() for path in DOCS.rglob("*") if path.is_file()}
    assert pages, "docs/ is empty"
    linked = {path for _, path, _ in relative_links(README)}
    missing = sorted(str(p.relative_to(REPO)) for p in pages - linked)
    assert not missing, f"README.md does not link to {missing}"


@pytest.mark.timeout(30)
def test_readme_states_the_test_command():
    # CI (.ci/run) runs "the README's test command".
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(encoding="utf-8"),
                        re.MULTILINE | re.DOTALL)
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    assert "make test" in commands


@pytest.mark.timeout(30)
def test_the_link_checker_sees_links():
    """The checks above are only as good as the parsing: it must see the README's links, and
    a link the checker misses (in a code block) must stay unseen."""
    targets = link_targets(README)
    assert "docs/results.md" in targets
    assert any(t.startswith("https://") for t in targets)
    assert link_targets(DOCS / "results.md"), "docs/results.md has links"
    assert slug("What a backend quantized") == "what-a-backend-quantized"
    assert slug("The `artifacts:` block") == "the-artifacts-block"
