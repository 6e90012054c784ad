"""Docs that cannot drift: the site's Python examples run, and the docs' relative links resolve.

Every fenced ``python`` block of a page under docs/ runs, in order, in one namespace per page, with the
working directory a scratch folder that holds a small stand-in of the store the guides build
(``./stores/stsb``, namespace ``minilm``: the first 40 STS-B train sentences, ``stsb_train_sentences.txt``
beside this file, built by ``attnstore build`` with the packaged all-MiniLM-L6-v2). A block fenced
```` ```python {.skip} ```` (it needs a daemon, a node or a namespace built with ``--int8``) is compiled,
not run. ``mkdocs build --strict``
checks the site's own links; the link test here also covers README.md, CHANGELOG.md and the notes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CORPUS = Path(__file__).with_name("stsb_train_sentences.txt")

# A fence opens with ```python, optionally followed by attributes in braces ({.skip}); it closes with ```.
FENCE = re.compile(r"^```python[ \t]*(\{[^}]*\})?[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
# [text](target) with a relative target: not a URL, not a bare anchor, not an e-mail address.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def python_blocks(page: Path) -> list[tuple[int, str, bool]]:
    """``(line, code, runs)`` for each fenced Python block of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start(2)) + 1
        runs = ".skip" not in (match.group(1) or "")
        blocks.append((line, match.group(2), runs))
    return blocks


PAGES = sorted(p for p in DOCS.rglob("*.md") if python_blocks(p))


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch folder holding ``stores/stsb`` (namespace ``minilm``), a small stand-in of the guides' store."""
    from attnstore_tools.cli import main

    folder = tmp_path_factory.mktemp("docs-examples")
    code = main(["build", "--model", "minilm", "--corpus", str(CORPUS), "--store", str(folder / "stores" / "stsb"),
                 "--namespace", "minilm", "--no-calibration", "--no-progress"])
    assert code == 0
    return folder


def test_the_docs_have_python_examples_that_run():
    assert any(runs for page in PAGES for _, _, runs in python_blocks(page)), "no runnable example found under docs/"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_a_pages_python_examples_run_in_order(page: Path, stores: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(stores)
    namespace: dict[str, object] = {"__name__": "__docs_example__"}
    for line, code, runs in python_blocks(page):
        compiled = compile(code, f"{page.relative_to(ROOT)}:{line}", "exec")
        if runs:
            exec(compiled, namespace)  # the docs' own examples


def relative_links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # links inside code blocks are code
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


LINKED = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("page", [p for p in LINKED if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_a_pages_relative_links_resolve(page: Path):
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_site_configuration_names_only_pages_that_exist():
    nav = re.findall(r":\s*([\w./-]+\.md)\s*$|^\s*-\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = [a or b for a, b in nav]
    assert pages, "mkdocs.yml has no nav"
    assert [p for p in pages if not (DOCS / p).exists()] == []


os.environ.setdefault("HF_HUB_OFFLINE", "1")
