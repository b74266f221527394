"""Every Python code block in the README runs, against a real server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_redislock.testing import RedisServer

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_code_blocks() -> None:
    assert BLOCKS


@pytest.mark.parametrize("source", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(source: str, fresh_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", fresh_server.url)
    exec(compile(source, str(README), "exec"), {"__name__": "readme"})
    assert fresh_server.client().keys("*") == []


#: The README's sections in the order issue 7 asks for (each a prefix of a ``## `` heading).
ORDER = [
    "Quick start",
    "What it guarantees",
    "Lock modes and the Celery paths",
    "Settings and task attributes",
    "How it works",
    "Observability",
    "Testing your own tasks",
    "Benchmarks",
    "Similar projects",
]


def headings(level: str) -> list[str]:
    """The README's headings of one level (``##``, ``###``), code blocks left out."""
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.DOTALL)
    return re.findall(rf"^{level} (.+)$", text, flags=re.MULTILINE)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_the_sections_come_in_the_order_of_the_issue() -> None:
    titles = headings("##")
    where = [next(i for i, title in enumerate(titles) if title.startswith(part)) for part in ORDER]
    assert where == sorted(where), titles


def test_every_link_to_a_section_leads_to_one() -> None:
    anchors = {slug(title) for level in ("##", "###") for title in headings(level)}
    links = re.findall(r"\]\(#([^)]+)\)", README.read_text())
    assert links
    assert sorted(set(links) - anchors) == []


def test_every_setting_and_task_option_has_a_row_with_type_default_and_meaning() -> None:
    from celery_redislock.config import APP_SETTINGS, TASK_OPTIONS

    text = README.read_text()
    section = text[text.index("## Settings and task attributes") : text.index("## How it works")]
    rows = {row.split(" | ")[0].strip("| `"): row for row in re.findall(r"^\| `.+$", section, re.MULTILINE)}
    names = [f"lock_{name}" for name in TASK_OPTIONS] + [f"redislock_{name}" for name in APP_SETTINGS]
    for name in names:
        assert name in rows, f"{name} has no row in the settings tables"
        assert rows[name].count(" | ") >= 3, rows[name]  # name, type, default, meaning


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


def test_every_link_is_absolute_and_leads_to_a_file_of_the_repository() -> None:
    """PyPI shows the README without the repository around it, where a relative link or image
    leads nowhere; every link into the repository names a file that exists."""
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.DOTALL)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [
        target for target in targets if not target.startswith(("https://", "http://", "#", "mailto:"))
    ]
    assert relative == [], f"relative links (PyPI breaks them); run:\n{ABSOLUTE_LINKS}"
    inside = [target.removeprefix(base) for target in targets for base in BASES if target.startswith(base)]
    assert inside
    missing = [path for path in inside if not (README.parent / path.split("#")[0]).exists()]
    assert missing == []
