"""The watchdog: renewal in batches, loss detection, fork, and a killed holder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redislock import LockNotOwned, RedisLock
from celery_redislock._scripts import RENEW
from celery_redislock.signals import lock_lost
from celery_redislock.testing import RedisServer
from celery_redislock.watchdog import get_watchdog
from tests.conftest import Topology, calls_since, command_calls
from tests.taskapp import LEASE

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def lost_reports() -> Iterator[list[dict[str, Any]]]:
    reports: list[dict[str, Any]] = []

    def receiver(sender: RedisLock, **kwargs: Any) -> None:
        reports.append({"sender": sender, **kwargs})

    lock_lost.connect(receiver, weak=False)
    yield reports
    lock_lost.disconnect(receiver)


def test_a_deleted_key_is_reported_lost_within_one_interval(
    fresh_server: RedisServer,
    prefix: str,
    lost_reports: list[dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = fresh_server.client()
    client.script_load(RENEW.source)  # so that the count below is of renewals only
    lock = RedisLock(client, f"{prefix}:k", ttl=0.6)
    lock.acquire()
    client.delete(f"{prefix}:k")
    before = command_calls(client)
    assert lock.lost.wait(5)
    # The very next renewal (they run every ttl/3) found the key gone: one script call.
    assert calls_since(client, before).get("evalsha") == 1
    assert [(r["sender"], r["key"], r["reason"]) for r in lost_reports] == [
        (lock, f"{prefix}:k", "not owned")
    ]
    assert any(
        record.levelname == "ERROR" and f"{prefix}:k" in record.getMessage() for record in caplog.records
    )
    with pytest.raises(LockNotOwned):
        lock.release()
    assert client.exists(f"{prefix}:k") == 0


def test_a_lock_taken_by_another_token_is_reported_lost_and_left_alone(
    topology: Topology, prefix: str, lost_reports: list[dict[str, Any]]
) -> None:
    """On every topology (one server, Redlock, Cluster, Sentinel)."""
    lock = RedisLock(topology.lock_client(), f"{prefix}:k", ttl=0.6)
    lock.acquire()
    stale_fence = lock.fence
    topology.delete(f"{prefix}:k")
    thief = RedisLock(topology.lock_client(), f"{prefix}:k", ttl=5, watchdog=False)
    thief.acquire()
    assert lock.lost.wait(5)
    with pytest.raises(LockNotOwned):
        lock.extend()
    with pytest.raises(LockNotOwned):
        lock.release()
    assert thief.owned()
    assert thief.fence is not None and stale_fence is not None and thief.fence > stale_fence
    thief.release()


def test_renewal_stops_when_released(fresh_server: RedisServer, prefix: str) -> None:
    client = fresh_server.client()
    lock = RedisLock(client, f"{prefix}:k", ttl=0.6)
    lock.acquire()
    lock.release()
    assert len(get_watchdog()) == 0
    before = command_calls(client)
    threading.Event().wait(0.5)  # longer than two renewal intervals
    assert calls_since(client, before) == {}
    assert client.keys("*") == []


def test_renewal_batches_many_locks_into_few_round_trips(fresh_server: RedisServer, prefix: str) -> None:
    client = fresh_server.client()
    locks = [RedisLock(client, f"{prefix}:{i}", ttl=3) for i in range(3000)]
    for lock in locks:
        lock.acquire()
    before = command_calls(client)
    threading.Event().wait(2.0)  # two renewal intervals of 1 s
    renew_calls = calls_since(client, before).get("evalsha", 0)
    for lock in locks:
        lock.release()
    assert all(not lock.lost.is_set() for lock in locks)
    # Unbatched, 3000 leases would take 6000 calls in two intervals. Batched (2000 leases a call),
    # leases acquired over more than one interval on a loaded machine fall due in a few waves: the
    # contract is at most 10 round trips per interval, whatever the number of locks.
    assert 1 <= renew_calls <= 20


def test_garbage_collected_lock_is_not_renewed(client: redis.Redis, prefix: str) -> None:
    lock = RedisLock(client, f"{prefix}:k", ttl=0.6)
    lock.acquire()
    del lock
    deadline = time.monotonic() + 10
    while client.exists(f"{prefix}:k"):  # expires: nobody renews a lock nobody holds
        assert time.monotonic() < deadline


def test_holder_sigkilled_frees_the_lock_within_one_ttl(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client()
    key = f"{prefix}:k"
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.holder", redis_server.url, key, str(LEASE)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().startswith("acquired")
        waiter = RedisLock(client, key, ttl=5)
        # Held past its lease while the holder lives: its watchdog renews it.
        assert not waiter.acquire(timeout=1.5 * LEASE)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert 0 < client.pttl(key) <= LEASE * 1000  # nobody renews it now: gone within one TTL
        assert waiter.acquire(timeout=10 * LEASE)
        waiter.release()
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait()


def _child(url: str, prefix: str, inherited: RedisLock, results: Any) -> None:
    """In a forked child: the inherited hold is not ours; our own lock is renewed by our watchdog."""
    try:
        try:
            inherited.release()
            released_inherited = True
        except LockNotOwned:
            released_inherited = False
        client = redis.Redis.from_url(url)
        lock = RedisLock(client, f"{prefix}:child", ttl=LEASE)
        lock.acquire()
        kept = not lock.lost.wait(1.5 * LEASE)  # four renewals or more
        results.put((released_inherited, kept and lock.owned(), get_watchdog().pid == os.getpid()))
        lock.release()
    except BaseException as exc:
        results.put(repr(exc))
        raise


def test_fork_child_renews_its_own_locks_and_not_the_parents(redis_server: RedisServer, prefix: str) -> None:
    import multiprocessing

    client = redis_server.client()
    parent_lock = RedisLock(client, f"{prefix}:parent", ttl=LEASE)
    parent_lock.acquire()  # the parent's watchdog thread is running
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_child, args=(redis_server.url, prefix, parent_lock, results))
    child.start()
    try:
        outcome = results.get(timeout=30)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert outcome == (False, True, True)
    assert child.exitcode == 0
    # The parent's watchdog never held the child's lease, and its own hold survived the child.
    assert {lease.key for lease in get_watchdog()._leases} == {f"{prefix}:parent"}
    assert parent_lock.owned()
    parent_lock.release()
    assert client.exists(f"{prefix}:child") == 0
