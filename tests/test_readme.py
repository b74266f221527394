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
