"""The docs can be followed from a clean clone: every link and path they name exists, and every
section of docs/method.md or docs/architecture.md that code or docs cite is a heading there.

Links: `[text](target)` in README.md and docs/**/*.md, relative to the file (URLs and in-page
anchors skipped). Paths: repository paths such as `docs/results/serving.csv` or
`dspark/training/heldout.py` named in the same files, relative to the repository root.
Citations: `docs/method.md §5.4` (also `§2, §3`) anywhere in the sources, scripts, protos,
manifests and docs; a section is a heading `## §N ...` or `### §N.M ...`. And the README links
every docs page, so none is an orphan.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("benchmarks", "deploy", "docs", "dspark", "gateway", "protos", "scripts", "services", "tests")
SOURCE_SUFFIXES = {".py", ".sh", ".proto", ".yaml", ".yml", ".toml", ".md", ".cfg", ".txt"}
CITED_DOCS = ("docs/method.md", "docs/architecture.md")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:docs|dspark|gateway|services|protos|benchmarks|scripts|tests|deploy)/[\w./-]*\w\."
    r"(?:md|png|csv|json|py|sh|proto|yaml))(?![\w*])"
)
CITATION = re.compile(r"(docs/(?:method|architecture)\.md)((?:[ \t]*,?[ \t]*(?:and[ \t]+)?§[^\s,;)]*)+)")
SECTION_TOKEN = re.compile(r"§([^\s,;)]*)")
HEADING = re.compile(r"^#{2,6}[ \t]+§(\d+(?:\.\d+)*)[ \t]", re.M)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def source_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for name in SOURCE_DIRS:
        files += [
            p for p in sorted((ROOT / name).rglob("*"))
            if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts
        ]
    return files


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def sections(doc: str) -> set[str]:
    return set(HEADING.findall((ROOT / doc).read_text(encoding="utf-8")))


def citations() -> list[tuple[str, str, str]]:
    """(citing file, cited doc, section token as written) for every § citation of CITED_DOCS."""
    found = []
    for path in source_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in CITATION.finditer(text):
            for token in SECTION_TOKEN.findall(match.group(2)):
                found.append((rel(path), match.group(1), token))
    return found


def section_number(token: str) -> str:
    """'5.4' of '5.4', '5.4's', '10.' (a sentence's full stop), '3`.': the number a citation names;
    a token that does not start with one ('Draft' of '§Draft vocabulary') is returned as it is."""
    number = re.match(r"\d+(?:\.\d+)*", token)
    return number.group(0) if number else token


@pytest.mark.parametrize("doc", [rel(p) for p in doc_files()])
def test_every_relative_link_of_a_doc_points_to_an_existing_file(doc):
    path = ROOT / doc
    broken = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if "://" in target or target.startswith(("mailto:", "#")):
            continue
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{doc}: links to missing files: {broken}"


@pytest.mark.parametrize("doc", [rel(p) for p in doc_files()])
def test_every_repository_path_a_doc_names_exists(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = sorted({p for p in REPO_PATH.findall(text) if not (ROOT / p).exists()})
    assert not missing, f"{doc}: names paths that are not in the repository: {missing}"


def test_every_cited_section_is_a_heading_of_the_cited_doc():
    found = citations()
    assert len(found) > 40, f"expected the code's many § citations, found {len(found)}: is CITATION still matching?"
    headings = {doc: sections(doc) for doc in CITED_DOCS}
    bad = [
        f"{src}: {doc} §{token}"
        for src, doc, token in found
        if section_number(token) not in headings[doc]
    ]
    assert not bad, f"citations of sections that are not headings (have {headings}): {bad}"


def test_the_cited_docs_number_each_section_once():
    for doc in CITED_DOCS:
        numbers = HEADING.findall((ROOT / doc).read_text(encoding="utf-8"))
        assert numbers and len(numbers) == len(set(numbers)), f"{doc}: section numbers {numbers}"


def test_nothing_cites_the_design_notes_that_live_outside_the_repository():
    outside = ("DSPARK" + ".md", "ARCHITECTURE" + ".md")  # split so this file does not cite them
    hits = [
        f"{rel(p)}:{n}"
        for p in source_files()
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if any(name in line for name in outside)
    ]
    assert not hits, f"cite docs/method.md or docs/architecture.md instead: {hits}"


def test_the_readme_opens_with_the_serve_and_the_test_command():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    marker = next(i for i, line in enumerate(lines) if line.startswith("<!-- test-command"))
    assert lines[marker + 2].strip() == "bash scripts/install.sh --test && .venv/bin/python -m pytest -q"
    serve = next(i for i, line in enumerate(lines) if "dspark serve" in line)
    assert serve < marker < 20, "the serve command, then the test command, at the top"


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {(ROOT / t.split("#", 1)[0]).resolve() for t in LINK.findall(readme) if "://" not in t}
    unlinked = [rel(p) for p in sorted((ROOT / "docs").rglob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README.md links no page of: {unlinked}"
