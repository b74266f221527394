"""The redis-py internals the package leans on, exercised through the package on real servers.

The lock sends its scripts on a pooled connection, packed once
(``ConnectionPool.get_connection``, ``Connection.encoder``, ``Retry.call_with_retry``,
``send_packed_command``, ``read_response``), probes a connection between exchanges by polling
its ``_sock``, waits with ``can_read``, builds the watchdog's
connections from ``connection_pool.connection_kwargs`` and ``connection_class``, and finds
Cluster nodes with ``get_node_from_key`` and ``nodes_manager.get_node_from_slot``. None of
these is public API, so ``make matrix`` runs this module on every redis-py version it
tests: each test drives one path of the package and checks, with a spy on the redis-py
method, that the path went through it and worked.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import socket
import subprocess
import sys
import threading
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.cluster
from redis._parsers.socket import SocketBuffer

from celery_redislock import LockNotOwned, RedisLock
from celery_redislock import _redis as pooled
from celery_redislock._redis import PooledConnection
from celery_redislock.aio import AsyncRedisLock
from celery_redislock.lock import companion_key
from celery_redislock.testing import RedisClusterServers, RedisServer
from examples._support import ROOT
from tests.taskapp import LEASE
from tests.workers import renewed, wait_for

pytestmark = pytest.mark.compat


class Spy:
    """Counts the calls of ``owner.name`` (a redis-py method, or the package's ``_redis._POLL``)
    while the test runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
        self.calls = 0
        original = getattr(owner, name)
        if inspect.iscoroutinefunction(original):

            @functools.wraps(original)
            async def spy(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return await original(*args, **kwargs)

            monkeypatch.setattr(owner, name, spy)
        else:

            @functools.wraps(original)
            def sync_spy(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return original(*args, **kwargs)

            monkeypatch.setattr(owner, name, sync_spy)


def spies(monkeypatch: pytest.MonkeyPatch, client: redis.Redis, *names: str) -> dict[str, Spy]:
    """Spies on ``names`` (``"pool.get_connection"``, ``"connection.send_packed_command"``,
    ``"encoder.encode"``, ``"retry.call_with_retry"``...) of the classes ``client`` uses."""
    pool = client.connection_pool
    connection = pool.make_connection()
    assert isinstance(connection, redis.connection.AbstractConnection)
    owners = {
        "pool": type(pool),
        "connection": type(connection),
        "encoder": type(connection.encoder),
        "retry": type(connection.retry),
    }
    found = {}
    for name in names:
        owner, _, method = name.partition(".")
        found[name] = Spy(monkeypatch, owners[owner], method)
    return found


def assert_called(found: dict[str, Spy]) -> None:
    assert {name: spy.calls for name, spy in found.items() if spy.calls == 0} == {}


def test_one_server_scripts_waits_and_renewals(
    monkeypatch: pytest.MonkeyPatch, client: redis.Redis, prefix: str
) -> None:
    """Acquire, a waiter woken by the release, and the watchdog's renewals, on ``redis.Redis``."""
    found = spies(
        monkeypatch,
        client,
        "pool.get_connection",
        "pool.release",
        "encoder.encode",
        "retry.call_with_retry",
        "connection.send_packed_command",
        "connection.send_command",
        "connection.read_response",
        "connection.can_read",
    )
    kwargs = client.connection_pool.connection_kwargs  # the watchdog's connections are built from it
    assert kwargs["host"] == "127.0.0.1" and "port" in kwargs
    name = f"{prefix}:k"
    holder = RedisLock(client, name, ttl=LEASE)
    assert holder.acquire(blocking=False)
    renewed(client, name)
    waiter = RedisLock(client, name, ttl=LEASE)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=30)))
    thread.start()
    wait_for(lambda: found["connection.can_read"].calls, what="the waiter to block in BLPOP")
    holder.release()
    thread.join(30)
    assert got == [True] and waiter.owned()
    waiter.release()
    assert not holder.lost.is_set() and not waiter.lost.is_set()
    assert_called(found)


