"""Each thread's connection for the lock's calls on a plain ``redis.Redis`` (``_redis.PooledConnection``).

A thread keeps one connection of the client's pool between its calls and gives it back
when it ends; a forked child, and a call made inside another on the same thread (as a
signal handler's would be), use connections of their own. Connections are counted on the
server (``CLIENT LIST``, by the client's name). The interrupted and the stale connection:
``tests/test_interrupted_calls.py`` and ``tests/test_lock.py::test_works_after_a_redis_restart``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.connection
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock import RedisLock
from celery_redislock.testing import RedisServer


def named_connections(server: RedisServer, name: str) -> int:
    """How many connections named ``name`` the server has."""
    admin = server.client()
    try:
        return sum(1 for connection in admin.client_list() if connection["name"] == name)
    finally:
        admin.close()


def lock_calls(client: redis.Redis, name: str, count: int = 5) -> None:
    """``count`` acquire/release pairs of the free lock ``name``, each answered rightly."""
    for _ in range(count):
        lock = RedisLock(client, name, ttl=5, watchdog=False)
        assert lock.acquire(blocking=False)
        lock.release()


def test_a_thread_keeps_one_connection_and_gives_it_back_when_it_ends(
    redis_server: RedisServer, prefix: str
) -> None:
    name = f"{prefix}-threads"
    client = redis.Redis.from_url(redis_server.url, client_name=name)
    counted = threading.Barrier(3)

    def work(key: str) -> None:
        lock_calls(client, key)
        counted.wait(30)  # alive while the main thread counts
        counted.wait(30)

    for round_ in range(2):
        threads = [threading.Thread(target=work, args=(f"{prefix}:{round_}:{n}",)) for n in range(2)]
        for thread in threads:
            thread.start()
        counted.wait(30)
        # one each, however many calls; in the second round, the first round's given back
        assert named_connections(redis_server, name) == 2
        counted.wait(30)
        for thread in threads:
            thread.join(30)
    client.close()


def test_a_forked_child_locks_on_a_connection_of_its_own(redis_server: RedisServer, prefix: str) -> None:
    name = f"{prefix}-fork"
    client = redis.Redis.from_url(redis_server.url, client_name=name)
    lock_calls(client, f"{prefix}:parent")  # this thread's connection, inherited by the child
    pid = os.fork()
    if pid == 0:  # the child: its calls answered rightly, on a second connection
        code = 1
        try:
            lock_calls(client, f"{prefix}:child")
            code = 0 if named_connections(redis_server, name) == 2 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    lock_calls(client, f"{prefix}:parent")  # the parent's connection still reads its own replies
    client.close()


def test_a_call_inside_another_on_the_same_thread_uses_another_connection(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a signal handler's call would, between the outer call's send and its read: each reads
    its own reply (a busy lock's refusal is not taken for the outer grant, nor the other way),
    without a resend (no retries: a reply lost with its connection would fail the call)."""
    client = redis.Redis.from_url(redis_server.url, retry=Retry(NoBackoff(), 0), socket_timeout=5)
    other = redis_server.client()
    busy = RedisLock(other, f"{prefix}:busy", ttl=5)
    assert busy.acquire(blocking=False)
    lock_calls(client, f"{prefix}:warm")  # the thread's connection exists and is idle
    inner: list[bool] = []
    fired: list[int] = []
    original = redis.connection.AbstractConnection.read_response

    def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not fired:  # the outer call's read, once: the inner call's own reads pass
            fired.append(1)
            inner.append(RedisLock(client, f"{prefix}:busy", ttl=5).acquire(blocking=False))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", read_response)
    outer = RedisLock(client, f"{prefix}:outer", ttl=5, watchdog=False)
    assert outer.acquire(blocking=False)
    assert inner == [False]
    monkeypatch.undo()
    outer.release()
    busy.release()
    client.close()
    other.close()


@contextlib.contextmanager
def idle_threads(client: redis.Redis, prefix: str, count: int, *, together: bool) -> Iterator[None]:
    """``count`` threads that each lock once, then stay alive and idle for the block: one after
    another (only the connections they keep can run out), or ``together`` (their first calls at
    once). A thread's failure fails the block's start."""
    one_at_a_time = contextlib.nullcontext() if together else threading.Lock()
    start, done = threading.Barrier(count), threading.Barrier(count + 1)
    failed: list[BaseException] = []

    def work(key: str) -> None:
        try:
            start.wait(60)
            with one_at_a_time:
                lock_calls(client, key, count=1)
        except BaseException as exc:
            failed.append(exc)
        done.wait(60)  # alive, idle, while the block runs
        done.wait(60)

    threads = [threading.Thread(target=work, args=(f"{prefix}:{n}",)) for n in range(count)]
    for thread in threads:
        thread.start()
    done.wait(60)
    try:
        assert failed == []
        yield
    finally:
        done.wait(60)
        for thread in threads:
            thread.join(60)


def test_a_bounded_pool_lends_per_call_so_idle_threads_keep_none(
    redis_server: RedisServer, prefix: str
) -> None:
    """With ``max_connections`` set, an idle thread keeps no connection out of the pool: six
    threads that each locked, all still alive, leave the pool of four to the next caller."""
    name = f"{prefix}-bounded"
    client = redis.Redis.from_url(redis_server.url, client_name=name, max_connections=4)
    with idle_threads(client, prefix, 6, together=False):
        assert client.ping()
        lock_calls(client, f"{prefix}:main")
        assert named_connections(redis_server, name) <= 4
    client.close()


def test_idle_threads_keep_at_most_half_of_a_default_pool(redis_server: RedisServer, prefix: str) -> None:
    """A pool left at redis-py's default ``max_connections`` (100 since redis-py 8): more threads
    than that, each having locked and all still alive (a gevent worker's greenlets), keep at most
    half of it between their calls; the others, and the next caller, lend per call."""
    name = f"{prefix}-default"
    client = redis.Redis.from_url(redis_server.url, client_name=name)
    limit = client.connection_pool.max_connections
    threads_count = min(limit + 20, 200)  # past the pool's bound where it has one
    with idle_threads(client, prefix, threads_count, together=False):
        lock_calls(client, f"{prefix}:main")
        assert client.ping()
        assert named_connections(redis_server, name) <= min(limit // 2, threads_count) + 1
    client.close()


def test_threads_that_first_lock_at_once_keep_at_most_half_of_a_default_pool(
    redis_server: RedisServer, prefix: str
) -> None:
    """Threads whose first calls start together (a burst of tasks in a gevent worker): a place
    among the kept connections is claimed before its connection is made, so that they cannot
    all find room while they connect."""
    client = redis.Redis.from_url(redis_server.url)
    pool = client.connection_pool
    limit = pool.max_connections
    if limit > 1000:
        pytest.skip(f"redis-py {redis.__version__}'s default pool has no bound to keep under")
    with idle_threads(client, prefix, limit * 4 // 5, together=True):
        # Half the pool is free for others: the threads keep at most half, and the connections
        # their calls over that bound checked out are back (open, idle, in the pool).
        others = [pool.get_connection() for _ in range(limit - limit // 2)]
        for connection in others:
            pool.release(connection)
    client.close()
