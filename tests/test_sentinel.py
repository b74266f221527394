"""Sentinel (a primary, a replica, three sentinels on loopback): sentinel:// URLs, WAIT, failover."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_redislock import (
    LockConfigurationError,
    LockNotAcquired,
    LockNotReplicated,
    RedisLock,
    RedisLockError,
)
from celery_redislock.connection import client_for, lock_url, redis_client
from celery_redislock.testing import RedisSentinelServers, RedisServer
from tests.taskapp import make_app
from tests.workers import threads_worker


def test_a_sentinel_broker_url_is_used_with_its_master_name(
    sentinels: RedisSentinelServers, prefix: str
) -> None:
    app = Celery("sentinel", broker=sentinels.url, set_as_current=False)
    app.conf.broker_transport_options = {"master_name": sentinels.master_name}
    assert lock_url(app) == (sentinels.url, "broker_url")  # every sentinel, not just the first
    client, _ = client_for(app)
    lock = RedisLock(client, f"{prefix}:k", ttl=5)
    assert lock.acquire(blocking=False)
    with sentinels.primary.client() as primary:
        assert primary.exists(f"{prefix}:k") == 1
    lock.release()
    app = Celery("sentinel", set_as_current=False)
    app.conf.redislock_url = sentinels.url
    with pytest.raises(LockConfigurationError, match="master name"):
        client_for(app)


def test_replicas_acknowledge_an_acquisition(sentinels: RedisSentinelServers, prefix: str) -> None:
    client = redis_client(sentinels.url, {"master_name": sentinels.master_name})
    lock = RedisLock(client, f"{prefix}:k", ttl=5, replicas=1)
    assert lock.acquire(blocking=False)
    assert sentinels.replica is not None
    with sentinels.replica.client() as replica:
        assert replica.exists(f"{prefix}:k") == 1  # WAIT returned: the replica has it
    lock.release()


def test_an_acquisition_not_acknowledged_is_rolled_back(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client()  # no replica at all
    lock = RedisLock(client, f"{prefix}:k", ttl=5, replicas=1, replica_timeout=0.1)
    with pytest.raises(LockNotReplicated) as refused:
        lock.acquire()
    assert (refused.value.acknowledged, refused.value.wanted) == (0, 1)
    assert isinstance(refused.value, LockNotAcquired)
    assert lock.token is None and client.exists(f"{prefix}:k") == 0  # released again
    with pytest.raises(LockConfigurationError, match="replicas"):
        RedisLock(client, f"{prefix}:k", replicas=-1)
    with pytest.raises(LockConfigurationError, match="replica_timeout"):
        RedisLock(client, f"{prefix}:k", ttl=1, replicas=1, replica_timeout=2)


@pytest.fixture
def failing_over() -> Iterator[RedisSentinelServers]:
    """A sentinel group of the test's own, as its primary will be killed."""
    with RedisSentinelServers() as servers:
        yield servers


def test_locks_keep_working_after_a_failover(failing_over: RedisSentinelServers, prefix: str) -> None:
    group = failing_over
    client = redis_client(
        group.url, {"master_name": group.master_name}, socket_timeout=1, socket_connect_timeout=1
    )
    held = RedisLock(client, f"{prefix}:held", ttl=6, replicas=1)  # on the replica before we go on
    held.acquire()
    os.kill(group.primary.pid, signal.SIGKILL)  # the primary crashes
    assert group.primary.process is not None
    group.primary.process.wait()
    assert group.replica is not None
    deadline = time.monotonic() + 30
    promoted = False
    while not promoted:  # poll the new topology against the deadline
        assert time.monotonic() < deadline, "the sentinels never promoted the replica"
        with group.replica.client() as replica:
            promoted = replica.info("replication")["role"] == "master"
    after = RedisLock(client, f"{prefix}:after", ttl=5)
    deadline = time.monotonic() + 15
    while True:  # the client finds the new primary through the sentinels
        try:
            assert after.acquire(blocking=False)
            break
        except redis.exceptions.ConnectionError:
            assert time.monotonic() < deadline, "the client never reached the new primary"
    assert not held.lost.is_set()  # renewed on the promoted replica, which had the hold
    assert held.owned()
    assert not RedisLock(client, f"{prefix}:held", ttl=5).acquire(blocking=False)
    held.release()
    after.release()
    with pytest.raises(LockNotReplicated):  # no replica left to acknowledge
        RedisLock(client, f"{prefix}:again", ttl=5, replicas=1, replica_timeout=0.1).acquire()
    with group.replica.client() as primary:
        assert primary.exists(f"{prefix}:held", f"{prefix}:after", f"{prefix}:again") == 0


@pytest.mark.parametrize("on_error", ["fail", "run"])
def test_a_task_lock_not_acknowledged_follows_redislock_on_error(
    redis_server: RedisServer, prefix: str, on_error: str
) -> None:
    # No replica acknowledges: like an unreachable Redis, never "busy" (lock_busy="skip" would drop it).
    app = make_app(
        redis_server.url,
        prefix,
        f"q-{prefix}",
        redislock_replicas=1,
        redislock_replica_timeout=0.1,
        redislock_on_error=on_error,
    )
    try:
        with threads_worker(app, concurrency=1):
            executed = app.tasks["taskapp.hold_skip"].delay("x")
            if on_error == "fail":
                with pytest.raises(RedisLockError, match="replica"):
                    executed.get(timeout=30)
                with pytest.raises(RedisLockError, match="enqueue lock"):
                    app.tasks["taskapp.until_executed"].delay("y")
            else:
                assert executed.get(timeout=30) == "x"  # ran unlocked
                assert app.tasks["taskapp.until_executed"].delay("y").get(timeout=30) == "y"  # sent unlocked
    finally:
        app.close()