def test_redlock_sends_to_every_server_on_pooled_connections(
    monkeypatch: pytest.MonkeyPatch, redlock_servers: list[RedisServer], prefix: str
) -> None:
    """A Redlock tells its servers apart by ``connection_kwargs`` and sends each its script."""
    probe = redlock_servers[0].client()
    found = spies(monkeypatch, probe, "pool.get_connection", "connection.send_packed_command")
    name = f"{prefix}:k"
    lock = RedisLock([server.url for server in redlock_servers], name, ttl=LEASE)
    with pytest.raises(Exception, match="distinct"):
        RedisLock([redlock_servers[0].url, redlock_servers[0].url], name)
    assert lock.acquire(blocking=False)
    renewed(probe, name)
    lock.release()
    assert all(server.client().exists(name) == 0 for server in redlock_servers)
    assert_called(found)
    probe.close()


def killed_between_exchanges(client: redis.Redis, prefix: str) -> tuple[RedisLock, Any]:
    """A lock held through ``client``, whose thread's pooled connection the server then closed
    (``CLIENT KILL``, sent on another connection), and the class of that connection."""
    lock = RedisLock(client, f"{prefix}:k", ttl=LEASE, watchdog=False)
    assert lock.acquire(blocking=False)
    lock.release()  # the server has the release script from now on: one send is one EVALSHA
    assert lock.acquire(blocking=False)
    with PooledConnection(client) as connection:
        assert type(connection._sock) is socket.socket
        assert type(connection._parser._buffer) is SocketBuffer  # bytes read ahead: unread_bytes()
        connection.send_command("CLIENT", "ID")
        own_id = connection.read_response()
    assert client.client_kill_filter(_id=own_id) == 1  # sent on another connection of the pool
    wait_for(  # the server closes a killed client after its reply, in its event loop
        lambda: str(own_id) not in {entry["id"] for entry in client.client_list()},
        what="the server to close the killed connection",
    )
    return lock, type(connection)


def recording_scripts(monkeypatch: pytest.MonkeyPatch, connection_class: Any) -> list[bytes]:
    """The scripts sent on connections of ``connection_class`` from now on."""
    sent: list[bytes] = []
    send = connection_class.send_packed_command

    def recording_send(self: Any, command: Any, check_health: bool = True) -> None:
        sent.extend(part for part in command if b"EVALSHA" in part)
        send(self, command, check_health)

    monkeypatch.setattr(connection_class, "send_packed_command", recording_send)
    return sent


def test_a_release_finds_a_connection_the_server_closed_by_polling_its_socket(
    monkeypatch: pytest.MonkeyPatch, client: redis.Redis, prefix: str
) -> None:
    """Before a release, a thread's pooled connection is probed by polling redis-py's ``_sock`` (a
    plain socket), however recently it was used: one the server closed meanwhile is connected
    afresh before the script is sent, so the release is sent once, and its answer is known."""
    lock, connection_class = killed_between_exchanges(client, prefix)
    found = spies(monkeypatch, client, "connection.can_read")
    polls = Spy(monkeypatch, pooled, "_POLL")
    scripts_sent = recording_scripts(monkeypatch, connection_class)
    lock.release()
    assert (found["connection.can_read"].calls, polls.calls, len(scripts_sent)) == (0, 1, 1)
    assert client.exists(f"{prefix}:k") == 0


def test_a_lock_lost_while_its_connection_was_closed_is_not_owned_at_release(
    client: redis.Redis, prefix: str
) -> None:
    """The key went (expired, deleted, a failover) and the server closed the holder's connection
    (a restart) within a second of its last reply: the release is sent once, on a new connection,
    and says the lock was not held (``LockNotOwned``), not released as a resent release's 0 would
    be counted."""
    lock, _ = killed_between_exchanges(client, prefix)
    client.delete(f"{prefix}:k")
    with pytest.raises(LockNotOwned):
        lock.release()


