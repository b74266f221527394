"""Every Python code block of the README and of docs/ runs, against a real server; the README keeps
its sections in a newcomer's order, and every link leads to a file and a heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_redislock.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: The README and the pages of the docs site (mkdocs.yml), each a Markdown file of the repository.
PAGES = [README, *sorted(DOCS.glob("*.md"))]


def code_blocks(page: Path) -> list[str]:
    """The page's ``python`` code blocks; a block that must not run (a shell command, a config
    snippet, another package's code) is fenced as ``sh``, ``text`` or without a language."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)


BLOCKS = [(page, source) for page in PAGES for source in code_blocks(page)]
IDS = [f"{page.relative_to(ROOT)}:{number}" for page in PAGES for number in range(len(code_blocks(page)))]


def test_the_readme_and_the_docs_have_code_blocks() -> None:
    assert code_blocks(README)
    assert {page.name for page, _ in BLOCKS} > {README.name}


@pytest.mark.parametrize(("page", "source"), BLOCKS, ids=IDS)
def test_code_block_runs(
    page: Path, source: str, fresh_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", fresh_server.url)
    exec(compile(source, str(page), "exec"), {"__name__": "readme"})
    client = fresh_server.client()
    marks = client.keys("*:superseded:*")  # a dropped message's mark outlives it, for a redelivery
    assert all(client.pttl(mark) > 0 for mark in marks)
    assert sorted(set(client.keys("*")) - set(marks)) == []


#: The README's sections in the order a newcomer reads them (each a prefix of a ``## `` heading).
ORDER = [
    "Install",
    "Quick start",
    "What it guarantees",
    "Lock modes at a glance",
    "Documentation",
    "Benchmarks",
    "Similar projects",
]


def headings(page: Path, level: str = "##") -> list[str]:
    """The page's headings of one level and deeper (``##``: ``##``, ``###``...), code blocks left out."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return re.findall(rf"^{level}#* (.+)$", text, flags=re.MULTILINE)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs make it."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def section(page: Path, title: str) -> str:
    """The text of the page's ``## {title}`` section, up to the next ``## `` heading."""
    text = page.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : None if end == -1 else end]


def test_the_readme_is_short_and_its_sections_come_in_a_newcomers_order() -> None:
    assert len(README.read_text().splitlines()) <= 260
    titles = headings(README)
    where = [next(i for i, title in enumerate(titles) if title.startswith(part)) for part in ORDER]
    assert where == sorted(where), titles


REPOSITORY = "https://github.com/celery-redislock/celery-redislock"
#: Where links into the repository point: files, and images (served raw).
BASES = (
    f"{REPOSITORY}/blob/main/",
    "https://raw.githubusercontent.com/celery-redislock/celery-redislock/main/",
)
#: Makes every relative link and image of the README absolute (run it after editing the README).
ABSOLUTE_LINKS = (
    'python3 -c \'import pathlib,re; p=pathlib.Path("README.md"); p.write_text(re.sub('
    'r"(!?)(\\[[^\\]]*\\])\\((?!https?://|#|mailto:)([^)\\s]+)\\)", lambda m: m[1]+m[2]+"("+('
    f'"{BASES[1]}" if m[1] else "{BASES[0]}")+m[3]+")", p.read_text()))\''
)


def links(page: Path) -> list[str]:
    """Where the page's links and images point, code blocks left out."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_readme_link_is_absolute() -> None:
    """PyPI shows the README without the repository around it, where a relative link or image
    leads nowhere."""
    relative = [
        target for target in links(README) if not target.startswith(("https://", "http://", "#", "mailto:"))
    ]
    assert relative == [], f"relative links (PyPI breaks them); run:\n{ABSOLUTE_LINKS}"


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_link_leads_to_a_file_and_a_heading_that_exist(page: Path) -> None:
    """The README links into the repository by absolute URL, the docs pages link to each other
    relatively and to the rest of the repository by absolute URL (mkdocs builds docs/ alone);
    every file named exists, and every ``#anchor`` is a heading of the page it names."""
    targets: list[Path] = []
    for target in links(page):
        inside = [target.removeprefix(base) for base in BASES if target.startswith(base)]
        if inside:
            targets.append(ROOT / inside[0])
        elif not target.startswith(("https://", "http://", "mailto:")):
            assert page.parent == DOCS or target.startswith("#"), target
            targets.append(page if target.startswith("#") else page.parent / target)
    assert targets
    for linked in targets:
        path, _, anchor = str(linked).partition("#")
        assert Path(path).exists(), f"{page.name}: {linked}"
        if anchor:
            anchors = {slug(title) for title in headings(Path(path))}
            assert anchor in anchors, f"{page.name}: {linked}"


def test_the_loggers_table_names_every_logger_of_the_package() -> None:
    """Each module logs under its own name (``logging.getLogger(__name__)``): the table in
    docs/operations.md has a row for each such module, and names no other."""
    package = ROOT / "celery_redislock"
    logging_modules = {
        f"celery_redislock.{path.stem}"
        for path in package.glob("*.py")
        if "logging.getLogger(__name__)" in path.read_text()
    }
    table = section(DOCS / "operations.md", "Observability: logs and signals")
    first_cells = re.findall(r"^\| (`celery_redislock\..+?) \|", table, flags=re.MULTILINE)
    named = set()
    for cell in first_cells:  # `celery_redislock.lock`, `.redlock`, `.aio`
        for name in re.findall(r"`([\w.]+)`", cell):
            named.add(name if name.startswith("celery_redislock") else f"celery_redislock{name}")
    assert named == logging_modules


def first_cells(text: str) -> list[str]:
    """The code span opening each table row in ``text`` (quotes dropped), header rows left out."""
    lines = text.splitlines()
    headers = {number - 1 for number, line in enumerate(lines) if line.startswith("| ---")}
    rows = [line for number, line in enumerate(lines) if number not in headers]
    return [span.strip('"') for row in rows for span in re.findall(r"^\| `([^`]+)`", row)]


def test_every_lock_mode_and_busy_policy_has_its_rows() -> None:
    """The README's modes at a glance, and the modes, paths and busy tables of docs/tasks.md."""
    from celery_redislock.config import BUSY, MODES

    tasks = DOCS / "tasks.md"
    assert first_cells(section(README, "Lock modes at a glance")) == list(MODES)
    assert first_cells(section(tasks, "Lock modes")) == list(MODES)
    assert first_cells(section(tasks, "The Celery paths each mode covers")) == list(MODES)
    assert first_cells(section(tasks, "When the lock is busy: `lock_busy`")) == list(BUSY)


def test_every_setting_and_task_option_has_a_row_with_type_default_and_meaning() -> None:
    from celery_redislock.config import APP_SETTINGS, TASK_OPTIONS

    tables = section(DOCS / "tasks.md", "Options") + section(DOCS / "operations.md", "Settings")
    rows = {row.split(" | ")[0].strip("| `"): row for row in re.findall(r"^\| `.+$", tables, re.MULTILINE)}
    names = [f"lock_{name}" for name in TASK_OPTIONS] + [f"redislock_{name}" for name in APP_SETTINGS]
    for name in names:
        assert name in rows, f"{name} has no row in the settings tables"
        assert rows[name].count(" | ") >= 3, rows[name]  # name, type, default, meaning
