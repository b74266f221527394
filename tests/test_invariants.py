"""The invariant checker the suite runs after every test (and the fault tests while they run)
finds what it is meant to find."""

from __future__ import annotations

import pytest
import redis

from celery_redislock import RedisLock
from celery_redislock.lock import companion_key
from celery_redislock.testing import RedisServer
from tests import invariants
from tests.workers import wait_for


def test_the_checker_finds_a_key_without_a_ttl_and_a_lock_left_behind(
    client: redis.Redis, prefix: str
) -> None:
    invariants.check(client, prefix)
    client.set(f"{prefix}:no-ttl", "x")
    with pytest.raises(AssertionError, match=r"no-ttl' has no TTL"):
        invariants.check(client, prefix)
    client.pexpire(f"{prefix}:no-ttl", 60_000)
    invariants.check(client, prefix)  # other data of the test, with a TTL, is fine
    lock = RedisLock(client, f"{prefix}:k", ttl=30)
    lock.acquire()
    with pytest.raises(
        AssertionError, match=r"left in Redis after the test: b'test-\w+:k' = b'[0-9a-f]{32}:"
    ):
        invariants.check(client, prefix)
    invariants.check(client, prefix, locks_may_remain=True)
    lock.release()
    client.zadd(companion_key(f"{prefix}:k", "queue"), {"member": 1})
    client.pexpire(companion_key(f"{prefix}:k", "queue"), 60_000)
    with pytest.raises(AssertionError, match="lock companion"):
        invariants.check(client, prefix)
    client.delete(f"{prefix}:no-ttl", companion_key(f"{prefix}:k", "queue"))
    invariants.check(client, prefix)


@pytest.mark.locks_may_remain("checks the marker itself")
def test_the_marker_lets_a_test_leave_a_lock(client: redis.Redis, prefix: str) -> None:
    RedisLock(client, f"{prefix}:k", ttl=5, watchdog=False).acquire()  # expires by itself


def test_the_sampler_sees_a_key_that_had_no_ttl_for_a_moment(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client()
    sampler = invariants.Sampler(redis_server.client(), prefix, every=0.005).start()
    client.set(f"{prefix}:moment", "x")
    seen = sampler.samples
    wait_for(lambda: sampler.samples >= seen + 2, what="two samples")
    client.delete(f"{prefix}:moment")  # gone before the end of the test: only the sampler saw it
    with pytest.raises(AssertionError, match="moment' had no TTL"):
        sampler.stop()