@pytest.mark.parametrize(
    ("connection", "policy", "polls_and_sends"),
    [("idle", "default", (1, 1)), ("fresh", "no retries", (0, 2)), ("fresh", "default", (0, 2))],
)
def test_an_acquire_on_a_connection_the_server_closed_polls_it_when_idle_and_sends_again_when_fresh(
    monkeypatch: pytest.MonkeyPatch,
    redis_server: RedisServer,
    prefix: str,
    connection: str,
    policy: str,
    polls_and_sends: tuple[int, int],
) -> None:
    """A connection idle for ``FRESH_FOR`` (here 0: every one) is polled before an acquire, and
    connected afresh before the send. One whose last reply was read less than ``FRESH_FOR`` ago
    is not (an acquire's second run answers as its first): the server closed it since, so the
    send breaks, and ``ACQUIRE`` is sent once more on a new connection, by the client's retry
    policy or, for a client that never retries, by the package itself. The lock is taken."""
    if connection == "idle":
        monkeypatch.setattr(pooled, "FRESH_FOR", 0.0)
    retry = {"retry": redis.retry.Retry(redis.backoff.NoBackoff(), 0)} if policy == "no retries" else {}
    client = redis.Redis.from_url(redis_server.url, **retry)
    lock, connection_class = killed_between_exchanges(client, prefix)
    other = RedisLock(client, f"{prefix}:other", ttl=LEASE, watchdog=False)
    polls = Spy(monkeypatch, pooled, "_POLL")
    scripts_sent = recording_scripts(monkeypatch, connection_class)
    assert other.acquire(blocking=False)
    assert (polls.calls, len(scripts_sent)) == polls_and_sends
    assert other.owned()
    other.release()
    lock.release()
    client.close()


def test_cluster_nodes_found_by_key_and_by_slot(
    monkeypatch: pytest.MonkeyPatch, cluster: RedisClusterServers, prefix: str
) -> None:
    """On a Cluster, scripts go to ``get_node_from_key``'s node and renewals to
    ``nodes_manager.get_node_from_slot``'s, each through that node's own connections."""
    client = cluster.client()
    by_key = Spy(monkeypatch, redis.cluster.RedisCluster, "get_node_from_key")
    by_slot = Spy(monkeypatch, redis.cluster.NodesManager, "get_node_from_slot")
    node = client.get_node_from_key(f"{prefix}:k").redis_connection  # type: ignore[no-untyped-call]  # unannotated
    found = spies(monkeypatch, node, "pool.get_connection", "connection.send_packed_command")
    name = f"{prefix}:k"
    lock = RedisLock(client, name, ttl=LEASE)
    assert lock.acquire(blocking=False)
    renewed(client, name)
    lock.release()
    assert not lock.lost.is_set() and client.exists(name) == 0
    assert by_key.calls and by_slot.calls
    assert_called(found)
    client.close()


def test_asyncio_waits_on_a_pooled_connection(
    monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer, prefix: str
) -> None:
    """The asyncio lock's waiter blocks on ``redis.asyncio``'s pooled connection (BLPOP with its
    own deadline: ``read_response(timeout=...)``) and is woken by the release."""
    get_connection = Spy(monkeypatch, redis.asyncio.ConnectionPool, "get_connection")
    release = Spy(monkeypatch, redis.asyncio.ConnectionPool, "release")

    async def scenario() -> list[bool]:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        name = f"{prefix}:k"
        holder = AsyncRedisLock(client, name, ttl=LEASE)
        assert await holder.acquire(blocking=False)
        waiter = AsyncRedisLock(client, name, ttl=LEASE)
        waiting = asyncio.ensure_future(waiter.acquire(timeout=30))
        while not await client.zcard(companion_key(name, "queue")) and not waiting.done():
            await asyncio.sleep(0.01)  # polling for the waiter to queue, with the task's own deadline
        await holder.release()
        got = [await waiting, await waiter.owned()]
        await waiter.release()
        await client.aclose()
        return got

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == [True, True]
    assert get_connection.calls and release.calls


def test_a_redis_py_without_the_buffer_class_still_imports_and_probes_with_can_read(
    redis_server: RedisServer, prefix: str
) -> None:
    """The package imports redis-py's private ``SocketBuffer`` for its stale-connection probe: a
    redis-py that moved it must not break the import, and the probe falls back to ``can_read``
    (in a fresh interpreter, where that module cannot be imported)."""
    code = f"""
import sys
import redis
sys.modules["redis._parsers.socket"] = None  # what a redis-py that moved it looks like
from celery_redislock import RedisLock
from celery_redislock import _redis
assert _redis._SOCKET_BUFFER is None
probes = []
can_read = redis.connection.AbstractConnection.can_read
def counted(self, *args, **kwargs):
    probes.append(1)
    return can_read(self, *args, **kwargs)
redis.connection.AbstractConnection.can_read = counted
client = redis.Redis.from_url({redis_server.url!r})
lock = RedisLock(client, {prefix + ":moved"!r}, ttl=30, watchdog=False)
assert lock.acquire(blocking=False)
lock.release()
assert client.exists({prefix + ":moved"!r}) == 0
print(len(probes) > 0)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]
