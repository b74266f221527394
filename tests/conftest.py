"""Fixtures: real redis-servers started by the suite itself, on 127.0.0.1, stopped by pid."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_redislock.testing import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One server for the session; tests keep to their own ``prefix``."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def fresh_server(prefix: str) -> Iterator[RedisServer]:
    """A server of the test's own, for tests that restart it or count its commands."""
    with RedisServer() as server:
        yield server
        if server.process is not None and server.process.poll() is None:
            assert_every_key_has_a_ttl(server, prefix)


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    connection = redis_server.client()
    yield connection
    connection.close()


@pytest.fixture
def prefix() -> str:
    """A key prefix unique to the test."""
    return f"test-{uuid.uuid4().hex[:12]}"


def keys_without_ttl(client: redis.Redis, prefix: str) -> list[bytes]:
    """Keys of the test (``prefix...`` and companions ``{prefix...}...``) that have no TTL."""
    found = [*client.scan_iter(match=f"{prefix}*"), *client.scan_iter(match=f"{{{prefix}*")]
    return [key for key in found if client.pttl(key) == -1]


def assert_every_key_has_a_ttl(server: RedisServer, prefix: str) -> None:
    checker = server.client()
    try:
        assert keys_without_ttl(checker, prefix) == []
    finally:
        checker.close()


@pytest.fixture(autouse=True)
def _every_key_has_a_ttl(request: pytest.FixtureRequest, prefix: str) -> Iterator[None]:
    """After every test, no key under its prefix lacks a TTL (``fresh_server`` checks its own)."""
    yield
    if "redis_server" in request.fixturenames:
        assert_every_key_has_a_ttl(request.getfixturevalue("redis_server"), prefix)


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
