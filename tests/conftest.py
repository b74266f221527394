"""Fixtures: real redis-servers started by the suite itself, on 127.0.0.1, stopped by pid.

After every test, the invariant checker (``tests.invariants``) runs on the
servers the test used: no key of the test without a TTL, and no lock of the
test left once its tasks finished (unless marked ``locks_may_remain``).
"""

from __future__ import annotations

import gc
import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_redislock.testing import RedisServer
from tests import invariants


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One server for the session; tests keep to their own ``prefix``."""
    with RedisServer() as server:
        yield server
        gc.collect()  # Celery results left in reference cycles unsubscribe now, while the server is up


@pytest.fixture
def fresh_server(request: pytest.FixtureRequest, prefix: str) -> Iterator[RedisServer]:
    """A server of the test's own, for tests that restart it or count its commands."""
    with RedisServer() as server:
        yield server
        gc.collect()  # as for redis_server
        if server.process is not None and server.process.poll() is None:
            check_invariants(request, server, prefix)


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    connection = redis_server.client()
    yield connection
    connection.close()


@pytest.fixture
def prefix() -> str:
    """A key prefix unique to the test."""
    return f"test-{uuid.uuid4().hex[:12]}"


def check_invariants(request: pytest.FixtureRequest, server: RedisServer, prefix: str) -> None:
    """The invariants for ``prefix`` on ``server``, as the test's ``locks_may_remain`` marker allows."""
    checker = server.client()
    try:
        marked = request.node.get_closest_marker("locks_may_remain") is not None
        invariants.check(checker, prefix, locks_may_remain=marked)
    finally:
        checker.close()


@pytest.fixture(autouse=True)
def _invariants(request: pytest.FixtureRequest, prefix: str) -> Iterator[None]:
    """After every test, the invariants on the session server (``fresh_server`` checks its own)."""
    yield
    if "redis_server" in request.fixturenames:
        check_invariants(request, request.getfixturevalue("redis_server"), prefix)


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command so far (INFO commandstats), less the INFO calls themselves."""
    stats = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if name != "cmdstat_info"
    }


def calls_since(client: redis.Redis, before: dict[str, int]) -> dict[str, int]:
    after = command_calls(client)
    return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}
